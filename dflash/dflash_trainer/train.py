"""Train a DFlash drafter.

    python -m dflash_trainer.train --config embedded                  # one process: target + drafter
    torchrun --nproc-per-node 8 -m dflash_trainer.train --config run.toml --target-gpus 5 --drafter-gpus 3
    python -m dflash_trainer.train --config run.toml --dump-features feats/   # offline: dump once ...
    torchrun --nproc-per-node 2 -m dflash_trainer.train --config run.toml --set data.features_dir=feats/ \\
        --target-gpus 0 --drafter-gpus 2                                   # ... train many epochs on it

The drafter loop reads top to bottom: features (from the local target, a target rank, or disk) ->
random anchors -> blocks -> drafter loss -> step; the compile step runs before step 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import checkpoint as ckpt
from . import parallel
from .compile_step import check_dense_fits, warm_drafter
from .config import ConfigError, RunConfig, load_config
from .data import DataError
from .evaluate import evaluate, evaluate_saved
from .features import FeatureShards
from .flops import drafter_step_flops, peak_flops
from .loading import (
    DTYPES,
    attention_backend,
    console,
    load_data,
    load_target,
    load_tokenizer,
    new_drafter,
    resolve_target,
    resume_step,
)
from .metrics import Metrics
from .objective import drafter_loss, prepare_micro_batch
from .optim import MasterWeightAdamW, warmup_cosine
from .parallel import synchronize as _sync
from .sharding import shard_drafter
from .sources import disk_source, local_source, remote_source
from .summary import print_summary, write_summary
from .target import load_embed_and_head
from .target_rank import dump_features, run_target

PROCESS_START = time.perf_counter()  # for time-to-first-step (imports included)


# ---- the drafter loop ----------------------------------------------------------------------------

class StopRequest:
    """SIGTERM / SIGINT: finish the step in progress, write a checkpoint, exit cleanly.

    `make train-stop` and `systemctl stop` send SIGTERM (to torchrun, which forwards it to every
    worker). Drafter ranks agree on the step to stop at (one tiny all-reduce per step), the lead
    writes the checkpoint, and `--resume` continues from exactly there.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        if self.requested:  # a second signal: stop now, without the checkpoint
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.requested = True
        console.print(f"{signal.Signals(signum).name}: stopping after this step's checkpoint "
                      "(send it again to stop at once)")

    def agreed(self, ctx: parallel.Context, device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        return bool(parallel.all_reduce_sum(ctx, flag).item() > 0)


def run_drafter(cfg: RunConfig, ctx: parallel.Context, resume: bool) -> dict | None:
    c, out, device = cfg, Path(cfg.output_dir), ctx.device
    lead = ctx.leads_drafters
    log = console.print if lead else (lambda *a, **k: None)
    tokenizer = load_tokenizer(c)
    from transformers import AutoConfig

    drafter = new_drafter(c, AutoConfig.from_pretrained(c.target.path), tokenizer)
    dtype = DTYPES[c.train.dtype]
    dc, A, D = drafter.config, c.train.grad_accum, ctx.num_drafters
    shard = shard_drafter(c.parallel.drafter_sharding, drafter, device, dtype,
                          ctx.groups.drafters if ctx.groups is not None else None, D)
    num_batches = c.train.steps * A * D
    start_step, latest = resume_step(c, resume)
    if resume and latest is None:
        log(f"--resume: no checkpoint under {out / 'checkpoints'}; starting from step 0")
    start = start_step * A * D
    my_batches = range(ctx.drafter_index + start, num_batches, D)  # micro-batch i goes to drafter i % D

    target = stream = eval_stream = prompts = None
    if ctx.colocated:
        target = load_target(c, drafter.target_layer_ids, device)
        embed, head = target.embed_weight, target.head_weight
        stream, eval_stream, prompts = load_data(c, tokenizer)
        source = local_source(stream, target, my_batches, dtype, device)
        wait_kind, samples = "target", len(stream.dataset)
    else:
        embed, head = load_embed_and_head(c.target.path, device, DTYPES[c.target.dtype])
        if ctx.roles.offline:
            shards = FeatureShards(c.data.features_dir, drafter.target_layer_ids)
            source, wait_kind, samples = disk_source(shards, my_batches, dtype, device), "disk", shards.count
        else:
            from .transport import FeatureReceiver

            receiver = FeatureReceiver(ctx.roles, ctx.rank, ctx.groups, device, c.parallel.prefetch, start=start)
            source, wait_kind, samples = remote_source(receiver, dtype), "transfer", None
    log(f"drafter: {dc.num_hidden_layers} layers, hidden {dc.hidden_size}, block {dc.block_size}, target layers "
        f"{drafter.target_layer_ids}, {drafter.num_params() / 1e6:.2f}M params; "
        + (f"{samples} training samples; " if samples else "")
        + f"{D} drafter rank(s) ({shard.name}); attention {attention_backend(c, device)} on {device}")

    model = shard.module  # what runs the forward: the drafter, its DDP wrapper, or the FSDP-sharded drafter
    opt = MasterWeightAdamW(drafter.parameters(), lr=c.train.lr, weight_decay=c.train.weight_decay,
                            max_grad_norm=c.train.max_grad_norm)
    sched = warmup_cosine(opt.opt, c.train.steps, int(c.train.warmup_ratio * c.train.steps), c.train.min_lr_ratio)
    if latest is not None:
        state = ckpt.load_train_state(latest)
        shard.load(latest, state["optimizer"], opt)
        sched.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        log(f"resumed from {latest} at step {start_step}")

    backend = attention_backend(c, device)
    before = None
    if ctx.colocated and start_step == 0:
        before = evaluate(c, drafter, target, tokenizer, eval_stream, prompts, "before training")
    warmup_report = None
    compiled_layers = backend == "flex" and c.train.compile_layers and shard.compiled_layers
    if backend == "flex":
        cache = Path(c.train.compile_cache_dir or out / "compile-cache")
        t0 = time.perf_counter()
        warmup_report = warm_drafter(drafter, embed, head, c.data.context_buckets, c.train.micro_batch,
                                     c.train.num_anchors, c.drafter.gamma, c.train.loss_chunk_rows,
                                     cache, console.print, label=ctx.label, compiled_layers=compiled_layers,
                                     serialized=shard.serial_warmup, optimizer=opt)
        warmup_s = time.perf_counter() - t0
    else:
        check_dense_fits(c, drafter, device)
        warmup_s = 0.0

    metrics = Metrics(out / "tb", c.to_dict(), c.train.wandb_project, out.name, log) if lead else None
    peak = peak_flops(device)
    losses: list[float] = []
    tokens_total, flops_total, train_time, t_wait, t_drafter = 0, 0.0, 0.0, 0.0, 0.0
    first_step_at = None
    bar = tqdm(range(start_step, c.train.steps), initial=start_step, total=c.train.steps, desc="train",
               dynamic_ncols=True, disable=None if lead else True)
    def save_checkpoint(done: int) -> Path | None:
        """Every drafter rank calls it (FSDP gathers the state from all of them); the lead writes."""
        weights, opt_state = shard.full_state(opt, lead)
        if not lead:
            return None
        state = {"optimizer": opt_state, "scheduler": sched.state_dict(), "rng": ckpt.rng_state(),
                 "step": done, "data_position": done * A * D, "config": c.to_dict()}
        return ckpt.save_checkpoint(out / "checkpoints", done, lambda d: drafter.save_pretrained(d, weights), state,
                                    max(1, c.train.keep_last))

    stop = StopRequest()
    stop.install()  # restored right after the loop
    stopped_at = None
    drafter.train()
    try:
        for step in bar:
            t0 = time.perf_counter()
            ce_sum = torch.zeros((), device=device)
            weight_sum = torch.zeros((), device=device)
            correct = torch.zeros(dc.block_size, device=device)
            count = torch.zeros(dc.block_size, device=device)
            step_tokens, step_flops, step_wait = 0, 0.0, 0.0
            for micro in range(A):
                fb = next(source)
                step_wait += fb.wait_s
                mb = prepare_micro_batch(fb.input_ids, fb.loss_mask, c.train.num_anchors, dc, drafter.mask_token_id,
                                         c.drafter.gamma, backend, anchor_generator(c, device, fb.index))
                with shard.gradient_sync(micro == A - 1):  # one gradient reduction per step
                    sums = drafter_loss(drafter, embed, head, fb.features, mb.blocks, mb.attention,
                                        c.train.loss_chunk_rows, model, compiled_layers=compiled_layers)
                    sums.weighted_ce.backward()
                ce_sum += sums.weighted_ce.detach()
                weight_sum += mb.blocks.total_weight
                correct += sums.slot_correct
                count += sums.slot_count
                step_tokens += fb.tokens
                # A device tensor: a float() here would wait for the GPU in the middle of the step.
                step_flops += drafter_step_flops(dc, fb.features.shape[0], fb.features.shape[1], c.train.num_anchors,
                                                 mb.visible_pairs, dc.vocab_size)
            # The loss is normalised by the total weight of the whole step: every micro-batch, every rank.
            # DDP averages gradients over the D ranks, hence D / total.
            totals = parallel.all_reduce_sum(ctx, torch.stack([ce_sum, weight_sum, torch.tensor(
                float(step_tokens), device=device)]))
            total = totals[1].clamp(min=1e-6)
            grad_norm = opt.step(D / total)
            sched.step()
            opt.zero_grad()
            _sync(device)
            dt = time.perf_counter() - t0
            step_flops = float(step_flops)
            first_step_at = first_step_at or time.perf_counter()
            loss = float(totals[0] / total)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step + 1}; lower train.lr or check the data")
            losses.append(loss)
            tokens_total += int(totals[2])
            flops_total += step_flops
            train_time += dt
            t_wait += step_wait
            t_drafter += dt - step_wait
            if lead and ((step + 1) % c.train.log_every == 0 or step + 1 == c.train.steps):
                acc = (correct[1:] / count[1:].clamp(min=1)).mean().item()
                mfu = step_flops / dt / peak if peak else None
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}", tok_s=f"{int(totals[2]) / dt:,.0f}",
                                **({"mfu": f"{mfu:.1%}"} if mfu else {}))
                scalars = {"loss": loss, "acc": acc, "grad_norm": float(grad_norm), "lr": sched.get_last_lr()[0],
                           "tokens_per_s": int(totals[2]) / dt, f"{wait_kind}_s": step_wait, "step_s": dt}
                if mfu:
                    scalars["mfu"] = mfu
                slot_acc = (correct / count.clamp(min=1)).tolist()
                metrics.scalars({**{f"train/{k}": v for k, v in scalars.items()},  # slot k: the token k after the anchor
                                 **{f"slot_acc/{k:02d}": slot_acc[k] for k in range(1, dc.block_size)}}, step + 1)
            every = c.train.checkpoint_every  # 0: no checkpoints (benchmarks); the final drafter is still saved
            if every and ((step + 1) % every == 0 or step + 1 == c.train.steps):
                save_checkpoint(step + 1)
            if step + 1 < c.train.steps and stop.agreed(ctx, device):
                stopped_at = step + 1
                path = save_checkpoint(step + 1)
                if lead:
                    console.print(f"stopped at step {step + 1}: checkpoint {path}; continue with --resume")
                break
    finally:
        stop.restore()
    bar.close()
    if stopped_at is not None:
        if metrics:
            metrics.close()
        return {"stopped_at": stopped_at}
    weights, _ = shard.full_state(None, lead)
    if not lead:
        return None

    final_dir = drafter.save_pretrained(out / "drafter", weights)
    summary = {
        "steps": c.train.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "tokens_per_s": tokens_total / train_time if train_time else None,
        "mfu": flops_total / train_time / peak if peak and train_time else None,
        "time_split_s": {wait_kind: t_wait, "drafter": t_drafter},
        "compile_s": warmup_s,
        "time_to_first_step_s": (first_step_at - PROCESS_START) if first_step_at else None,
        "compile_cache_hits": warmup_report.cache_hits if warmup_report else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "drafter_ranks": D,
        "drafter_dir": str(final_dir),
        "checkpoints": str(out / "checkpoints"),
        "losses": losses,
    }
    if ctx.colocated:
        if before is None:  # resumed: rebuild the initial drafter for the comparison
            before, after = evaluate_saved(c, target, tokenizer, eval_stream, prompts, final_dir, device)
        else:
            after = evaluate(c, drafter, target, tokenizer, eval_stream, prompts, "after training")
        summary.update(tau_before=before["tau"], tau_after=after["tau"], slot_accuracy_after=after["slot_accuracy"])
    write_summary(out, summary)
    metrics.summary(summary)
    metrics.close()
    return summary


