"""Train a DFlash drafter.

    python -m dflash_trainer.train --config embedded                  # one process: target + drafter
    torchrun --nproc-per-node 8 -m dflash_trainer.train --config qwen3-8b --target-gpus 3 --drafter-gpus 5
    python -m dflash_trainer.train --config qwen3-8b --dump-features feats/   # offline: dump once ...
    torchrun --nproc-per-node 2 -m dflash_trainer.train --config qwen3-8b --set data.features_dir=feats/ \\
        --target-gpus 0 --drafter-gpus 2                                   # ... train many epochs on it

A drafter rank reads top to bottom: setup (drafter, sharding, optimizer, feature source, the one
drafter step of run/step.py) -> resume -> the compile step -> the loop (step, log, checkpoint, stop) ->
finish (the published drafter, tau, the summary).
"""

from __future__ import annotations

# python -m / torchrun -m: started as dflash-train is, the signals handled before the imports below
# (infra/entry.py), which imports this module by its own name and runs its main.
if __name__ == "__main__":
    from .infra.entry import train as _entry

    _entry()

import argparse
import json
import math
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .infra.gc_pause import gc_paused

with gc_paused():  # torch's and transformers' imports, a fifth faster: infra/gc_pause.py
    import torch
    from rich.markup import escape
    from tqdm import tqdm

    from . import cli_args
    from .compile.guard import CompileReport, leave_run_phase, prefetch_triton_key, start_compile_workers
    from .config import RunConfig, check_init_from, semantic_problems
    from .data.features import FeatureShards
    from .data.rows import MicroBatches
    from .distributed import parallel
    from .distributed.parallel import drafter_side_advice
    from .distributed.sharding import Replicated, Sharded, shard_drafter
    from .distributed.sources import FeatureBatch, disk_source, local_source, remote_source
    from .embedded import resolve_target
    from .infra import storage
    from .infra.bytecode import uncompiled_note
    from .infra.console import plain_output_off_a_terminal
    from .infra.entry import stdout_closed
    from .infra.hub import HubError
    from .infra.metrics import Metrics, duration, eta, plain_progress, say_progress, slot_summary
    from .infra.stop_signal import exit_code as stop_exit_code
    from .infra.stop_signal import received as received_signal
    from .infra.stop_signal import signal_name_of
    from .model.drafter import DFlashDrafter
    from .model.flops import peak_flops
    from .model.optim import MasterWeightAdamW
    from .run import checkpoint as ckpt
    from .run import model_card, run_dir
    from .run.compile_step import check_dense_fits, compile_cache_dir, compile_drafter_step
    from .run.evaluate import (
        evaluate,
        evaluate_before,
        evaluate_saved,
        evaluation_scalars,
        record_eval_prompts,
    )
    from .run.loading import (
        DTYPES,
        TargetFiles,
        attention_backend,
        check_inputs,
        compiled_buckets,
        console,
        drafter_config_for,
        drafter_step,
        feature_buckets,
        input_problems,
        load_data,
        load_target,
        loss_objective,
        new_drafter,
        new_optimizer,
        read_target_files,
        repeated_taps_note,
        training_rows,
        unfinished_regenerations,
    )
    from .run.serve_check import check_published
    from .run.step import DrafterStep, StepClock, StepFigures, anchor_generator
    from .run.stop import StopRequest
    from .run.summary import Startup, print_summary, steady_mfu, steady_step_ms, write_summary
    from .run.target_rank import dump_features, run_target
    from .target.frozen import BorrowedWeights, FrozenTarget, load_embed_and_head

if TYPE_CHECKING:
    from transformers import Qwen3Config

# ---- a drafter rank: setup, resume, compile, loop, finish -----------------------------------------

@dataclass
class DrafterRun:
    """What a drafter rank holds for the whole run."""

    cfg: RunConfig
    ctx: parallel.Context
    drafter: DFlashDrafter
    shard: Replicated | Sharded  # how the drafter ranks hold it (DDP or FSDP)
    optimizer: MasterWeightAdamW
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: DrafterStep
    source: Iterator[FeatureBatch]
    wait_kind: str  # where features come from: "target" (this process), "transfer" or "disk"
    start_step: int
    latest: Path | None  # the checkpoint to resume from
    target: FrozenTarget | None = None  # colocated runs only: the target, and what evaluation needs
    tokenizer: object = None
    eval_stream: MicroBatches | None = None
    prompts: list[list[int]] = field(default_factory=list)
    borrowed: BorrowedWeights | None = None  # the embedding and head being read (target-less drafter ranks)
    checkpoint_losses: list[float] = field(default_factory=list)  # the resumed checkpoint's run so far
    buckets: list[int] | None = None  # the context buckets the compile step compiles (None: data.context_buckets)

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def lead(self) -> bool:
        return self.ctx.leads_drafters

    def log(self, *args, **kwargs) -> None:
        if self.lead:
            console.print(*args, **kwargs)


@dataclass
class History:
    """What the loop measured, for the summary."""

    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    flops: float = 0.0
    train_s: float = 0.0
    wait_s: float = 0.0
    drafter_s: float = 0.0
    stopped_at: int | None = None
    step_s: list[float] = field(default_factory=list)  # each step's seconds and model FLOPs: the steady figures
    step_flops: list[float] = field(default_factory=list)

    def record(self, step: int, figures: StepFigures, seconds: float) -> None:
        if not math.isfinite(figures.loss):
            raise FloatingPointError(f"loss is {figures.loss} at step {step}; lower train.lr or check the data")
        self.losses.append(figures.loss)
        self.tokens += figures.tokens
        self.flops += figures.flops
        self.train_s += seconds
        self.wait_s += figures.wait_s
        self.drafter_s += seconds - figures.step_wait_s
        self.step_s.append(seconds)
        self.step_flops.append(figures.flops)


