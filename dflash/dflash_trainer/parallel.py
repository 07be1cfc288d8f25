"""Process layout: one process per GPU under torchrun; target ranks feed drafter ranks.

Ranks 0..T-1 run the frozen target and send features; ranks T..T+D-1 train the drafter with DDP.
With T = 0 the drafters read features dumped to disk (offline mode). A plain single process
(no torchrun) runs target and drafter together ("colocated"), which is how the embedded default
runs on a laptop or one GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .compile_guard import isolate_local_gpu
from .transport import Roles, TransportGroups, setup_transport


@dataclass
class Context:
    world: int
    rank: int
    local_rank: int
    device: torch.device
    roles: Roles | None  # None: colocated (one process does everything)
    groups: TransportGroups | None

    @property
    def colocated(self) -> bool:
        return self.roles is None

    @property
    def is_target(self) -> bool:
        return self.roles is not None and self.roles.is_target(self.rank)

    @property
    def drafter_index(self) -> int:
        return 0 if self.roles is None else self.roles.drafter_index(self.rank)

    @property
    def num_drafters(self) -> int:
        return 1 if self.roles is None else self.roles.num_drafters

    @property
    def leads_drafters(self) -> bool:
        """The one drafter rank that logs, checkpoints and writes the summary."""
        return not self.is_target and self.drafter_index == 0

    @property
    def label(self) -> str:
        if self.roles is None:
            return ""
        return f"[rank {self.rank} {self.roles.role(self.rank)}] "

    def barrier(self) -> None:
        if self.groups is not None:
            dist.barrier(group=self.groups.header)  # gloo: no device synchronisation needed


def init(target_ranks: int, drafter_ranks: int, offline: bool, isolate_gpus: bool = True) -> Context:
    """Read torchrun's environment, check the role split, start the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1 and target_ranks == 0 and drafter_ranks == 1 and not offline:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Context(1, 0, 0, device, None, None)
    if offline and target_ranks:
        raise ValueError("data.features_dir is set (offline mode), so there are no target ranks: set "
                         "parallel.target_ranks = 0 (--target-gpus 0)")
    roles = Roles.from_world(world, target_ranks, drafter_ranks)
    if roles.offline and not offline:
        raise ValueError("0 target ranks means offline mode: set data.features_dir to features dumped with "
                         "--dump-features, or give target ranks (--target-gpus T)")
    if isolate_gpus:
        # Every worker sees its GPU as cuda:0, so compile-cache keys match and rank 1+ hit rank 0's cache.
        # Before ANY torch.cuda call: the driver reads CUDA_VISIBLE_DEVICES once, at its first use
        # (even torch.cuda.is_available()), after which every process would share GPU 0.
        isolate_local_gpu(local_rank)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", 0 if isolate_gpus else local_rank)
    else:
        device = torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))
    groups = setup_transport(roles)
    return Context(world, rank, local_rank, device, roles, groups)


def shutdown(ctx: Context) -> None:
    if ctx.groups is not None and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(ctx: Context, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the drafter ranks (the loss weight total, token counts); a no-op when colocated."""
    if ctx.groups is not None and ctx.groups.drafters is not None and ctx.num_drafters > 1:
        dist.all_reduce(tensor, group=ctx.groups.drafters)
    return tensor


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing, hand-offs); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
