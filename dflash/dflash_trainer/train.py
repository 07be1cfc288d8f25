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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from . import checkpoint as ckpt
from . import parallel
from .anchors import build_blocks, sample_anchors
from .config import ConfigError, RunConfig, load_config
from .data import DataError, MicroBatches, load_rows, tokenize_dataset
from .evaluate import evaluate_tau
from .features import FeatureShards, write_meta, write_shard
from .flops import drafter_step_flops, peak_flops, visible_pairs
from .mask import dflash_block_mask
from .metrics import Metrics
from .model import DFlashDrafter, DrafterShape, drafter_config
from .objective import block_attention, drafter_loss
from .optim import MasterWeightAdamW, warmup_cosine
from .sharding import shard_drafter
from .target import FrozenTarget, load_embed_and_head

console = Console(stderr=True)
PROCESS_START = time.perf_counter()  # for time-to-first-step (imports included)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- what both sides need ----------------------------------------------------------------------

def resolve_target(cfg: RunConfig, ctx: parallel.Context) -> RunConfig:
    """The embedded default builds its own target and data under the run directory (rank 0 builds)."""
    if cfg.target.path != "embedded":
        return cfg
    from .tiny import build_embedded

    where = Path(cfg.output_dir) / "embedded"
    if ctx.rank == 0:
        console.print("[bold]embedded default[/]: building the tiny target, tokenizer and data (cached)")
        build_embedded(where)
    ctx.barrier()
    assets = build_embedded(where)  # cached: reads assets.json
    cfg.target.path = assets["target"]
    if not cfg.data.features_dir:
        cfg.data.train, cfg.data.eval = [assets["train"]], [assets["eval"]]
    return cfg


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.target.path)


def mask_token_id(cfg: RunConfig, tokenizer) -> int:
    if cfg.drafter.mask_token_id is not None:
        return cfg.drafter.mask_token_id
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    raise ConfigError("the tokenizer has no mask token: set drafter.mask_token_id to a reserved row of the "
                      "target embedding (Qwen3: 151669)")


def new_drafter(cfg: RunConfig, target_config, tokenizer) -> DFlashDrafter:
    """The initial drafter: the same weights on every rank and in every run with the same seed."""
    d = cfg.drafter
    if d.init_from:
        return DFlashDrafter.from_pretrained(d.init_from)
    dconf = drafter_config(target_config, DrafterShape(
        num_layers=d.num_layers, block_size=d.block_size, mask_token_id=mask_token_id(cfg, tokenizer),
        target_layer_ids=tuple(d.target_layer_ids) if d.target_layer_ids else None,
        intermediate_size=d.intermediate_size,
    ))
    torch.manual_seed(cfg.train.seed)
    return DFlashDrafter(dconf)  # built on the CPU: identical across devices


def load_target(cfg: RunConfig, layer_ids: list[int], device) -> FrozenTarget:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.target.path, dtype=DTYPES[cfg.target.dtype]).to(device)
    return FrozenTarget(model, layer_ids)