@dataclass
class FeatureSide:
    """Where a drafter rank's features come from, and the target's embedding and head it reads."""

    source: Iterator[FeatureBatch]
    wait_kind: str  # "target" (this process), "transfer" or "disk"
    samples: int | None  # training samples, where known before the run
    embed: torch.Tensor
    head: torch.Tensor
    target: FrozenTarget | None = None  # colocated runs only: the target, and what evaluation needs
    eval_stream: MicroBatches | None = None
    prompts: list[list[int]] = field(default_factory=list)
    borrowed: BorrowedWeights | None = None  # target-less drafter ranks: the embedding and head being read
    buckets: list[int] | None = None  # the buckets the micro-batches take, where known (None: every one)


def colocated_features(cfg: RunConfig, ctx: parallel.Context, drafter: DFlashDrafter, target_files: TargetFiles,
                       startup: Startup, my_batches: range) -> FeatureSide:
    """The target in this process computes the features; its embedding and head are the drafter's."""
    dtype = DTYPES[cfg.train.dtype]
    target = load_target(cfg, drafter.target_layer_ids, ctx.device, target_files.config)
    startup.mark("target")
    # The drafter's dtype (a no-op unless the target's differs, e.g. an fp32 target and a bf16 drafter).
    embed, head = (w.to(dtype) for w in (target.embed_weight, target.head_weight))
    stream, eval_stream, prompts = load_data(cfg, target_files.tokenizer)
    buckets = compiled_buckets(cfg, stream, say=ctx.leads_drafters and attention_backend(cfg, ctx.device) == "flex")
    startup.mark("data")
    source = local_source(stream, target, my_batches, dtype, ctx.device, with_final=loss_objective(cfg).needs_target)
    return FeatureSide(source, "target", len(stream.dataset),
                       embed, head, target, eval_stream, prompts, buckets=buckets)


def borrowed_features(cfg: RunConfig, ctx: parallel.Context, drafter: DFlashDrafter, target_files: TargetFiles,
                      startup: Startup, my_batches: range, first_batch: int) -> FeatureSide:
    """Features from disk (offline) or from target ranks; the embedding and head read from the target's files."""
    device, dtype = ctx.device, DTYPES[cfg.train.dtype]
    # In the drafter's dtype: only the drafter uses them here (target.dtype is the target ranks' forward).
    borrowed = load_embed_and_head(cfg.target.path, device, dtype,
                                   target_files.config, cfg.target.trust_remote_code)  # in the background
    startup.mark("embedding + head")
    if ctx.roles.offline:
        shards = FeatureShards(cfg.data.features_dir)
        buckets = feature_buckets(cfg, shards, target_files.config, drafter.target_layer_ids,
                                  lead=ctx.leads_drafters, compiles=attention_backend(cfg, device) == "flex")
        return FeatureSide(disk_source(shards, my_batches, dtype, device), "disk", shards.count,
                           borrowed.embed, borrowed.head, borrowed=borrowed, buckets=buckets)
    from .distributed.transport import FeatureReceiver

    # The buckets the training rows fall in, from the first target rank (it reads the data); before the
    # receiver posts its first header.
    buckets = parallel.from_first_rank(ctx, None)
    receiver = FeatureReceiver(ctx.roles, ctx.rank, ctx.groups, device, cfg.parallel.prefetch, start=first_batch)
    return FeatureSide(remote_source(receiver, dtype), "transfer", None, borrowed.embed, borrowed.head,
                       borrowed=borrowed, buckets=buckets)


def setup_drafter(cfg: RunConfig, ctx: parallel.Context, start: run_dir.RunStart, target_files: TargetFiles,
                  startup: Startup, drafter_config=None) -> DrafterRun:
    """Drafter, sharding, optimizer, schedule, the feature source and the one drafter step
    (drafter_config: the one the resume check read, built from as it is)."""
    device, train = ctx.device, cfg.train
    start_step, latest = start.resume_point
    drafter = new_drafter(cfg, target_files.config, target_files.tokenizer, device=device,
                          initialise=latest is None, config=drafter_config)  # a resumed run loads its weights next
    startup.mark("drafter")
    num_drafters = ctx.num_drafters
    shard = shard_drafter(cfg.parallel.drafter_sharding, drafter, device, DTYPES[train.dtype],
                          ctx.groups.drafters if ctx.groups is not None else None, num_drafters)
    first_batch = start_step * train.grad_accum * num_drafters
    # Micro-batch i goes to drafter rank i % D.
    my_batches = range(ctx.drafter_index + first_batch, train.steps * train.grad_accum * num_drafters, num_drafters)
    if ctx.colocated:
        side = colocated_features(cfg, ctx, drafter, target_files, startup, my_batches)
    else:
        side = borrowed_features(cfg, ctx, drafter, target_files, startup, my_batches, first_batch)

    optimizer, scheduler = new_optimizer(cfg, drafter)
    startup.mark("optimizer")
    backend = attention_backend(cfg, device)
    step = drafter_step(cfg, drafter, side.embed, side.head, optimizer, scheduler, backend, model=shard.module,
                        gradient_sync=shard.gradient_sync, shard_compiles=shard.compiled_layers)
    run = DrafterRun(cfg, ctx, drafter, shard, optimizer, scheduler, step, side.source, side.wait_kind, start_step,
                     latest, side.target, target_files.tokenizer, side.eval_stream, side.prompts, side.borrowed,
                     buckets=side.buckets)
    config = drafter.config
    run.log(f"drafter: {drafter.kind}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, block {config.block_size}, "
            f"target layers {drafter.target_layer_ids}, {drafter.num_params() / 1e6:.2f}M params; "
            + (f"{side.samples} training samples; " if side.samples else "")
            + f"{num_drafters} drafter rank(s) ({shard.name}); attention {backend} on {device}")
    return run


