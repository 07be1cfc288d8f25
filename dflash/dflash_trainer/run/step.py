"""The drafter's training step, written once. The train loop, the compile step's probe and the benchmark
all run it, so the compile step compiles exactly the step that trains.

- `forward_backward`: one micro-batch: random anchors -> blocks + attention -> drafter -> chunked
  weighted loss over the frozen LM head (CE, or the objective's mix against the target) -> backward. Returns un-normalised sums as device tensors.
- `optimizer_step`: the step's loss normalisation (grad scale), clipped AdamW on the fp32 masters,
  the LR schedule, gradients dropped.
- `run`: one optimizer step over `grad_accum` micro-batches: the above, with the loss normalised by the
  total weight of the whole step (every micro-batch, every drafter rank).

Like torchtitan's forward_backward_step / train_step: the loop around it (train.py) owns logging,
checkpoints and stopping; parallelism (how gradients are synchronised) comes in from distributed/sharding.py.
No host sync inside a step: the loop runs a step ahead of the GPU and reads each step's figures
(StepResult.read, StepClock) one step late, so the GPU never idles while the host waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..distributed.sources import FeatureBatch, Wait
from ..model.flops import drafter_step_flops
from ..model.loss import Objective
from ..model.objective import drafter_loss, prepare_micro_batch
from ..model.optim import MasterWeightAdamW


def anchor_generator(seed: int, device, index: int) -> torch.Generator:
    """Anchors of micro-batch i are a function of (train.seed, i): a resumed run draws the same ones, and the
    peers' FLOP count (bench/peers) the ones our trainer draws for the same micro-batch."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)


@dataclass
class MicroBatchSums:
    """One micro-batch's additive terms (device tensors)."""

    weighted_loss: torch.Tensor  # sum of w * loss (CE by default), detached
    weight: torch.Tensor  # sum of w
    slot_correct: torch.Tensor  # [B]
    slot_count: torch.Tensor  # [B]
    flops: torch.Tensor  # model FLOPs of this micro-batch (forward + backward)


@dataclass
class StepFigures:
    """One step's figures, on the host."""

    loss: float  # the step's normalised loss
    tokens: int  # context tokens, summed over the drafter ranks
    stop_votes: float  # drafter ranks that were asked to stop when this step started
    flops: float  # this rank's model FLOPs
    grad_norm: float
    slot_accuracy: list[float]  # slot k: the token k after the anchor (this rank's)
    wait_s: float  # producing or waiting for the features
    step_wait_s: float  # the part of wait_s inside the step's own wall time (sources.Wait.within_step)
    lr: float = 0.0  # the learning rate this step used (the scheduler has moved on by the time it is read)


class StepResult:
    """A launched step. Its figures are copied to pinned host memory behind the step's work, so read()
    waits for this step only, not for the next one the loop has queued since (a .item() on the
    current stream would wait for everything queued before it)."""

    def __init__(self, values: list[torch.Tensor], slot_correct: torch.Tensor, slot_count: torch.Tensor,
                 waits: list[Wait], lr: float = 0.0):
        packed = torch.cat([torch.stack([v.to(torch.float64) for v in values]), slot_correct.double(),
                            slot_count.double()])
        self._waits, self._ready, self._lr = waits, None, lr
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = packed

    def read(self) -> StepFigures:
        if self._ready is not None:
            self._ready.synchronize()
        loss_sum, weight_sum, tokens, votes, flops, grad_norm, *slots = self._host.tolist()
        block = len(slots) // 2
        correct, count = slots[:block], slots[block:]
        waits = [(w.seconds(), w.within_step) for w in self._waits]
        return StepFigures(loss_sum / max(weight_sum, 1e-6), int(tokens), votes, flops, grad_norm,
                           [c / max(n, 1.0) for c, n in zip(correct, count)], sum(t for t, _ in waits),
                           sum(t for t, within in waits if within), self._lr)


