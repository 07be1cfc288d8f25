"""The drafter's training step, written once. The train loop, the compile step's probe and the benchmark
all run it, so the compile step compiles exactly the step that trains.

- `forward_backward`: one micro-batch: random anchors -> blocks + attention -> drafter -> chunked
  weighted CE over the frozen LM head -> backward. Returns un-normalised sums as device tensors.
- `optimizer_step`: the step's loss normalisation (grad scale), clipped AdamW on the fp32 masters,
  the LR schedule, gradients dropped.
- `run`: one optimizer step over `grad_accum` micro-batches: the above, with the loss normalised by the
  total weight of the whole step (every micro-batch, every drafter rank).

Like torchtitan's forward_backward_step / train_step: the loop around it (train.py) owns logging,
checkpoints and stopping; parallelism (how gradients are synchronised) comes in from sharding.py.
No host sync inside a step: everything returned stays on the device until the caller reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from .flops import drafter_step_flops
from .objective import drafter_loss, prepare_micro_batch
from .optim import MasterWeightAdamW
from .sources import FeatureBatch


@dataclass
class MicroBatchSums:
    """One micro-batch's additive terms (device tensors)."""

    weighted_ce: torch.Tensor  # sum of w * CE, detached
    weight: torch.Tensor  # sum of w
    slot_correct: torch.Tensor  # [B]
    slot_count: torch.Tensor  # [B]
    flops: torch.Tensor  # model FLOPs of this micro-batch (forward + backward)


@dataclass
class StepResult:
    """One optimizer step. ce_sum, weight_sum and tokens are summed over the drafter ranks; slot
    counts and FLOPs are this rank's. Device tensors, except the host-side wait and token counts."""

    ce_sum: torch.Tensor
    weight_sum: torch.Tensor
    tokens: torch.Tensor
    slot_correct: torch.Tensor
    slot_count: torch.Tensor
    flops: torch.Tensor
    grad_norm: torch.Tensor
    wait_s: float  # time spent producing or waiting for this step's features

    @property
    def loss(self) -> float:
        """The step's normalised loss (a host sync)."""
        return float(self.ce_sum / self.weight_sum.clamp(min=1e-6))

    def slot_accuracy(self) -> list[float]:
        return (self.slot_correct / self.slot_count.clamp(min=1)).tolist()


def phase(name: str):
    """A named range in a profiler trace (next to free when no profiler runs): `make bench --profile`
    charges idle GPU time to these phases."""
    return record_function(f"step/{name}")


class DrafterStep:
    """The drafter, the borrowed embedding and head, the optimizer and the step's fixed settings."""

    def __init__(self, drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 optimizer: MasterWeightAdamW, *, num_anchors: int, gamma: float | None, chunk_rows: int,
                 backend: str, compiled_layers: bool, vocab_size: int, model=None, gradient_sync=None,
                 scheduler=None):
        self.drafter = drafter
        self.embed_weight, self.head_weight = embed_weight, head_weight
        self.optimizer, self.scheduler = optimizer, scheduler
        self.num_anchors, self.gamma, self.chunk_rows = num_anchors, gamma, chunk_rows
        self.backend, self.compiled_layers, self.vocab_size = backend, compiled_layers, vocab_size
        self.model = model or drafter  # what runs the forward: the drafter, or its DDP/FSDP wrapper
        # gradient_sync(enabled) -> context: skip the gradient reduction on all but a step's last micro-batch
        self.gradient_sync = gradient_sync or (lambda enabled: nullcontext())

    def forward_backward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor,
                         generator: torch.Generator | None = None, sync_gradients: bool = True,
                         bare: bool = False) -> MicroBatchSums:
        """bare: run the drafter itself, not its DDP wrapper (the compile step: a gradient all-reduce
        inside the compile lock would wait for ranks that are waiting for the lock)."""
        config = self.drafter.config
        with phase("blocks"):
            mb = prepare_micro_batch(input_ids, loss_mask, self.num_anchors, config, self.drafter.mask_token_id,
                                     self.gamma, self.backend, generator)
        with nullcontext() if bare else self.gradient_sync(sync_gradients):
            with phase("forward"):
                sums = drafter_loss(self.drafter, self.embed_weight, self.head_weight, features, mb.blocks,
                                    mb.attention, self.chunk_rows, self.drafter if bare else self.model,
                                    compiled_layers=self.compiled_layers)
            with phase("backward"):
                sums.weighted_ce.backward()
        batch, ctx_len = features.shape[:2]
        # A device tensor: a float() here would wait for the GPU in the middle of the step.
        flops = drafter_step_flops(config, batch, ctx_len, self.num_anchors, mb.visible_pairs, self.vocab_size)
        return MicroBatchSums(sums.weighted_ce.detach(), mb.blocks.total_weight, sums.slot_correct,
                              sums.slot_count, flops)

    def optimizer_step(self, grad_scale: float | torch.Tensor) -> torch.Tensor:
        """Gradients arrive as sums: grad_scale normalises them (num_ranks / total weight under DDP)."""
        with phase("optimizer"):
            grad_norm = self.optimizer.step(grad_scale)
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad()
        return grad_norm

    def run(self, batches: Iterator[FeatureBatch], grad_accum: int,
            generator_for: Callable[[int], torch.Generator] | None = None,
            all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, num_ranks: int = 1) -> StepResult:
        """One optimizer step over grad_accum micro-batches from `batches`.

        generator_for(micro-batch index) seeds its anchors (a resumed run draws the same ones);
        all_reduce sums over the drafter ranks. DDP averages gradients over the num_ranks ranks, so
        the grad scale is num_ranks / (the total weight of the step on every rank).
        """
        device = self.embed_weight.device
        block = self.drafter.block_size
        ce_sum, weight_sum = torch.zeros((), device=device), torch.zeros((), device=device)
        correct, count = torch.zeros(block, device=device), torch.zeros(block, device=device)
        flops = torch.zeros((), device=device, dtype=torch.float64)
        tokens, wait_s = 0, 0.0
        for micro in range(grad_accum):
            batch = next(batches)
            wait_s += batch.wait_s
            sums = self.forward_backward(batch.input_ids, batch.loss_mask, batch.features,
                                         generator_for(batch.index) if generator_for else None,
                                         sync_gradients=micro == grad_accum - 1)
            ce_sum += sums.weighted_ce
            weight_sum += sums.weight
            correct += sums.slot_correct
            count += sums.slot_count
            flops += sums.flops
            tokens += batch.tokens
        totals = all_reduce(torch.stack([ce_sum, weight_sum, torch.tensor(float(tokens), device=device)]))
        grad_norm = self.optimizer_step(num_ranks / totals[1].clamp(min=1e-6))
        return StepResult(totals[0], totals[1], totals[2], correct, count, flops, grad_norm, wait_s)