def restore(run: DrafterRun) -> None:
    """Weights, optimizer, schedule and RNG from the checkpoint (the data position is start_step)."""
    try:
        state = ckpt.load_train_state(run.latest)
        run.shard.load(run.latest, state["optimizer"], run.optimizer)
    except Exception as exc:
        if (error := ckpt.damaged(run.latest, exc)) is None:
            raise
        raise error from exc
    run.scheduler.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"])
    run.checkpoint_losses = [float(x) for x in state.get("losses", [])]  # absent in older checkpoints
    run.log(f"resumed from {run.latest} at step {run.start_step}")


def compile_or_check(run: DrafterRun) -> tuple[CompileReport | None, float]:
    """flex: the serialized compile step; sdpa (CPU): refuse shapes whose dense scores cannot fit."""
    if run.step.backend != "flex":
        check_dense_fits(run.cfg, run.drafter, run.ctx.device)
        return None, 0.0
    cache = compile_cache_dir(run.cfg.train.compile_cache_dir)
    t0 = time.perf_counter()
    buckets = run.buckets or run.cfg.data.context_buckets
    report = compile_drafter_step(run.step, buckets, run.cfg.train.micro_batch, cache,
                                  console.print, label=run.ctx.label, serialized=run.shard.serial_compile,
                                  target=run.target)
    return report, time.perf_counter() - t0


def save_checkpoint(run: DrafterRun, done: int, losses: list[float] | None = None) -> Path | None:
    """Every drafter rank calls it (FSDP gathers the state from all of them); the lead writes."""
    weights, optimizer_state = run.shard.full_state(run.optimizer, run.lead)
    if not run.lead:
        return None
    train, root = run.cfg.train, run.out / "checkpoints"
    state = {"optimizer": optimizer_state, "scheduler": run.scheduler.state_dict(), "rng": ckpt.rng_state(),
             "step": done, "data_position": done * train.grad_accum * run.ctx.num_drafters,
             "config": run.cfg.to_dict(),
             # the losses up to this step: a run killed after its last save resumes to a summary that has them
             "losses": run.checkpoint_losses + list(losses or [])}
    previous = ckpt.latest_checkpoint(root)
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    with storage.explained(f"saving checkpoint step {done} in {root}", root,
                           f"Nothing was half-written ({kept}): free space, then --resume continues from it."):
        return ckpt.save_checkpoint(root, done, lambda d: run.drafter.save_pretrained(d, weights), state,
                                    max(1, train.keep_last))


def log_step(run: DrafterRun, bar, metrics: Metrics, step: int, figures: StepFigures, seconds: float,
             peak: float | None) -> None:
    """The progress bar's figures and the TensorBoard / W&B scalars (the lead drafter rank only)."""
    slot_acc = figures.slot_accuracy  # slot k: the token k after the anchor
    acc = sum(slot_acc[1:]) / max(1, len(slot_acc) - 1)
    tokens_per_s = figures.tokens / seconds
    mfu = figures.flops / seconds / peak if peak else None
    bar.set_postfix(loss=f"{figures.loss:.3f}", acc=f"{acc:.2f}", tok_s=f"{tokens_per_s:,.0f}",
                    **({"mfu": f"{mfu:.1%}"} if mfu else {}))
    scalars = {"loss": figures.loss, "acc": acc, "grad_norm": figures.grad_norm,
               "lr": figures.lr, "tokens_per_s": tokens_per_s,
               f"{run.wait_kind}_s": figures.wait_s, "step_s": seconds}
    if mfu:
        scalars["mfu"] = mfu
    metrics.scalars({**{f"train/{k}": v for k, v in scalars.items()},
                     **{f"slot_acc/{k:02d}": slot_acc[k] for k in range(1, len(slot_acc))}}, step)


MAX_SILENCE_S = 60.0  # the longest a log goes without a progress line, besides the first step's and every log_every