def load_data(cfg: RunConfig, tokenizer) -> tuple[MicroBatches, MicroBatches | None, list[list[int]]]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_ds = tokenize_dataset(load_rows(cfg.data.train), tokenizer, cfg.data.max_length, cfg.data.num_proc)
    if cfg.data.eval:
        eval_ds = tokenize_dataset(load_rows(cfg.data.eval), tokenizer, cfg.data.max_length, cfg.data.num_proc)
    else:  # hold out a few samples from the training data
        split = train_ds.train_test_split(test_size=min(len(train_ds) // 10 or 1, 64), seed=cfg.train.seed)
        train_ds, eval_ds = split["train"], split["test"]
    stream = MicroBatches(train_ds, cfg.train.micro_batch, cfg.data.context_buckets, pad, cfg.train.seed)
    eval_stream = MicroBatches(eval_ds, min(cfg.train.micro_batch, len(eval_ds)), cfg.data.context_buckets, pad,
                               cfg.train.seed)
    prompts = [prompt_of(eval_ds[i]) for i in range(min(cfg.eval.prompts, len(eval_ds)))]
    return stream, eval_stream, prompts


def prompt_of(row: dict) -> list[int]:
    """The prompt part of a tokenized row: everything before the first supervised token."""
    return row["input_ids"][: row["loss_mask"].index(1)]


def attention_backend(cfg: RunConfig, device: torch.device) -> str:
    if cfg.train.attention != "auto":
        return cfg.train.attention
    return "flex" if device.type == "cuda" else "sdpa"  # flex_attention has no backward on CPU


def make_mask_builder(block: int):
    """BlockMasks from the anchors by interval arithmetic: eager tensor ops, nothing to compile."""
    return lambda anchors, keep, ctx_len: dflash_block_mask(anchors, keep, block, ctx_len)


def check_dense_fits(cfg: RunConfig, drafter: DFlashDrafter, device: torch.device) -> None:
    """The sdpa backend materialises scores: refuse shapes where that cannot fit (use flex on a GPU)."""
    from .attention import dense_risk

    dc = drafter.config
    q = cfg.train.num_anchors * dc.block_size
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if device.type == "cpu" else None
    risk = dense_risk(cfg.train.micro_batch, dc.num_attention_heads, q, cfg.data.context_buckets[-1] + q,
                      device=device, free_bytes=free)
    if not risk.fits:
        raise ConfigError(f"train.attention = 'sdpa' would materialise dense scores: {risk.explain()}. "
                          "Train with attention = 'flex' on a GPU.")


def warm_drafter(drafter, embed_weight, head_weight, buckets, micro_batch: int, num_anchors: int,
                 gamma, chunk_rows: int, mask_builder, cache_dir: Path, log, label: str = "",
                 compiled_layers: bool = True, serialized: bool = True):
    """The serialized compile step: warm every context bucket (forward + backward) before step 1.

    Ranks take turns through a file lock in the shared cache directory, so the first fills the cache
    and the others hit it; afterwards a recompile is an error and an eager flex_attention call raises.
    The probe runs the bare drafter, not its DDP wrapper: a gradient all-reduce inside the lock
    would wait for ranks that are waiting for the lock.
    """
    from .attention import install_dense_guards
    from .warmup import compile_cache_env, warm_up

    compile_cache_env(cache_dir)
    install_dense_guards()
    dc = drafter.config
    feat_dim = len(drafter.target_layer_ids) * dc.hidden_size
    device = embed_weight.device

    def probe(ctx_len: int) -> None:
        t0 = time.perf_counter()
        ids = torch.randint(dc.vocab_size, (micro_batch, ctx_len), device=device)
        lm = torch.ones(micro_batch, ctx_len, dtype=torch.uint8, device=device)
        feats = torch.randn(micro_batch, ctx_len, feat_dim, device=device, dtype=drafter.fc.weight.dtype)
        anchors, keep = sample_anchors(lm, num_anchors)
        blocks = build_blocks(ids, lm, anchors, keep, dc.block_size, drafter.mask_token_id, gamma)
        attn = block_attention("flex", blocks, ctx_len, dc.block_size, dc, mask_builder)
        t1 = time.perf_counter()
        sums = drafter_loss(drafter, embed_weight, head_weight, feats, blocks, attn, chunk_rows,
                            compiled_layers=compiled_layers)
        t2 = time.perf_counter()
        sums.weighted_ce.backward()
        drafter.zero_grad(set_to_none=True)
        log(f"{label}  bucket {ctx_len}: mask {t1 - t0:.1f}s, forward {t2 - t1:.1f}s, "
            f"backward {time.perf_counter() - t2:.1f}s")

    lock = Path(cache_dir) / "compile.lock" if serialized else None  # FSDP: the forward needs every rank
    return warm_up(probe, list(buckets), lock, log=log, label=label)


# ---- evaluation (where the target is) ---------------------------------------------------------

@torch.no_grad()
def teacher_forced_accuracy(cfg, drafter, target, eval_stream, batches: int = 4) -> list[float]:
    """Per-slot accuracy on held-out data, the training objective's view (no target in the loop)."""
    block, device = drafter.block_size, target.embed_weight.device
    correct = torch.zeros(block, device=device)
    count = torch.zeros(block, device=device)
    g = torch.Generator(device=device).manual_seed(cfg.train.seed + 7)
    for i in range(min(batches, eval_stream.per_epoch)):
        batch = eval_stream.batch(i).to(device)
        feats = target.features(batch.input_ids, batch.attention_mask).to(drafter.fc.weight.dtype)
        anchors, keep = sample_anchors(batch.loss_mask, cfg.train.num_anchors, g)
        blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block, drafter.mask_token_id)
        # The dense reference: no compiled variant is needed for this no-grad pass.
        attn = block_attention("sdpa", blocks, feats.shape[1], block, drafter.config)
        sums = drafter_loss(drafter, target.embed_weight, target.head_weight, feats, blocks, attn)
        correct += sums.slot_correct
        count += sums.slot_count
    return (correct[1:] / count[1:].clamp(min=1)).tolist()


def evaluate(cfg, drafter, target, tokenizer, eval_stream, prompts, label: str) -> dict:
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    spec = evaluate_tau(drafter, target, prompts, cfg.eval.max_new_tokens, stop)
    acc = teacher_forced_accuracy(cfg, drafter, target, eval_stream) if eval_stream is not None else []
    console.print(f"[bold]{label}[/]: {spec.summary()}; per-slot accuracy " + " ".join(f"{a:.2f}" for a in acc))
    return {"tau": spec.tau, "verify_steps": spec.verify_steps, "slot_acceptance": spec.slot_acceptance,
            "slot_accuracy": acc}


def evaluate_saved(cfg, target, tokenizer, eval_stream, prompts, drafter_dir: Path, device) -> tuple[dict, dict]:
    """tau of the initial drafter (same seed, rebuilt) and of the trained one saved in drafter_dir."""
    dtype = DTYPES[cfg.train.dtype]
    initial = new_drafter(cfg, target.config, tokenizer).to(device=device, dtype=dtype)
    before = evaluate(cfg, initial, target, tokenizer, eval_stream, prompts, "before training")
    trained = DFlashDrafter.from_pretrained(drafter_dir).to(device=device, dtype=dtype)
    after = evaluate(cfg, trained, target, tokenizer, eval_stream, prompts, "after training")
    return before, after


# ---- feature sources for the drafter loop -------------------------------------------------------

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


def resume_step(cfg: RunConfig, resume: bool) -> tuple[int, Path | None]:
    latest = ckpt.latest_checkpoint(Path(cfg.output_dir) / "checkpoints") if resume else None
    if latest is None:
        return 0, None
    return int(ckpt.load_train_state(latest)["step"]), latest


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
    mask_builder = make_mask_builder(dc.block_size)
    before = None
    if ctx.colocated and start_step == 0:
        before = evaluate(c, drafter, target, tokenizer, eval_stream, prompts, "before training")
    warmup_report = None
    compiled_layers = backend == "flex" and c.train.compile_layers and shard.compiled_layers
    if backend == "flex":
        cache = Path(c.train.compile_cache_dir or out / "compile-cache")
        t0 = time.perf_counter()
        warmup_report = warm_drafter(drafter, embed, head, c.data.context_buckets, c.train.micro_batch,
                                     c.train.num_anchors, c.drafter.gamma, c.train.loss_chunk_rows, mask_builder,
                                     cache, console.print, label=ctx.label, compiled_layers=compiled_layers,
                                     serialized=shard.serial_warmup)
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
                anchors, keep = sample_anchors(fb.loss_mask, c.train.num_anchors, anchor_generator(c, device, fb.index))
                blocks = build_blocks(fb.input_ids, fb.loss_mask, anchors, keep, dc.block_size,
                                      drafter.mask_token_id, c.drafter.gamma)
                attn = block_attention(backend, blocks, fb.features.shape[1], dc.block_size, dc, mask_builder)
                with shard.gradient_sync(micro == A - 1):  # one gradient reduction per step
                    sums = drafter_loss(drafter, embed, head, fb.features, blocks, attn, c.train.loss_chunk_rows, model,
                                        compiled_layers=compiled_layers)
                    sums.weighted_ce.backward()
                ce_sum += sums.weighted_ce.detach()
                weight_sum += blocks.total_weight
                correct += sums.slot_correct
                count += sums.slot_count
                step_tokens += fb.tokens
                # A device tensor: a float() here would wait for the GPU in the middle of the step.
                step_flops += drafter_step_flops(dc, fb.features.shape[0], fb.features.shape[1], c.train.num_anchors,
                                                 visible_pairs(anchors, keep, dc.block_size), dc.vocab_size)
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


# ---- target ranks --------------------------------------------------------------------------------

def run_target(cfg: RunConfig, ctx: parallel.Context, resume: bool) -> dict | None:
    """Run the frozen target on this rank's micro-batches and send the features to their drafters."""
    from transformers import AutoConfig

    from .transport import FeatureSender

    c, device = cfg, ctx.device
    # A stop request ends a target rank at once: the drafters write the checkpoint, and a send that
    # waits for a drafter that has stopped would otherwise hold this process until the timeout.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    tokenizer = load_tokenizer(c)
    layer_ids = new_drafter(c, AutoConfig.from_pretrained(c.target.path), tokenizer).target_layer_ids
    target = load_target(c, layer_ids, device)
    stream, eval_stream, prompts = load_data(c, tokenizer)
    A, D = c.train.grad_accum, ctx.num_drafters
    num_batches = c.train.steps * A * D
    start_step, _ = resume_step(c, resume)
    sender = FeatureSender(ctx.roles, ctx.rank, ctx.groups, c.parallel.prefetch, start=start_step * A * D)
    busy = send_wait = 0.0
    tokens = 0
    t_start = time.perf_counter()
    for i in ctx.roles.batches_for_target(ctx.roles.target_index(ctx.rank), num_batches, start_step * A * D):
        t0 = time.perf_counter()
        batch = stream.batch(i).to(device)
        feats = target.features(batch.input_ids, batch.attention_mask)
        tokens += int(batch.attention_mask.sum())
        t1 = time.perf_counter()
        sender.send({"features": feats, "input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
                     "attention_mask": batch.attention_mask})
        busy += t1 - t0
        send_wait += time.perf_counter() - t1
    sender.close(num_batches)
    wall = time.perf_counter() - t_start
    console.print(f"{ctx.label}target done: {tokens / max(wall, 1e-9):,.0f} tok/s; target compute {busy:.1f}s, "
                  f"waiting on drafters {send_wait:.1f}s of {wall:.1f}s"
                  + (" (drafters bound the run)" if send_wait > 0.2 * wall else " (target supply bounds the run)"))
    ctx.barrier()  # the lead drafter has written the final drafter and the summary
    if ctx.rank != 0:
        return None
    out = Path(c.output_dir)
    before, after = evaluate_saved(c, target, tokenizer, eval_stream, prompts, out / "drafter", device)
    summary = json.loads((out / "summary.json").read_text())
    summary.update(tau_before=before["tau"], tau_after=after["tau"], slot_accuracy_after=after["slot_accuracy"],
                   target_ranks=ctx.roles.num_targets, target_busy_s=busy, target_wait_s=send_wait)
    write_summary(out, summary)
    print_summary(summary)
    return summary


# ---- offline feature dump ------------------------------------------------------------------------

def dump_features(cfg: RunConfig, root: Path, num_batches: int | None) -> None:
    """Run the target over the training stream once; rank r of W writes micro-batches i = r mod W."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:  # one GPU per process, chosen before the driver reads CUDA_VISIBLE_DEVICES
        from .warmup import isolate_local_gpu

        isolate_local_gpu(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = parallel.Context(1, rank, 0, device, None, None)
    cfg = resolve_target(cfg, ctx) if world == 1 else cfg
    from transformers import AutoConfig

    tokenizer = load_tokenizer(cfg)
    layer_ids = new_drafter(cfg, AutoConfig.from_pretrained(cfg.target.path), tokenizer).target_layer_ids
    target = load_target(cfg, layer_ids, device)
    stream, _, _ = load_data(cfg, tokenizer)
    count = num_batches or stream.per_epoch
    for i in tqdm(range(rank, count, world), desc="dumping features", disable=None if rank == 0 else True):
        batch = stream.batch(i).to(device)
        feats = target.features(batch.input_ids, batch.attention_mask)
        write_shard(root, i, {"features": feats, "input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
                              "attention_mask": batch.attention_mask})
    if rank == 0:
        write_meta(root, cfg.target.path, layer_ids, count, cfg.train.micro_batch)
    console.print(f"rank {rank}: features of {len(range(rank, count, world))} micro-batches in {root}")


# ---- entry points --------------------------------------------------------------------------------

def run(cfg: RunConfig, resume: bool = False) -> dict | None:
    p = cfg.parallel
    ctx = parallel.init(p.target_ranks, p.drafter_ranks, offline=bool(cfg.data.features_dir),
                        isolate_gpus=p.isolate_gpus)
    try:
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
    finally:
        parallel.shutdown(ctx)


def write_summary(out: Path, summary: dict) -> None:
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "summary.json")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_summary(summary: dict) -> None:
    table = Table(title="DFlash training summary", show_header=False)
    fmt = lambda v, f: "n/a" if v is None else format(v, f)
    table.add_row("steps", f"{summary['steps']} ({len(summary['losses'])} in this run)")
    table.add_row("loss", f"{fmt(summary['first_loss'], '.3f')} -> {fmt(summary['final_loss'], '.3f')}")
    table.add_row("tokens/s", fmt(summary["tokens_per_s"], ",.0f"))
    table.add_row("MFU", fmt(summary["mfu"], ".1%") if summary["mfu"] else "n/a (no known GPU peak)")
    table.add_row("time split", ", ".join(f"{k} {v:.1f}s" for k, v in summary["time_split_s"].items()))
    if "tau_before" in summary:
        table.add_row("tau (acceptance length)", f"{summary['tau_before']:.2f} -> {summary['tau_after']:.2f}")
    else:
        table.add_row("tau (acceptance length)", "n/a: no target in this run (offline)")
    table.add_row("drafter (HF dir)", summary["drafter_dir"])
    table.add_row("checkpoints", summary["checkpoints"])
    console.print(table)


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
