"""Process layout: one process per GPU under torchrun; target ranks feed drafter ranks.

Ranks 0..T-1 run the frozen target and send features; ranks T..T+D-1 train the drafter with DDP.
With parallel.target_tp = N the target ranks form T / N groups of N, each holding one target sharded
with tensor parallelism (target/tensor_parallel.py); the first rank of a group sends the group's features.
With T = 0 the drafters read features dumped to disk (offline mode). A plain single process
(no torchrun) runs target and drafter together ("colocated"), which is how the embedded default
runs on a laptop or one GPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..compile.guard import isolate_local_gpu
from ..config import ConfigError
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
    def target_tp(self) -> int:
        return 1 if self.roles is None else self.roles.target_tp

    @property
    def sends_features(self) -> bool:
        """A target rank that sends its group's features (every target rank when target_tp = 1)."""
        return self.roles is not None and self.roles.sends_features(self.rank)

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


def init(target_ranks: int, drafter_ranks: int, offline: bool, isolate_gpus: bool = True,
         target_tp: int = 1) -> Context:
    """Read torchrun's environment, check the role split (ConfigError when it does not fit the world or
    the mode), start the process group (and the target groups of target_tp ranks)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1 and target_ranks == 0 and drafter_ranks == 1 and not offline:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Context(1, 0, 0, device, None, None)
    if offline and target_ranks:
        raise ConfigError("data.features_dir is set (offline mode), so there are no target ranks: set "
                         "parallel.target_ranks = 0 (--target-gpus 0)")
    roles = Roles.from_world(world, target_ranks, drafter_ranks, target_tp)
    if roles.offline and not offline:
        raise ConfigError("0 target ranks means offline mode: set data.features_dir to features dumped with "
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
    backend = "nccl" if use_cuda else "gloo"
    if "MASTER_ADDR" in os.environ:  # launched by torchrun (or its environment given by hand)
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
    else:  # one process started by hand, e.g. one drafter rank training on dumped features: a world of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(minutes=30))
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


def from_first_rank(ctx: Context, value):
    """Rank 0's value (any picklable object) on every rank; collective over the gloo header group (no
    device involved): every rank calls it at the same point."""
    if ctx.groups is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.groups.header)
    return box[0]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing, hand-offs); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the T:D split: how many target ranks feed how many drafter ranks ------------------------------

def suggest_split(target_s: float, drafter_s: float, gpus: int, target_tp: int = 1) -> tuple[int, int]:
    """The split of `gpus` into T target and D drafter GPUs that moves the most micro-batches per second:
    max over the group count G (T = G x target_tp) of min(G / target_s, D / drafter_s), where target_s is one
    micro-batch's time on one target group and drafter_s on one drafter rank. Ties go to fewer target GPUs."""
    if gpus < target_tp + 1:
        raise ValueError(f"a split needs at least {target_tp + 1} GPUs (one target group of {target_tp}, one "
                         f"drafter rank), got {gpus}")
    splits = [(g * target_tp, gpus - g * target_tp) for g in range(1, (gpus - 1) // target_tp + 1)]
    return max(splits, key=lambda td: (min(td[0] / target_tp / target_s, td[1] / drafter_s), -td[0]))


def _target_unit(target_tp: int) -> str:
    return "a target rank" if target_tp == 1 else f"a target group of {target_tp} GPUs"


def split_advice(target_s: float, drafter_s: float, targets: int, drafters: int, target_tp: int = 1) -> str:
    """One line: who waits for whom at this split (targets: target GPUs, in groups of target_tp), and the
    split suggest_split gives for this GPU count."""
    supply, demand = targets / target_tp / target_s, drafters / drafter_s  # micro-batches per second
    ratio = supply / demand
    if ratio >= 1:
        state = f"targets idle {1 - 1 / ratio:.0%}"
    else:
        state = f"drafters wait {1 - ratio:.0%} of the time for features"
    gpus = targets + drafters
    best = suggest_split(target_s, drafter_s, gpus, target_tp)
    head = (f"{state} (supply/demand {ratio:.2f}: {target_s * 1e3:.0f} ms per micro-batch on "
            f"{_target_unit(target_tp)}, {drafter_s * 1e3:.0f} ms on a drafter rank)")
    if best == (targets, drafters):
        return f"{head}; {targets}:{drafters} is the best split for {gpus} GPUs"
    now = min(supply, demand)
    then = min(best[0] / target_tp / target_s, best[1] / drafter_s)
    groups = f" ({best[0] // target_tp} groups of {target_tp})" if target_tp > 1 else ""
    return (f"{head}: for {gpus} GPUs try --target-gpus {best[0]} --drafter-gpus {best[1]}{groups} "
            f"({then / now - 1:+.0%} micro-batches/s)")


class SplitWindow:
    """When to measure the split: over a window of micro-batches after the pipeline has filled (the
    first `prefetch` + 2 are start-up), once."""

    def __init__(self, prefetch: int, length: int = 16):
        self.start, self.end = prefetch + 2, prefetch + 2 + length
        self.t0: float | None = None
        self.done = False

    def due(self, count: int) -> bool:
        if count == self.start:
            self.t0 = time.perf_counter()
        return not self.done and count == self.end

    def advice(self, intervals, targets: int, drafters: int, now: float | None = None, target_tp: int = 1) -> str:
        """The target side's view: its own time per micro-batch, and the drafters' from how fast they
        took the batches (a target group that waits sends at the drafters' pace: wall = drafter_s * G / D)."""
        self.done = True
        n = self.end - self.start
        wall = ((time.perf_counter() if now is None else now) - self.t0) / n
        target_s = sum(w.seconds() for w in intervals[self.start:self.end]) / n
        if target_s >= 0.9 * wall:  # busy: the targets bound the run; the drafter side measures its own need
            return (f"targets busy {target_s / wall:.0%} of the time ({target_s * 1e3:.0f} ms per micro-batch): "
                    "the target ranks bound the run (the lead drafter rank reports how long it waits)")
        return split_advice(target_s, wall * drafters / (targets // target_tp), targets, drafters, target_tp)


def drafter_side_advice(seconds: list[float], stalls: list[float], grad_accum: int, targets: int,
                        drafters: int, target_tp: int = 1) -> str:
    """The lead drafter's view over a window of steps: its own time per micro-batch, and the target groups'
    from how fast the features came when it had to wait (a drafter that waits takes batches at the
    targets' pace: wall = target_s * D / G)."""
    n = len(seconds) * grad_accum
    wall, stall = sum(seconds) / n, sum(stalls) / n
    drafter_s = wall - stall
    if stall <= 0.1 * wall:
        return (f"drafters wait {stall / wall:.0%} of the time for features ({drafter_s * 1e3:.0f} ms per "
                "micro-batch): the drafter ranks bound the run (the first target rank reports its idle time)")
    return split_advice(wall * (targets // target_tp) / drafters, drafter_s, targets, drafters, target_tp)