@dataclass
class LogWindow:
    """The plain progress line of a log (stderr not a terminal): its rates cover the steps since the
    previous line, not one step."""

    step: int
    started: float = field(default_factory=time.perf_counter)
    said: float = field(default_factory=time.perf_counter)  # when the last line was made
    losses: int = 0
    tokens: int = 0
    train_s: float = 0.0
    wait_s: float = 0.0
    flops: float = 0.0

    def line(self, run: DrafterRun, history: History, done: int, figures: StepFigures,
             peak: float | None) -> tuple[str, dict]:
        """The line, and its figures as fields (--log-format json)."""
        total, steps = run.cfg.train.steps, done - self.step
        train_s = history.train_s - self.train_s
        tokens_per_s = (history.tokens - self.tokens) / train_s if train_s > 0 else 0.0
        mfu = (history.flops - self.flops) / train_s / peak if peak and train_s > 0 else None
        step_ms = 1e3 * train_s / steps if steps else None  # the mean over the steps since the previous line
        wait_s = history.wait_s - self.wait_s
        losses = history.losses[self.losses:] or [figures.loss]
        left = eta(steps, total - done + steps, train_s) if steps else "?"
        parts = [f"train: step {done}/{total} ({done / total:.0%})", f"loss {sum(losses) / len(losses):.3f}",
                 f"acc {slot_summary(figures.slot_accuracy)}", f"{tokens_per_s:,.0f} tok/s",
                 *([f"{step_ms:,.1f} ms/step"] if step_ms is not None else []),
                 *([f"MFU {mfu:.1%}"] if mfu else []), f"lr {figures.lr:.2e}",
                 f"elapsed {duration(time.perf_counter() - self.started)}, ETA {left}",
                 f"{run.wait_kind} wait {wait_s:.1f}s ({wait_s / train_s if train_s > 0 else 0:.0%})"]
        self.step, self.losses, self.tokens = done, len(history.losses), history.tokens
        self.train_s, self.wait_s, self.flops = history.train_s, history.wait_s, history.flops
        self.said = time.perf_counter()
        fields = {"step": done, "steps": total, "loss": sum(losses) / len(losses), "tokens_per_s": tokens_per_s,
                  "lr": figures.lr, "mfu": mfu, "step_ms": step_ms}
        return " | ".join(parts), fields

    def overdue(self) -> bool:
        """A line is due whatever train.log_every says: slow steps would leave the log silent for minutes."""
        return time.perf_counter() - self.said >= MAX_SILENCE_S


class StepBook:
    """The loop's bookkeeping: each step's figures into the history, the progress bar and metrics, and the
    T:D split judged over steps 3-12 of this run (past start-up) when target ranks feed it."""

    def __init__(self, run: DrafterRun, metrics: Metrics | None, startup: Startup):
        self.run, self.metrics, self.startup = run, metrics, startup
        train, device = run.cfg.train, run.ctx.device
        self.peak = peak_flops(device)
        self.history = History()
        self.clock = StepClock(device)
        self.bar = tqdm(range(run.start_step, train.steps), initial=run.start_step, total=train.steps, desc="train",
                        dynamic_ncols=True, disable=True if not run.lead or plain_progress() else None)
        # A log (stderr not a terminal) has no bar: a plain line after the first step, every train.log_every
        # steps and at least once a minute instead. The lead
        # also keeps the latest line in OUTPUT/progress.txt, which `dflash-run status` reads where no log is.
        self.window = LogWindow(run.start_step) if run.lead else None
        self.plain = plain_progress()
        self.advise = run.wait_kind == "transfer" and run.lead
        self.judged = range(run.start_step + 3, min(run.start_step + 12, train.steps) + 1)
        self.seen: list[tuple[float, float]] = []  # (step seconds, seconds waiting for features)

    def read(self, done: int, result, lap) -> float:
        """Step `done`'s figures, read from the device: recorded, logged; returns its stop votes."""
        run, train = self.run, self.run.cfg.train
        figures, seconds = result.read(), self.clock.seconds(lap)
        self.history.record(done, figures, seconds)
        if done == run.start_step + 1:
            self.startup.mark("step 1")
            run.log(run.ctx.label + self.startup.line())
            note = uncompiled_note() if run.lead else None
            if note:
                run.log(note)
        if run.lead and (done % train.log_every == 0 or done in (run.start_step + 1, train.steps)
                         or (self.window is not None and self.window.overdue())):
            log_step(run, self.bar, self.metrics, done, figures, seconds, self.peak)
            if self.window is not None:
                line, fields = self.window.line(run, self.history, done, figures, self.peak)
                if self.plain:
                    say_progress(line, **fields)
                run_dir.record_progress(run.out, line)
        if self.advise and done in self.judged:
            self.judge_split(done, seconds, figures.step_wait_s)
        return figures.stop_votes

    def judge_split(self, done: int, seconds: float, wait_s: float) -> None:
        """After the last judged step: the advice on the target:drafter split."""
        ctx = self.run.ctx
        self.seen.append((seconds, wait_s))
        if done == self.judged[-1]:
            self.run.log(ctx.label + drafter_side_advice([t for t, _ in self.seen], [w for _, w in self.seen],
                                                         self.run.cfg.train.grad_accum, ctx.roles.num_targets,
                                                         ctx.num_drafters, ctx.target_tp))


def checkpoint_due(train, done: int) -> bool:
    """train.checkpoint_every = 0: no checkpoints (benchmarks); the final drafter is still saved."""
    every = train.checkpoint_every
    return bool(every) and (done % every == 0 or done == train.steps)