class StepClock:
    """Wall time per step without a host sync: an event after each step's work, read a step later.
    On a CPU the work runs synchronously, so the host clock is the step's time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._last = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self) -> tuple:
        end = self._mark()
        lap, self._last = (self._last, end), end
        return lap

    @staticmethod
    def seconds(lap: tuple) -> float:
        start, end = lap
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def phase(name: str):
    """A named range in a profiler trace (next to free when no profiler runs): `make bench --profile`
    charges idle GPU time to these phases."""
    return record_function(f"step/{name}")


class DrafterStep:
    """The drafter, the borrowed embedding and head, the optimizer and the step's fixed settings."""

    def __init__(self, drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 optimizer: MasterWeightAdamW, *, num_anchors: int, gamma: float | None, chunk_rows: int,
                 backend: str, compiled_layers: bool, vocab_size: int, model=None, gradient_sync=None,
                 scheduler=None, objective: Objective | None = None, selector_loss_weight: float = 1.0,
                 confidence_loss_weight: float = 1.0):
        self.drafter = drafter
        self.embed_weight, self.head_weight = embed_weight, head_weight
        self.optimizer, self.scheduler = optimizer, scheduler
        self.num_anchors, self.gamma, self.chunk_rows = num_anchors, gamma, chunk_rows
        self.backend, self.compiled_layers, self.vocab_size = backend, compiled_layers, vocab_size
        self.objective = objective  # the loss's terms; None: CE alone
        self.selector_loss_weight = selector_loss_weight  # DFlash 2: its selector's CE beside the unary CE
        self.confidence_loss_weight = confidence_loss_weight  # DSpark: its confidence head's BCE
        self.model = model or drafter  # what runs the forward: the drafter, or its DDP/FSDP wrapper
        # gradient_sync(enabled) -> context: skip the gradient reduction on all but a step's last micro-batch
        self.gradient_sync = gradient_sync or (lambda enabled: nullcontext())

    def forward_backward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor,
                         generator: torch.Generator | None = None, sync_gradients: bool = True,
                         bare: bool = False, target_hidden: torch.Tensor | None = None) -> MicroBatchSums:
        """bare: run the drafter itself, not its DDP wrapper (the compile step: a gradient all-reduce
        inside the compile lock would wait for ranks that are waiting for the lock). target_hidden: the
        target's final hidden states, for an objective against its distribution."""
        config = self.drafter.config
        with phase("blocks"):
            mb = prepare_micro_batch(input_ids, loss_mask, self.num_anchors, config, self.drafter.mask_token_id,
                                     self.gamma, self.backend, generator)
        with nullcontext() if bare else self.gradient_sync(sync_gradients):
            with phase("forward"):
                sums = drafter_loss(self.drafter, self.embed_weight, self.head_weight, features, mb.blocks,
                                    mb.attention, self.chunk_rows, self.drafter if bare else self.model,
                                    compiled_layers=self.compiled_layers, objective=self.objective,
                                    target_hidden=target_hidden, selector_loss_weight=self.selector_loss_weight,
                                    confidence_loss_weight=self.confidence_loss_weight)
            with phase("backward"):
                sums.weighted_loss.backward()
        batch, ctx_len = features.shape[:2]
        # A device tensor: a float() here would wait for the GPU in the middle of the step.
        flops = drafter_step_flops(config, batch, ctx_len, self.num_anchors, mb.visible_pairs, self.vocab_size)
        weight = sums.weight if sums.weight is not None else mb.blocks.total_weight  # D-PACE chooses its own
        return MicroBatchSums(sums.weighted_loss.detach(), weight, sums.slot_correct,
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
            all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, num_ranks: int = 1,
            stop_vote: bool = False) -> StepResult:
        """One optimizer step over grad_accum micro-batches from `batches`; nothing waits for the GPU.

        generator_for(micro-batch index) seeds its anchors (a resumed run draws the same ones);
        all_reduce sums over the drafter ranks. DDP averages gradients over the num_ranks ranks, so
        the grad scale is num_ranks / (the total weight of the step on every rank). stop_vote rides
        along in the same all-reduce: every rank reads the same count of ranks asked to stop.
        """
        device = self.embed_weight.device
        block = self.drafter.block_size
        loss_sum, weight_sum, tokens = (torch.zeros((), device=device) for _ in range(3))
        correct, count = torch.zeros(block, device=device), torch.zeros(block, device=device)
        flops = torch.zeros((), device=device, dtype=torch.float64)
        waits = []
        for micro in range(grad_accum):
            batch = next(batches)
            waits.append(batch.wait)
            sums = self.forward_backward(batch.input_ids, batch.loss_mask, batch.features,
                                         generator_for(batch.index) if generator_for else None,
                                         sync_gradients=micro == grad_accum - 1, target_hidden=batch.target_hidden)
            loss_sum += sums.weighted_loss
            weight_sum += sums.weight
            correct += sums.slot_correct
            count += sums.slot_count
            flops += sums.flops
            tokens += batch.tokens
        # torch.full, not torch.tensor: a copy from the host would wait for the GPU.
        votes = torch.full((), float(stop_vote), device=device)
        totals = all_reduce(torch.stack([loss_sum, weight_sum, tokens, votes]))
        lr = self.optimizer.opt.param_groups[0]["lr"]  # a host float: before the scheduler moves it on
        grad_norm = self.optimizer_step(num_ranks / totals[1].clamp(min=1e-6))
        return StepResult([*totals, flops, grad_norm.to(device)], correct, count, waits, lr)
