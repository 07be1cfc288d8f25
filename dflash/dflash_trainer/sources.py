"""Where a drafter rank's features come from: the target on the same GPU, a target rank, or disk."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .data import MicroBatches
from .features import FeatureShards
from .parallel import synchronize as _sync
from .target import FrozenTarget


@dataclass
class FeatureBatch:
    features: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    tokens: int  # real (non-padding) context tokens
    index: int  # global micro-batch id
    wait_s: float  # time spent producing (local target) or waiting for (transfer, disk) the features


def local_source(stream: MicroBatches, target: FrozenTarget, indices, dtype, device) -> Iterator[FeatureBatch]:
    for i in indices:
        t0 = time.perf_counter()
        batch = stream.batch(i).to(device)
        feats = target.features(batch.input_ids, batch.attention_mask).to(dtype)
        _sync(device)
        yield FeatureBatch(feats, batch.input_ids, batch.loss_mask, int(batch.attention_mask.sum()), i,
                           time.perf_counter() - t0)


def remote_source(receiver, dtype) -> Iterator[FeatureBatch]:
    while True:
        t0 = time.perf_counter()
        got = receiver.next()
        if got is None:
            return
        _sync(got["features"].device)
        yield FeatureBatch(got["features"].to(dtype), got["input_ids"], got["loss_mask"],
                           int(got["attention_mask"].sum()), receiver.last_index, time.perf_counter() - t0)


def disk_source(shards: FeatureShards, indices, dtype, device) -> Iterator[FeatureBatch]:
    for i in indices:
        t0 = time.perf_counter()
        got = shards.load(i, device)
        _sync(device)
        yield FeatureBatch(got["features"].to(dtype), got["input_ids"], got["loss_mask"],
                           int(got["attention_mask"].sum()), i, time.perf_counter() - t0)