def train_loop(run: DrafterRun, metrics: Metrics | None, startup: Startup) -> History:
    """Steps start_step+1 .. train.steps; checkpoints every train.checkpoint_every steps; a graceful stop
    (SIGTERM / SIGINT) writes a checkpoint at the step it ends on.

    The host runs a step ahead of the GPU: step k is launched before step k-1's figures are read (they
    were copied to the host behind step k-1's work), so the GPU never idles while the host waits.
    Before a checkpoint the pending figures are read first (a diverged loss is never saved).
    """
    cfg, ctx, device = run.cfg, run.ctx, run.ctx.device
    train = cfg.train
    book = StepBook(run, metrics, startup)
    run.drafter.train()
    pending, votes = None, 0.0
    with StopRequest() as stop:
        for step in book.bar:
            done = step + 1
            result = run.step.run(run.source, train.grad_accum,
                                  lambda index: anchor_generator(train.seed, device, index),
                                  lambda totals: parallel.all_reduce_sum(ctx, totals), ctx.num_drafters,
                                  stop_vote=stop.requested)
            lap = book.clock.lap()
            if pending is not None:
                votes = book.read(*pending)
            pending = (done, result, lap)
            # One drafter rank stops on its own signal; several stop on the votes all of them read.
            stop_now = done < train.steps and (stop.requested if ctx.num_drafters == 1 else votes > 0)
            due = checkpoint_due(train, done)
            if due or stop_now or done == train.steps:
                book.read(*pending)
                pending = None
            if due or stop_now:
                path = save_checkpoint(run, done, book.history.losses)
            if stop_now:
                book.history.stopped_at = done
                run.log(f"stopped at step {done}: checkpoint {path}; continue with --resume")
                break
        if pending is not None:
            book.read(*pending)
    book.bar.close()
    return book.history


def finish(run: DrafterRun, history: History, before: dict | None, report: CompileReport | None,
           compile_s: float, metrics: Metrics | None, startup: Startup) -> dict | None:
    """The published drafter directory, tau before and after (colocated), summary.json (the lead)."""
    weights, _ = run.shard.full_state(None, run.lead)  # collective under FSDP
    if not run.lead:
        return None
    cfg, out = run.cfg, run.out
    # --resume publishes it from the last checkpoint; a run without checkpoints has to train again.
    fix = ("The checkpoints are intact: free space, then --resume publishes it." if cfg.train.checkpoint_every else
           "train.checkpoint_every = 0 kept no checkpoint to publish it from: free space, then train again "
           "with --overwrite.")
    with storage.explained(f"publishing the drafter to {out / 'drafter'}", out, fix):
        final_dir = storage.publish_dir(out / "drafter", lambda d: publish_drafter(run, weights, d))
    summary = run_summary(run, history, report, compile_s, startup, final_dir)
    if run.ctx.colocated:
        summary.update(evaluate_published(run, before, final_dir))
        with storage.explained(f"writing {final_dir / model_card.CARD}", out, "The drafter is published; free space."):
            model_card.update_tau(final_dir, [model_card.TauRow("held-out", len(run.prompts), summary["tau_after"])],
                                  f"measured by the training run on its held-out prompts (greedy, up to "
                                  f"{cfg.eval.max_new_tokens} new tokens)")
        metrics.scalars(evaluation_scalars(summary), cfg.train.steps)
    with storage.explained(f"writing {out / 'summary.json'}", out, "The drafter is published; free space."):
        if run.ctx.colocated:  # what `dflash-eval --run` reads
            summary["eval_prompts"] = str(record_eval_prompts(out, run.prompts))
        write_summary(out, summary)
    if cfg.publish.push_to:
        push_published(run, final_dir, summary)
    metrics.summary(summary)
    metrics.close()
    return summary


def publish_drafter(run: DrafterRun, weights: dict | None, directory: Path) -> None:
    """The drafter's directory: its weights, config, modelling file and model card."""
    run.drafter.save_pretrained(directory, weights)
    cfg = run.cfg
    model_card.write_card(directory, json.loads((directory / "config.json").read_text()), cfg.target.path,
                          cfg.data.train, cfg.train.steps)


def push_published(run: DrafterRun, final_dir: Path, summary: dict) -> None:
    """publish.push_to: every file of the published drafter directory (a model card written there included) to the
    hub repository, one commit; summary.json records where."""
    from .infra import hub

    publish, steps = run.cfg.publish, run.cfg.train.steps
    run.log(f"pushing {final_dir} to the hub repository {publish.push_to}", markup=False)
    commit = hub.push_dir(final_dir, publish.push_to, publish.private,
                          f"DFlash drafter: {run.out.name}, step {steps}")
    run.log(f"pushed to {publish.push_to}: {commit}", markup=False)
    summary["pushed_to"] = {"repo": publish.push_to, "commit": commit}
    with storage.explained(f"writing {run.out / 'summary.json'}", run.out, "The drafter is published and pushed."):
        write_summary(run.out, summary)


