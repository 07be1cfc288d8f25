"""Where a drafter rank's features come from: the target on the same GPU, a target rank, or disk.

No source synchronises the GPU: the train loop runs ahead of it by a step, so the host must never
wait for the device in the middle of one. What a batch cost is measured on the device instead
(`Wait`, two CUDA events read a step later) where the wait happens there: the target's forward on
the same GPU, or the drafter stream stalled on a feature transfer. Reading from disk is host time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..data.features import TARGET_HIDDEN, FeatureShards
from ..data.rows import MicroBatches
from ..target.frozen import FrozenTarget


class Wait:
    """Seconds spent producing or waiting for one batch's features.

    Wait.interval(device) ... stop(): on a GPU, the device time between two CUDA events (seconds()
    synchronises only with the end event, which the loop reads a step later, when it has long passed);
    on a CPU, host time (the work runs synchronously). Wait.host(seconds, device): host time, e.g.
    reading from disk, which on a GPU overlaps the device's work on the previous step.
    `within_step`: the time is part of the step's own wall time (the drafter's share excludes it).
    """

    def __init__(self, host_s: float = 0.0, within_step: bool = True, events=None):
        self.host_s, self.within_step, self._events = host_s, within_step, events
        self._t0 = time.perf_counter()

    @classmethod
    def interval(cls, device: torch.device) -> Wait:
        events = None
        if device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        return cls(events=events)

    @classmethod
    def host(cls, seconds: float, device: torch.device) -> Wait:
        return cls(seconds, within_step=device.type != "cuda")

    def stop(self) -> Wait:
        if self._events is not None:
            self._events[1].record()
        else:
            self.host_s += time.perf_counter() - self._t0
        return self

    def seconds(self) -> float:
        if self._events is None:
            return self.host_s
        self._events[1].synchronize()
        return self.host_s + self._events[0].elapsed_time(self._events[1]) / 1e3


@dataclass
class FeatureBatch:
    features: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    tokens: int | torch.Tensor  # real (non-padding) context tokens; a device tensor avoids a host sync
    index: int  # global micro-batch id
    wait: Wait
    # [b, S, H] the target's final normed hidden states, where the loss compares with its distribution; else None
    target_hidden: torch.Tensor | None = None


def local_source(stream: MicroBatches, target: FrozenTarget, indices, dtype, device,
                 with_final: bool = False) -> Iterator[FeatureBatch]:
    """with_final: also the target's final hidden states (FrozenTarget.features_and_final)."""
    for i in indices:
        batch = stream.batch(i)
        tokens = int(batch.attention_mask.sum())  # on the host, before the copy: no device sync
        batch = batch.to(device)
        wait = Wait.interval(device)
        final = None
        if with_final:
            feats, final = target.features_and_final(batch.input_ids, batch.attention_mask)
        else:
            feats = target.features(batch.input_ids, batch.attention_mask)
        yield FeatureBatch(feats.to(dtype), batch.input_ids, batch.loss_mask, tokens, i, wait.stop(), final)


def remote_source(receiver, dtype) -> Iterator[FeatureBatch]:
    while True:
        # Recorded before the receive: the stream reaches it after the step queued so far, then waits for
        # the transfer inside next(), so the interval is the time the drafter GPU stalled on its supply.
        wait = Wait.interval(receiver.device)
        got = receiver.next()  # the current stream waits for the transfer; the host does not
        if got is None:
            return
        wait.stop()
        yield FeatureBatch(got["features"].to(dtype), got["input_ids"], got["loss_mask"],
                           got["attention_mask"].sum(), receiver.last_index, wait, got.get(TARGET_HIDDEN))


def disk_source(shards: FeatureShards, indices, dtype, device) -> Iterator[FeatureBatch]:
    for i in indices:
        t0 = time.perf_counter()
        got = shards.load(i, device)
        yield FeatureBatch(got["features"].to(dtype), got["input_ids"], got["loss_mask"],
                           got["attention_mask"].sum(), i, Wait.host(time.perf_counter() - t0, device),
                           got.get(TARGET_HIDDEN))
