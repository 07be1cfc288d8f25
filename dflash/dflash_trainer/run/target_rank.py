"""Target ranks: run the frozen target and send the features to drafter ranks; the offline dump."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..compile.guard import leave_run_phase
from ..config import ConfigError, RunConfig
from ..data.features import META, TARGET_HIDDEN, target_fingerprint, write_meta, write_shard
from ..distributed import parallel
from ..distributed.parallel import SplitWindow
from ..distributed.sources import Wait
from ..infra.metrics import Metrics
from ..target.frozen import FrozenTarget, text_config
from ..target.tensor_parallel import check_fits_before_loading, load_sharded_target
from .compile_step import compile_cache_dir, compile_target_step
from .evaluate import evaluate_saved, evaluation_scalars, record_eval_prompts
from .loading import (
    TargetFiles,
    attention_backend,
    compiled_buckets,
    console,
    drafter_config_for,
    load_data,
    load_target,
    load_tokenizer,
    loss_objective,
    target_config,
)
from .run_dir import RUN_CONFIG
from .summary import print_summary, write_summary


@dataclass
class _Supply:
    """What a target rank measured while it fed its drafters."""

    tokens: int = 0
    busy_s: float = 0.0  # the target's GPU time
    send_wait_s: float = 0.0  # waiting for drafters to take the features
    wall_s: float = 0.0


def run_target(cfg: RunConfig, ctx: parallel.Context, start_step: int, target_files: TargetFiles,
               drafter_config=None) -> dict | None:
    """Run the frozen target on this rank's micro-batches (from start_step on) and send the features to
    their drafters (drafter_config: the one the resume check read, if any)."""
    # A stop request ends a target rank at once: the drafters write the checkpoint, and a send that
    # waits for a drafter that has stopped would otherwise hold this process until the timeout.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    tokenizer = target_files.tokenizer
    if drafter_config is None:
        drafter_config = drafter_config_for(cfg, target_files.config, tokenizer)
    layer_ids = drafter_config.dflash_config["target_layer_ids"]
    stream, eval_stream, prompts = load_data(cfg, tokenizer)
    # The buckets some training row falls in, said once and sent to every rank: the drafter ranks, which do
    # not read the data, compile only those (before the target loads, so they do not wait for it).
    say = attention_backend(cfg, ctx.device) == "flex"  # the drafter ranks' compile step (same device kind)
    buckets = parallel.from_first_rank(ctx, compiled_buckets(cfg, stream, say) if ctx.rank == 0 else None)
    target = _load_group_target(cfg, ctx, layer_ids, target_files.config)
    compile_target_step(target, buckets, cfg.train.micro_batch,
                        compile_cache_dir(cfg.train.compile_cache_dir), console.print,
                        label=ctx.label, serialized=ctx.target_tp == 1, with_final=loss_objective(cfg).needs_target)
    supply = _feed_drafters(cfg, ctx, target, stream, start_step)
    ctx.barrier()  # the lead drafter has written the final drafter and the summary
    if ctx.roles.target_index(ctx.rank) != 0:  # the first target group measures tau: all its ranks run the target
        return None
    return _measure_tau(cfg, ctx, target, tokenizer, eval_stream, prompts, supply)


def _feed_drafters(cfg: RunConfig, ctx: parallel.Context, target: FrozenTarget, stream, start_step: int) -> _Supply:
    """The target's features of this rank's micro-batches; every rank of a target group computes each of the
    group's micro-batches, and its first rank sends them."""
    from ..distributed.transport import FeatureSender

    device = ctx.device
    batches_per_step = cfg.train.grad_accum * ctx.num_drafters
    num_batches = cfg.train.steps * batches_per_step
    first_batch = start_step * batches_per_step
    sender = FeatureSender(ctx.roles, ctx.rank, ctx.groups, cfg.parallel.prefetch, start=first_batch) \
        if ctx.sends_features else None
    intervals: list[Wait] = []  # the target's GPU time per micro-batch, read without a sync per batch
    supply = _Supply()
    t_start = time.perf_counter()
    window = SplitWindow(cfg.parallel.prefetch)
    with_final = loss_objective(cfg).needs_target
    for i in ctx.roles.batches_for_target(ctx.roles.target_index(ctx.rank), num_batches, first_batch):
        batch = stream.batch(i)
        supply.tokens += int(batch.attention_mask.sum())  # on the host: no device sync
        batch = batch.to(device)
        busy = Wait.interval(device)
        message = _target_outputs(target, batch, with_final)
        intervals.append(busy.stop())
        if sender is None:
            continue
        t1 = time.perf_counter()
        sender.send(message)
        supply.send_wait_s += time.perf_counter() - t1
        if ctx.rank == 0 and window.due(len(intervals)):
            parallel.synchronize(device)
            console.print(ctx.label + window.advice(intervals, ctx.roles.num_targets, ctx.roles.num_drafters,
                                                    target_tp=ctx.target_tp))
    if sender is not None:
        sender.close(num_batches)
    supply.wall_s = time.perf_counter() - t_start
    supply.busy_s = sum(w.seconds() for w in intervals)
    if sender is not None:  # one line per target group
        wall, send_wait = supply.wall_s, supply.send_wait_s
        console.print(f"{ctx.label}target done: {supply.tokens / max(wall, 1e-9):,.0f} tok/s; target compute "
                      f"{supply.busy_s:.1f}s, waiting on drafters {send_wait:.1f}s of {wall:.1f}s"
                      + (" (drafters bound the run)" if send_wait > 0.2 * wall else " (target supply bounds the run)"))
    return supply