def run_summary(run: DrafterRun, history: History, report: CompileReport | None, compile_s: float,
                startup: Startup, final_dir: Path) -> dict:
    """The run's figures for summary.json; a resume that trained nothing keeps the ones recorded before."""
    device, out = run.ctx.device, run.out
    peak = peak_flops(device)
    summary = {
        "steps": run.cfg.train.steps,
        "first_loss": history.losses[0] if history.losses else None,
        "final_loss": history.losses[-1] if history.losses else None,
        "tokens_per_s": history.tokens / history.train_s if history.train_s else None,
        "mfu": history.flops / history.train_s / peak if peak and history.train_s else None,
        # after the first STEADY_AFTER steps: the median step, and MFU over those steps (run/summary.py)
        "steady_step_ms": steady_step_ms(history.step_s),
        "steady_mfu": steady_mfu(history.step_s, history.step_flops, peak),
        "time_split_s": {run.wait_kind: history.wait_s, "drafter": history.drafter_s},
        "compile_s": compile_s,
        "time_to_first_step_s": startup.total() if history.losses else None,
        "startup_s": startup.phases(),
        "compile_cache_hits": report.cache_hits if report else None,
        "context_buckets_used": run.buckets,  # the lengths its micro-batches take (None: not known here)
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "drafter_ranks": run.ctx.num_drafters,
        "drafter_dir": str(final_dir),
        # None where none was written (train.checkpoint_every = 0): the summary names no directory that is not there
        "checkpoints": str(out / "checkpoints") if ckpt.list_checkpoints(out / "checkpoints") else None,
        "losses": history.losses,
    }
    previous = run_dir.recorded_summary(out)
    if not history.losses and isinstance(previous, dict):
        # A resume that trained nothing (a finished run whose drafter/ was removed) published the drafter
        # again: the run's figures are the ones its summary already holds.
        summary.update({k: previous[k] for k in ("first_loss", "final_loss", "tokens_per_s", "mfu", "time_split_s",
                                                 "steady_step_ms", "steady_mfu", "time_to_first_step_s",
                                                 "losses") if k in previous})
    elif not history.losses and run.checkpoint_losses:
        # Killed after its last checkpoint and before summary.json: the losses that checkpoint recorded.
        summary.update(first_loss=run.checkpoint_losses[0], final_loss=run.checkpoint_losses[-1],
                       losses=run.checkpoint_losses)
    return summary


def evaluate_published(run: DrafterRun, before: dict | None, final_dir: Path) -> dict:
    """Colocated runs: tau before and after training, and the published drafter's serving check."""
    cfg, device = run.cfg, run.ctx.device
    leave_run_phase()  # evaluation shapes (batch sizes) differ from the training step's
    if before is None:  # resumed: rebuild the initial drafter for the comparison
        before, after = evaluate_saved(cfg, run.target, run.tokenizer, run.eval_stream, run.prompts, final_dir,
                                       device)
    else:
        after = evaluate(cfg, run.drafter, run.target, run.tokenizer, run.eval_stream, run.prompts,
                         "after training")
    figures = {"tau_before": before["tau"], "tau_after": after["tau"], "slot_accuracy_after": after["slot_accuracy"],
               "slot_acceptance_after": after["slot_acceptance"],
               "tau_before_method": before.get("tau_method", "speculative decoding")}
    if run.eval_stream is not None:  # the published drafter, reloaded, on the features serving computes
        figures["serving_check"] = check_published(cfg, run.drafter, final_dir, run.target, run.eval_stream)
    figures["target_attention"] = run.target.attention  # chosen per family at load (loading.load_target)
    return figures


def run_drafter(cfg: RunConfig, ctx: parallel.Context, start: run_dir.RunStart, target_files: TargetFiles,
                startup: Startup | None = None, drafter_config=None) -> dict | None:
    startup = startup or Startup()
    run = setup_drafter(cfg, ctx, start, target_files, startup, drafter_config)
    if run.latest is not None:
        restore(run)
        startup.mark("restore")
    if run.lead:  # everything loaded: only now does the run take the directory over
        run_dir.commit(start, cfg)
    before = None
    if ctx.colocated and run.start_step == 0:
        before = evaluate_before(cfg, run.drafter, run.target, run.tokenizer, run.eval_stream, run.prompts)
        startup.mark("evaluation before training")
    report, compile_s = compile_or_check(run)
    startup.mark("compile step")
    if run.borrowed is not None:
        run.borrowed.wait()  # read beside the compile step; what it did not cover counts here
        startup.mark("embedding + head")
    # A resumed run goes on logging to the tracker runs it started (OUTPUT/trackers.json).
    metrics = Metrics(run.out, cfg.train.report_to, cfg.to_dict(), run.out.name, cfg.train.wandb_project, run.log,
                      resume=Metrics.records(run.out) if run.start_step else None) if run.lead else None
    history = train_loop(run, metrics, startup)
    if history.stopped_at is not None:
        if metrics:
            metrics.close()
        return {"stopped_at": history.stopped_at}
    return finish(run, history, before, report, compile_s, metrics, startup)


# ---- entry points --------------------------------------------------------------------------------

def _say_once(text: str) -> None:
    """Before the process group exists: only global rank 0 (torchrun's RANK) prints."""
    if os.environ.get("RANK", "0") == "0":
        console.print(escape(text), soft_wrap=True)


def run(cfg: RunConfig, resume: bool = False, overwrite: bool = False, auto_resume: bool = False) -> dict | None:
    startup = Startup()
    startup.mark("start-up and imports")
    cfg.output_dir = str(Path(cfg.output_dir).absolute())
    check_inputs(cfg)  # before anything loads or starts
    check_init_from(cfg)  # explicit drafter settings that drafter.init_from would override: refused
    if not cfg.data.features_dir:
        for note in unfinished_regenerations(cfg.data.train):
            _say_once(note)
    with run_dir.removed_if_left_empty(Path(cfg.output_dir)):  # a refused start leaves no empty directory
        return _start(cfg, resume, overwrite, auto_resume, startup)


