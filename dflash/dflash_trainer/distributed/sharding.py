"""How the drafter ranks hold the drafter: a full copy each (DDP), or split across them (FSDP).

`parallel.drafter_sharding`:
- "ddp" (default): every drafter rank keeps the whole drafter in the training dtype, fp32 master
  weights and AdamW state; DDP all-reduces gradients. Fastest while it fits (a 1 B-parameter drafter
  needs ~16 GB of weights, masters and optimizer state).
- "fsdp": torch's fully_shard (FSDP2) per decoder layer and at the root. Parameters are fp32 DTensors
  split over the drafter ranks (they are the master weights), gathered in the training dtype for each
  layer's forward and backward; gradients are reduce-scattered in fp32; AdamW state is sharded too.
  For drafters whose masters and optimizer state do not fit on one GPU.

Both average gradients over the drafter ranks, so the trainer's loss normalisation (grad scale
D / total weight) is the same. Parallelism stays here, out of the model and the train loop.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from ..model.drafter import DFlashDrafter
from ..model.optim import MasterWeightAdamW

SHARDINGS = ("ddp", "fsdp")


class Replicated:
    """A full drafter per rank; DDP over the drafter group when there is more than one."""

    name = "ddp"
    serial_compile = True  # ranks can take turns compiling: the bare drafter's forward needs no peer
    compiled_layers = True

    def __init__(self, drafter: DFlashDrafter, device, dtype, group=None, num_ranks: int = 1):
        self.drafter = drafter.to(device=device, dtype=dtype)
        self.module = self.drafter
        if num_ranks > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.module = DDP(self.drafter, process_group=group,
                              device_ids=[device] if torch.device(device).type == "cuda" else None)

    def gradient_sync(self, enabled: bool):
        """Skip the all-reduce on all but the last micro-batch of a step."""
        return self.module.no_sync() if self.module is not self.drafter and not enabled else nullcontext()

    def full_state(self, opt: MasterWeightAdamW | None, lead: bool) -> tuple[dict | None, dict | None]:
        """(model state in the training dtype, optimizer state or None without opt) on the lead rank."""
        if not lead:
            return None, None
        weights = {k: v.detach().contiguous().cpu() for k, v in self.drafter.state_dict().items()}
        return weights, opt.state_dict() if opt is not None else None

    def load(self, checkpoint_dir: Path, optimizer_state: dict, opt: MasterWeightAdamW) -> None:
        if "fsdp_full" in optimizer_state:
            raise ValueError(f"{checkpoint_dir} was written with parallel.drafter_sharding = 'fsdp'; resume "
                             "with the same setting")
        self.drafter.load_state_dict(DFlashDrafter.from_pretrained(checkpoint_dir).state_dict())
        opt.load_state_dict(optimizer_state)


class Sharded:
    """FSDP2: fully_shard per decoder layer and at the root, fp32 sharded masters, compute in `dtype`."""

    name = "fsdp"
    # The forward all-gathers parameters from every drafter rank: the ranks must compile together (no
    # turn-taking lock), and a layer compiled whole would have to trace FSDP's hooks, so the layers run
    # eagerly around the compiled flex_attention.
    serial_compile = False
    compiled_layers = False

    def __init__(self, drafter: DFlashDrafter, device, dtype, group=None, num_ranks: int = 1):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = torch.device(device)
        self.dtype = dtype
        self.drafter = drafter.to(device=device, dtype=torch.float32)
        mesh = DeviceMesh.from_group(group, device.type) if group is not None else None
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # DFlash 2's selector runs outside the drafter's forward (in the loss): its own unit gathers its weights.
        units = [*self.drafter.layers] + ([self.drafter.candidate_selector]
                                          if self.drafter.candidate_selector is not None else [])
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(self.drafter, mesh=mesh, mp_policy=policy)
        self.module = self.drafter

    def gradient_sync(self, enabled: bool):
        self.drafter.set_requires_gradient_sync(enabled)
        return nullcontext()

    def _options(self, full: bool = True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=full, cpu_offload=full)

    def full_state(self, opt: MasterWeightAdamW | None, lead: bool) -> tuple[dict | None, dict | None]:
        """Collective: every drafter rank must call it. The lead gets the gathered state."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        masters = get_model_state_dict(self.drafter, options=self._options())
        adamw = get_optimizer_state_dict(self.drafter, opt.opt, options=self._options()) if opt is not None else None
        if not lead:
            return None, None
        # The HF directory holds the training dtype, like a DDP run's; the fp32 masters go with the optimizer.
        model = {k: v.to(self.dtype) for k, v in masters.items()}
        return model, {"fsdp_full": {"masters": masters, "adamw": adamw}} if opt is not None else None

    def load(self, checkpoint_dir: Path, optimizer_state: dict, opt: MasterWeightAdamW) -> None:
        """Every rank reads the full state from the (shared) checkpoint and keeps its own shard."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        full = optimizer_state.get("fsdp_full")
        if full is None:
            raise ValueError(f"{checkpoint_dir} was written with parallel.drafter_sharding = 'ddp'; resume "
                             "with the same setting")
        set_model_state_dict(self.drafter, full["masters"], options=self._options())
        set_optimizer_state_dict(self.drafter, opt.opt, full["adamw"], options=self._options())


def shard_drafter(kind: str, drafter: DFlashDrafter, device, dtype, group=None, num_ranks: int = 1):
    if kind == "ddp":
        return Replicated(drafter, device, dtype, group, num_ranks)
    if kind == "fsdp":
        if num_ranks < 2:
            return Replicated(drafter, device, dtype)  # nothing to shard across
        return Sharded(drafter, device, dtype, group, num_ranks)
    raise ValueError(f"parallel.drafter_sharding = {kind!r}: use one of {', '.join(SHARDINGS)}")