def _measure_tau(cfg: RunConfig, ctx: parallel.Context, target: FrozenTarget, tokenizer, eval_stream, prompts,
                 supply: _Supply) -> dict | None:
    """tau before and after training, measured by the first target group on the published drafter; its first
    rank adds them and the supply figures to summary.json."""
    out = Path(cfg.output_dir)
    leave_run_phase()  # evaluation shapes differ from the training batches'
    console.quiet = ctx.rank != 0  # the group's other ranks run the same evaluation: one report
    try:
        before, after = evaluate_saved(cfg, target, tokenizer, eval_stream, prompts, out / "drafter", ctx.device)
    finally:
        console.quiet = False
    if ctx.rank != 0:
        return None
    summary = json.loads((out / "summary.json").read_text())
    summary.update(tau_before=before["tau"], tau_after=after["tau"], slot_accuracy_after=after["slot_accuracy"],
                   slot_acceptance_after=after["slot_acceptance"], tau_before_method=before.get("tau_method", "speculative decoding"),
                   target_ranks=ctx.roles.num_targets, target_tp=ctx.target_tp, target_busy_s=supply.busy_s,
                   target_wait_s=supply.send_wait_s, target_attention=target.attention,
                   eval_prompts=str(record_eval_prompts(out, prompts)))  # what `dflash-eval --run` reads
    write_summary(out, summary)
    metrics = Metrics.of_run(out, console.print)  # the trackers the lead drafter rank logged the run to
    metrics.scalars(evaluation_scalars(summary), cfg.train.steps)
    metrics.close()
    print_summary(summary)
    return summary


def _load_group_target(cfg: RunConfig, ctx: parallel.Context, layer_ids: list[int], config) -> FrozenTarget:
    """The whole target, or with parallel.target_tp > 1 this rank's share of its group's; either after a check
    that the share fits this GPU's free memory."""
    check_fits_before_loading(cfg, config, ctx.device)
    if ctx.target_tp == 1:
        return load_target(cfg, layer_ids, ctx.device, config)
    return load_sharded_target(cfg, layer_ids, ctx.device, ctx.groups.target_group, config)


def _target_outputs(target: FrozenTarget, batch, with_final: bool) -> dict[str, torch.Tensor]:
    """One micro-batch as it is sent or dumped: the features, the batch, and with_final the target's final
    hidden states (a loss against its distribution)."""
    final = None
    if with_final:
        feats, final = target.features_and_final(batch.input_ids, batch.attention_mask)
    else:
        feats = target.features(batch.input_ids, batch.attention_mask)
    out = {"features": feats, "input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
           "attention_mask": batch.attention_mask}
    return out if final is None else {**out, TARGET_HIDDEN: final}


def dump_features(cfg: RunConfig, root: Path, num_batches: int | None) -> None:
    """Run the target over the training stream once; rank r of W writes micro-batches i = r mod W."""
    if cfg.parallel.target_tp > 1:
        raise ConfigError(f"--dump-features runs one whole target per process, and parallel.target_tp is "
                          f"{cfg.parallel.target_tp}: set parallel.target_tp = 1 (--set parallel.target_tp=1) to dump")
    if (root / META).exists() or (root / RUN_CONFIG).exists():
        held = "dumped features (meta.json)" if (root / META).exists() else "a training run (config.json)"
        raise ConfigError(f"--dump-features {root} already holds {held}: give a new directory (or remove this one "
                          "to dump again); features written over others would mix two dumps")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:  # one GPU per process, chosen before the driver reads CUDA_VISIBLE_DEVICES
        from ..compile.guard import isolate_local_gpu

        isolate_local_gpu(int(os.environ.get("LOCAL_RANK", "0")))
        # Every rank checks the directory (above) before any writes, and meta.json, which says the dump is whole,
        # comes after every rank's shards: a rank that started late saw rank 0's meta.json and refused the dump.
        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group("gloo")
        dist.barrier()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(cfg)
    layer_ids = drafter_config_for(cfg, target_config(cfg), tokenizer).dflash_config["target_layer_ids"]
    target = load_target(cfg, layer_ids, device)
    stream, _, _ = load_data(cfg, tokenizer)
    count = num_batches or stream.per_epoch
    with_final = loss_objective(cfg).needs_target  # the target's final hidden states only for a loss that reads them
    for i in tqdm(range(rank, count, world), desc="dumping features", disable=None if rank == 0 else True):
        write_shard(root, i, _target_outputs(target, stream.batch(i).to(device), with_final))
    if world > 1:
        dist.barrier()
        if owned:
            dist.destroy_process_group()
    if rank == 0:
        write_meta(root, cfg.target.path, layer_ids, count, cfg.train.micro_batch, cfg.target.quantization,
                   target_fingerprint(text_config(target_config(cfg))), target_hidden=with_final)
    console.print(f"rank {rank}: features of {len(range(rank, count, world))} micro-batches in {root}")