def _start(cfg: RunConfig, resume: bool, overwrite: bool, auto_resume: bool, startup: Startup) -> dict | None:
    start = run_dir.prepare(cfg, resume, overwrite, auto_resume, say=_say_once)
    if start.finished:  # --auto-resume / --resume of a finished run: said so; nothing to train or change
        return None
    p = cfg.parallel
    ctx = parallel.init(p.target_ranks, p.drafter_ranks, offline=bool(cfg.data.features_dir),
                        isolate_gpus=p.isolate_gpus, target_tp=p.target_tp)
    startup.mark("run directory, process group and GPU")
    prefetch_triton_key(ctx.device)  # the compile step's first cache lookup needs it: hashed beside the setup
    if ctx.device.type == "cuda":  # Triton's compile workers start beside the setup, not at the first compile
        start_compile_workers(compile_cache_dir(cfg.train.compile_cache_dir))
    # After a failure, no graceful teardown: destroy_process_group can wait forever on a peer still
    # blocked in a send to this rank (NCCL), and the traceback would only print after it. The error
    # propagates at once; torchrun sees the failed rank and stops the others (torchtitan does the same).
    summary = _run_rank(cfg, ctx, start, startup)
    parallel.shutdown(ctx)
    return summary


def _accept(cfg: RunConfig, ctx: parallel.Context, start: run_dir.RunStart,
            target_files: TargetFiles) -> Qwen3Config | None:
    """Every rank checks a resumed drafter against its checkpoint; rank 0 then cleans the checkpoints.
    Returns the drafter config it checked (None on a new start): the rest of the start builds from it
    rather than read drafter.init_from's config.json again."""
    checked = None
    if start.resume_from is not None:
        checked = drafter_config_for(cfg, target_files.config, target_files.tokenizer)
        run_dir.check_model(start, cfg, checked)
    if ctx.rank == 0:
        for note in start.notes + run_dir.clean(start) + repeated_taps_note(cfg, target_files.config):
            console.print(escape(note), soft_wrap=True)
    ctx.barrier()  # the others read the checkpoints once they are clean
    return checked


def _run_rank(cfg: RunConfig, ctx: parallel.Context, start: run_dir.RunStart, startup: Startup) -> dict | None:
    embedded = cfg.target.path == "embedded"
    cfg = resolve_target(cfg, ctx)
    if embedded:
        startup.mark("embedded default's assets")
    target_files = read_target_files(cfg, ctx)  # once: the resume check and the setup below share them
    if cfg.train.epochs is not None:
        steps_from_epochs(cfg, ctx, target_files.tokenizer)
    drafter_config = _accept(cfg, ctx, start, target_files)
    if ctx.is_target:
        start_step, _ = start.resume_point  # prepare's look at the checkpoints, as rank 0 has cleaned them
        return run_target(cfg, ctx, start_step, target_files, drafter_config)
    summary = run_drafter(cfg, ctx, start, target_files, startup, drafter_config)
    if summary is not None and "stopped_at" in summary:
        if not ctx.colocated:  # the target ranks stop on the same signal; nobody waits for them
            os._exit(0)
        return summary
    if ctx.colocated or (summary is not None and ctx.roles.offline):
        print_summary(summary)
    ctx.barrier()
    return summary


def steps_from_epochs(cfg: RunConfig, ctx: parallel.Context, tokenizer) -> None:
    """train.epochs -> train.steps, from the micro-batches one epoch holds (every rank derives the same): the
    rows of data.train the run trains on (without the held-out prompts, where those come from data.train),
    or the micro-batches of dumped features."""
    from .data.features import FeatureShards

    per_step = cfg.train.grad_accum * ctx.num_drafters
    if cfg.data.features_dir:
        count = FeatureShards(cfg.data.features_dir).count
        what = f"{count} dumped micro-batches, {per_step} a step"
    else:
        rows, eval_rows = training_rows(cfg, tokenizer, quiet=True)
        held_out = f" after {len(eval_rows)} held out for evaluation" if eval_rows is not None else ""
        # Whole micro-batches, as the stream takes them (MicroBatches.per_epoch): every micro-batch has the
        # one shape the compile step compiled, so an epoch's last partial one is left out (rows drawn anew each
        # epoch). steps = ceil(epochs x floor(rows / micro_batch) / per_step), as docs/configuration.md says.
        count = len(rows) // cfg.train.micro_batch
        partial = len(rows) - count * cfg.train.micro_batch
        what = (f"{len(rows)} usable rows{held_out}: {count} micro-batches of {cfg.train.micro_batch}"
                + (f", the last {partial} rows of each epoch's shuffle left out" if partial else "")
                + f"; {per_step} a step")
    cfg.train.steps = max(1, math.ceil(cfg.train.epochs * count / per_step))
    if ctx.rank == 0:
        console.print(f"train.epochs = {cfg.train.epochs:g}: {cfg.train.steps} steps ({what})", soft_wrap=True)


# Exit 2: the input (config, data, run directory) needs a change; exit 1: a fault while running (cli_args).
USAGE_ERRORS = cli_args.bad_input_errors()


def explain(exc: BaseException) -> tuple[int, str]:
    """(exit code, the one message) for an error that ends the run."""
    if isinstance(exc, USAGE_ERRORS):
        return cli_args.BAD_INPUT, str(exc)
    if isinstance(exc, (storage.StorageError, ckpt.DamagedCheckpoint, FloatingPointError, HubError)):
        return cli_args.FAULT, str(exc)
    if (error := storage.os_error_in(exc)) is not None:
        where = Path(error.filename) if error.filename else Path.cwd()
        return 1, f"{error.filename or type(exc).__name__}: {storage.describe(error, where)}"
    return 1, f"{type(exc).__name__}: {exc}"


# The flags that set one config key each.
KEY_FLAGS = {"--output-dir": "output_dir", "--target-gpus": "parallel.target_ranks",
             "--drafter-gpus": "parallel.drafter_ranks", "--push-to": "publish.push_to"}