def anchor_generator(cfg: RunConfig, device, index: int) -> torch.Generator:
    """Anchors of micro-batch i are a function of (seed, i): a resumed run draws the same ones."""
    return torch.Generator(device=device).manual_seed(cfg.train.seed * 1_000_003 + index)


# ---- entry points --------------------------------------------------------------------------------

def run(cfg: RunConfig, resume: bool = False) -> dict | None:
    p = cfg.parallel
    ctx = parallel.init(p.target_ranks, p.drafter_ranks, offline=bool(cfg.data.features_dir),
                        isolate_gpus=p.isolate_gpus)
    # After a failure, no graceful teardown: destroy_process_group can wait forever on a peer still
    # blocked in a send to this rank (NCCL), and the traceback would only print after it. The error
    # propagates at once; torchrun sees the failed rank and stops the others (torchtitan does the same).
    summary = _run_rank(cfg, ctx, resume)
    parallel.shutdown(ctx)
    return summary


def _run_rank(cfg: RunConfig, ctx: parallel.Context, resume: bool) -> dict | None:
    cfg = resolve_target(cfg, ctx)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:
        (Path(cfg.output_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    if ctx.is_target:
        return run_target(cfg, ctx, resume)
    summary = run_drafter(cfg, ctx, resume)
    if summary is not None and "stopped_at" in summary:
        if not ctx.colocated:  # the target ranks stop on the same signal; nobody waits for them
            os._exit(0)
        return summary
    if ctx.colocated or (summary is not None and ctx.roles.offline):
        print_summary(summary)
    ctx.barrier()
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-train", description="Train a DFlash drafter.")
    p.add_argument("--config", default="embedded", help="a TOML file, or a bundled config name (embedded)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a field")
    p.add_argument("--output-dir", help="where checkpoints, logs and the drafter go (overrides output_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the output dir")
    p.add_argument("--target-gpus", type=int, help="target ranks T (parallel.target_ranks)")
    p.add_argument("--drafter-gpus", type=int, help="drafter ranks D (parallel.drafter_ranks)")
    p.add_argument("--dump-features", metavar="DIR", help="offline mode: write target features to DIR and exit")
    p.add_argument("--dump-batches", type=int, help="micro-batches to dump (default: one epoch)")
    args = p.parse_args(argv)
    try:
        overrides = list(args.set) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
        overrides += [f"parallel.target_ranks={args.target_gpus}"] if args.target_gpus is not None else []
        overrides += [f"parallel.drafter_ranks={args.drafter_gpus}"] if args.drafter_gpus is not None else []
        cfg = load_config(args.config, overrides)
        if args.dump_features:
            dump_features(cfg, Path(args.dump_features), args.dump_batches)
        else:
            run(cfg, resume=args.resume)
    except (ConfigError, DataError, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