def demo_settings_note(config: str | None, cfg: RunConfig) -> str | None:
    """The bundled demo's settings (the default --config, sized for its six-layer toy target) under a target of
    the user's: said at the start, since nothing else would say why a real model trains on 128-token rows."""
    if config != "embedded" or cfg.target.path == "embedded":
        return None
    return (f"note: the base config is the bundled demo's (--config embedded, sized for its toy target; this run has "
            f"data.max_length = {cfg.data.max_length}, drafter.block_size = {cfg.drafter.block_size}, train.lr = "
            f"{cfg.train.lr:g}, train.dtype = {cfg.train.dtype}), with target.path = {cfg.target.path}: for a real model "
            "start from a bundled run config (--config qwen3-8b, llama-3.1-8b-instruct, gemma-3-12b-it, gpt-oss-20b) or "
            "a file of your own; --print-config shows every value")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-train", description="Train a DFlash drafter.")
    cli_args.add_config_flags(p, default="embedded")
    p.add_argument("--output-dir", type=cli_args.directory,
                   help="where checkpoints, logs and the drafter go (overrides output_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the output dir")
    p.add_argument("--overwrite", action="store_true", help="replace the run the output dir holds")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue the run in the output dir if it holds one that did not finish (--resume: from "
                        "its last checkpoint); a finished run is reported (where its drafter and summary are, how "
                        "to train again) and nothing changes, exit 0; otherwise a new run. Not with --resume or "
                        "--overwrite")
    p.add_argument("--target-gpus", type=cli_args.for_key("parallel.target_ranks"),
                   help="target ranks T (parallel.target_ranks)")
    p.add_argument("--drafter-gpus", type=cli_args.for_key("parallel.drafter_ranks"),
                   help="drafter ranks D (parallel.drafter_ranks)")
    p.add_argument("--push-to", metavar="REPO",
                   help="after training, upload the drafter directory to this hub repository, org/name "
                        "(publish.push_to)")
    p.add_argument("--dump-features", metavar="DIR", type=cli_args.directory,
                   help="offline mode: write target features to DIR and exit")
    p.add_argument("--dump-batches", type=cli_args.STEPS, help="micro-batches to dump (default: one epoch)")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (or DFLASH_DEBUG=1)")
    cli_args.add_log_format_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    plain_output_off_a_terminal()  # before anything loads or saves a checkpoint
    args = cli_args.parse(parser(), argv)
    if isinstance(args, int):  # a bad flag, said by argparse (2), or --help (0)
        return args
    cli_args.use_log_format(args, "train")
    cfg = None
    try:
        # --print-config prints any config that parses (types, ranges, known keys); what a run needs besides
        # (a target, data) is said beside it, not refused: printing is how an incomplete config gets completed.
        # Every problem at once: the keys' types and ranges, what a run needs of them, the inputs being there.
        cfg = cli_args.run_config(args, KEY_FLAGS, whole_run=not args.print_config,
                                  checks=None if args.print_config else input_problems)
        if args.print_config:
            cli_args.print_config(cfg)
            if problems := semantic_problems(cfg):
                console.print("note: this config cannot start a run yet:\n  - " + escape("\n  - ".join(problems)),
                              soft_wrap=True)
            return 0
        if note := demo_settings_note(args.config, cfg):
            _say_once(note)
        if args.dump_features:
            check_inputs(cfg)
            check_init_from(cfg)
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process: it builds the embedded default itself
                cfg = resolve_target(cfg, parallel.Context(1, 0, 0, torch.device("cpu"), None, None))
            dump_features(cfg, Path(args.dump_features), args.dump_batches)
        else:
            run(cfg, resume=args.resume, overwrite=args.overwrite, auto_resume=args.auto_resume)
    except KeyboardInterrupt as exc:  # start-up, or a second signal (infra/stop_signal.py): said as it is on disk
        return _say_interrupted(cfg, signal_name_of(exc), getattr(exc, "second", False))
    except Exception as exc:  # noqa: BLE001 - every error ends as one message (a traceback with --debug)
        return _ended(exc, cfg, args.debug)
    return 0


def _ended(exc: Exception, cfg: RunConfig | None, debug: bool) -> int:
    """The exit code of an error that ended the run, said in one line."""
    if isinstance(exc, BrokenPipeError) and stdout_closed():  # `--print-config | head`: infra/entry.py ends it
        raise exc
    if (name := received_signal()) is not None:  # what a signal's exception left behind (a library cut short)
        return _say_interrupted(cfg, name, False)
    return _say_error(exc, debug)


def _say_interrupted(cfg: RunConfig | None, name: str, second: bool) -> int:
    """A signal ended the run where it was: one line of what the run directory holds; 130 / 143."""
    _say_once(f"stopped by {name} while reading the config: nothing was written" if cfg is None else
              run_dir.interrupted_note(Path(cfg.output_dir).absolute(), name, second))
    return stop_exit_code(name)


def _say_error(exc: Exception, debug: bool) -> int:
    """The error that ended the run in one line (its traceback too with --debug or DFLASH_DEBUG=1); its exit code."""
    code, message = explain(exc)
    debug = debug or os.environ.get("DFLASH_DEBUG", "") not in ("", "0")
    if debug:
        traceback.print_exception(exc)
    hint = "" if debug or code == 2 else " (--debug or DFLASH_DEBUG=1 prints the traceback)"
    console.print(f"[red]error:[/] {escape(message)}{hint}", soft_wrap=True)
    return code

