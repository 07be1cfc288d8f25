"""Train a DFlash drafter: `python -m dflash_trainer.train --config embedded` (or a TOML file).

Reads top to bottom: config -> target, tokenizer, data -> drafter, optimizer -> compile step ->
tau before -> the loop (target features -> random anchors -> blocks -> drafter loss -> step) ->
checkpoint -> tau after -> summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from . import checkpoint as ckpt
from .anchors import build_blocks, sample_anchors
from .config import ConfigError, RunConfig, load_config
from .data import DataError, MicroBatches, load_rows, tokenize_dataset
from .evaluate import evaluate_tau
from .flops import drafter_step_flops, peak_flops, visible_pairs
from .mask import dflash_block_mask
from .model import DFlashDrafter, DrafterShape, drafter_config
from .objective import block_attention, drafter_loss
from .optim import MasterWeightAdamW, warmup_cosine
from .target import FrozenTarget

console = Console(stderr=True)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Setup:
    cfg: RunConfig
    device: torch.device
    tokenizer: object
    target: FrozenTarget
    drafter: DFlashDrafter
    train: MicroBatches
    eval_prompts: list[list[int]]
    eval_stream: MicroBatches | None
    attention: str


def resolve_target(cfg: RunConfig) -> RunConfig:
    """The embedded default builds its own target and data under the run directory."""
    if cfg.target.path != "embedded":
        return cfg
    from .tiny import build_embedded

    console.print("[bold]embedded default[/]: building the tiny target, tokenizer and data (cached)")
    assets = build_embedded(Path(cfg.output_dir) / "embedded")
    cfg.target.path = assets["target"]
    cfg.data.train, cfg.data.eval = [assets["train"]], [assets["eval"]]
    return cfg


def mask_token_id(cfg: RunConfig, tokenizer) -> int:
    if cfg.drafter.mask_token_id is not None:
        return cfg.drafter.mask_token_id
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    raise ConfigError(
        "the tokenizer has no mask token: set drafter.mask_token_id to a reserved row of the target "
        "embedding (Qwen3: 151669)"
    )


def prompt_of(row: dict) -> list[int]:
    """The prompt part of a tokenized row: everything before the first supervised token."""
    first = row["loss_mask"].index(1)
    return row["input_ids"][:first]


def build(cfg: RunConfig) -> Setup:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = resolve_target(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.target.path, dtype=DTYPES[cfg.target.dtype]).to(device)
    d = cfg.drafter
    dconf = drafter_config(model.config, DrafterShape(
        num_layers=d.num_layers, block_size=d.block_size, mask_token_id=mask_token_id(cfg, tokenizer),
        target_layer_ids=tuple(d.target_layer_ids) if d.target_layer_ids else None,
        intermediate_size=d.intermediate_size,
    ))
    target = FrozenTarget(model, dconf.dflash_config["target_layer_ids"])
    drafter = DFlashDrafter.from_pretrained(d.init_from) if d.init_from else DFlashDrafter(dconf)
    drafter = drafter.to(device=device, dtype=DTYPES[cfg.train.dtype])

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_ds = tokenize_dataset(load_rows(cfg.data.train), tokenizer, cfg.data.max_length, cfg.data.num_proc)
    eval_ds = None
    if cfg.data.eval:
        eval_ds = tokenize_dataset(load_rows(cfg.data.eval), tokenizer, cfg.data.max_length, cfg.data.num_proc)
    else:  # hold out a few samples from the training data
        split = train_ds.train_test_split(test_size=min(len(train_ds) // 10 or 1, 64), seed=cfg.train.seed)
        train_ds, eval_ds = split["train"], split["test"]
    stream = MicroBatches(train_ds, cfg.train.micro_batch, cfg.data.context_buckets, pad, cfg.train.seed)
    eval_stream = (MicroBatches(eval_ds, min(cfg.train.micro_batch, len(eval_ds)), cfg.data.context_buckets,
                                pad, cfg.train.seed) if eval_ds is not None and len(eval_ds) else None)
    prompts = [prompt_of(eval_ds[i]) for i in range(min(cfg.eval.prompts, len(eval_ds)))]
    attention = cfg.train.attention
    if attention == "auto":
        attention = "flex" if device.type == "cuda" else "sdpa"
    return Setup(cfg, device, tokenizer, target, drafter, stream, prompts, eval_stream, attention)


def check_dense_fits(s: Setup) -> None:
    """The sdpa backend materialises scores: refuse shapes where that cannot fit (use flex on a GPU)."""
    from .attention import dense_risk

    c, dc = s.cfg, s.drafter.config
    q = c.train.num_anchors * dc.block_size
    free = None
    if s.device.type == "cpu":  # host memory that is available now
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    risk = dense_risk(c.train.micro_batch, dc.num_attention_heads, q, c.data.context_buckets[-1] + q,
                      device=s.device, free_bytes=free)
    if not risk.fits:
        raise ConfigError(f"train.attention = 'sdpa' would materialise dense scores: {risk.explain()}. "
                          "Train with attention = 'flex' on a GPU.")


def make_mask_builder(block: int):
    """BlockMasks from the anchors by interval arithmetic: eager tensor ops, nothing to compile."""
    return lambda anchors, keep, ctx_len: dflash_block_mask(anchors, keep, block, ctx_len)


def warm_drafter(drafter, embed_weight, head_weight, buckets, micro_batch: int, num_anchors: int,
                 gamma, chunk_rows: int, mask_builder, cache_dir: Path, log):
    """The serialized compile step: warm every context bucket (forward + backward) before step 1.

    Ranks take turns through a file lock in the shared cache directory; afterwards a recompile is
    an error and any eager (dense) flex_attention call raises.
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
        sums = drafter_loss(drafter, embed_weight, head_weight, feats, blocks, attn, chunk_rows)
        t2 = time.perf_counter()
        sums.weighted_ce.backward()
        drafter.zero_grad(set_to_none=True)
        log(f"  bucket {ctx_len}: mask {t1 - t0:.1f}s, forward {t2 - t1:.1f}s, backward {time.perf_counter() - t2:.1f}s")

    return warm_up(probe, list(buckets), Path(cache_dir) / "compile.lock", log=log)


def compile_step(s: Setup, mask_builder, log):
    c = s.cfg
    cache = Path(c.train.compile_cache_dir or Path(c.output_dir) / "compile-cache")
    return warm_drafter(s.drafter, s.target.embed_weight, s.target.head_weight, c.data.context_buckets,
                        c.train.micro_batch, c.train.num_anchors, c.drafter.gamma, c.train.loss_chunk_rows,
                        mask_builder, cache, log)


@torch.no_grad()
def teacher_forced_accuracy(s: Setup, mask_builder, batches: int = 4) -> list[float]:
    """Per-slot accuracy on held-out data, the training objective's view (no target in the loop)."""
    if s.eval_stream is None:
        return []
    c, block = s.cfg, s.drafter.block_size
    correct = torch.zeros(block, device=s.device)
    count = torch.zeros(block, device=s.device)
    g = torch.Generator(device=s.device).manual_seed(c.train.seed + 7)
    for i in range(min(batches, s.eval_stream.per_epoch)):
        batch = s.eval_stream.batch(i).to(s.device)
        feats = s.target.features(batch.input_ids, batch.attention_mask).to(s.drafter.fc.weight.dtype)
        anchors, keep = sample_anchors(batch.loss_mask, c.train.num_anchors, g)
        blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block, s.drafter.mask_token_id)
        # Always the dense reference here: it needs no compiled variant for the no-grad mode.
        attn = block_attention("sdpa", blocks, feats.shape[1], block, s.drafter.config)
        sums = drafter_loss(s.drafter, s.target.embed_weight, s.target.head_weight, feats, blocks, attn)
        correct += sums.slot_correct
        count += sums.slot_count
    return (correct[1:] / count[1:].clamp(min=1)).tolist()


def evaluate(s: Setup, mask_builder, label: str) -> dict:
    stop = {s.tokenizer.eos_token_id} if s.tokenizer.eos_token_id is not None else set()
    spec = evaluate_tau(s.drafter, s.target, s.eval_prompts, s.cfg.eval.max_new_tokens, stop)
    acc = teacher_forced_accuracy(s, mask_builder)
    console.print(f"[bold]{label}[/]: {spec.summary()}; per-slot accuracy "
                  + " ".join(f"{a:.2f}" for a in acc))
    return {"tau": spec.tau, "verify_steps": spec.verify_steps, "slot_acceptance": spec.slot_acceptance,
            "slot_accuracy": acc}


def anchor_generator(s: Setup, index: int) -> torch.Generator:
    """Anchors of micro-batch i are a function of (seed, i): a resumed run draws the same ones."""
    return torch.Generator(device=s.device).manual_seed(s.cfg.train.seed * 1_000_003 + index)


def write_model_fn(drafter: DFlashDrafter):
    return lambda directory: drafter.save_pretrained(directory)


def run(cfg: RunConfig, resume: bool = False) -> dict:
    s = build(cfg)
    c, out = s.cfg, Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c.to_dict(), indent=2))
    dc = s.drafter.config
    console.print(
        f"drafter: {dc.num_hidden_layers} layers, hidden {dc.hidden_size}, block {dc.block_size}, "
        f"target layers {s.drafter.target_layer_ids}, {s.drafter.num_params() / 1e6:.2f}M params; "
        f"{len(s.train.dataset)} training samples; attention {s.attention} on {s.device}"
    )

    opt = MasterWeightAdamW(s.drafter.parameters(), lr=c.train.lr, weight_decay=c.train.weight_decay,
                            max_grad_norm=c.train.max_grad_norm)
    sched = warmup_cosine(opt.opt, c.train.steps, int(c.train.warmup_ratio * c.train.steps), c.train.min_lr_ratio)

    start_step, before = 0, None
    ckpt_root = out / "checkpoints"
    latest = ckpt.latest_checkpoint(ckpt_root) if resume else None
    if resume and latest is None:
        console.print(f"--resume: no checkpoint under {ckpt_root}; starting from step 0")
    if latest is not None:
        state = ckpt.load_train_state(latest)
        s.drafter.load_state_dict(DFlashDrafter.from_pretrained(latest).state_dict())
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        start_step, before = state["step"], state.get("tau_before")
        console.print(f"resumed from {latest} at step {start_step}")

    mask_builder = None
    if s.attention == "flex":
        mask_builder = make_mask_builder(s.drafter.block_size)
    else:
        check_dense_fits(s)
    if before is None:
        before = evaluate(s, mask_builder, "before training")
    if s.attention == "flex":
        compile_step(s, mask_builder, log=console.print)

    writer = _tensorboard(out / "tb")
    peak = peak_flops(s.device)
    losses: list[float] = []
    tokens_total, flops_total, train_time = 0, 0.0, 0.0
    t_target = t_drafter = 0.0
    bar = tqdm(range(start_step, c.train.steps), initial=start_step, total=c.train.steps, desc="train",
               dynamic_ncols=True, disable=None)
    s.drafter.train()
    for step in bar:
        t0 = time.perf_counter()
        ce_sum = torch.zeros((), device=s.device)
        weight_sum = torch.zeros((), device=s.device)
        correct = torch.zeros(dc.block_size, device=s.device)
        count = torch.zeros(dc.block_size, device=s.device)
        step_tokens, step_flops = 0, 0.0
        for micro in range(c.train.grad_accum):
            index = step * c.train.grad_accum + micro
            batch = s.train.batch(index).to(s.device)
            ta = time.perf_counter()
            feats = s.target.features(batch.input_ids, batch.attention_mask).to(s.drafter.fc.weight.dtype)
            _sync(s.device)
            tb = time.perf_counter()
            anchors, keep = sample_anchors(batch.loss_mask, c.train.num_anchors, anchor_generator(s, index))
            blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, dc.block_size,
                                  s.drafter.mask_token_id, c.drafter.gamma)
            attn = block_attention(s.attention, blocks, feats.shape[1], dc.block_size, dc, mask_builder)
            sums = drafter_loss(s.drafter, s.target.embed_weight, s.target.head_weight, feats, blocks, attn,
                                c.train.loss_chunk_rows)
            sums.weighted_ce.backward()
            _sync(s.device)
            t_target += tb - ta
            t_drafter += time.perf_counter() - tb
            ce_sum += sums.weighted_ce.detach()
            weight_sum += blocks.total_weight
            correct += sums.slot_correct
            count += sums.slot_count
            step_tokens += int(batch.attention_mask.sum())
            step_flops += drafter_step_flops(dc, feats.shape[0], feats.shape[1], c.train.num_anchors,
                                             float(visible_pairs(anchors, keep, dc.block_size)), dc.vocab_size)
        # Normalise by the step's total loss weight (every micro-batch), once, on the gradients.
        total = weight_sum.clamp(min=1e-6)
        grad_norm = opt.step(1.0 / total)
        sched.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        loss = float(ce_sum / total)
        losses.append(loss)
        tokens_total += step_tokens
        flops_total += step_flops
        train_time += dt
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step + 1}; lower train.lr or check the data")
        if (step + 1) % c.train.log_every == 0 or step + 1 == c.train.steps:
            acc = (correct[1:] / count[1:].clamp(min=1)).mean().item()
            mfu = step_flops / dt / peak if peak else None
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}", tok_s=f"{step_tokens / dt:,.0f}",
                            **({"mfu": f"{mfu:.1%}"} if mfu else {}))
            if writer:
                for k, v in {"loss": loss, "acc": acc, "grad_norm": float(grad_norm), "lr": sched.get_last_lr()[0],
                             "tokens_per_s": step_tokens / dt, **({"mfu": mfu} if mfu else {})}.items():
                    writer.add_scalar(f"train/{k}", v, step + 1)
        if (step + 1) % c.train.checkpoint_every == 0 or step + 1 == c.train.steps:
            state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": ckpt.rng_state(),
                     "step": step + 1, "data_position": (step + 1) * c.train.grad_accum, "tau_before": before}
            ckpt.save_checkpoint(ckpt_root, step + 1, write_model_fn(s.drafter), state, c.train.keep_last)
    bar.close()

    final_dir = s.drafter.save_pretrained(out / "drafter")
    after = evaluate(s, mask_builder, "after training")
    summary = {
        "steps": c.train.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "tokens_per_s": tokens_total / train_time if train_time else None,
        "mfu": (flops_total / train_time / peak) if peak and train_time else None,
        "time_split_s": {"target": t_target, "drafter": t_drafter},
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if s.device.type == "cuda" else None,
        "tau_before": before["tau"],
        "tau_after": after["tau"],
        "slot_accuracy_after": after["slot_accuracy"],
        "drafter_dir": str(final_dir),
        "checkpoints": str(ckpt_root),
        "losses": losses,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    if writer:
        writer.close()
    return summary


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensorboard(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(directory))


def print_summary(summary: dict) -> None:
    table = Table(title="DFlash training summary", show_header=False)
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    ran = len(summary["losses"])
    table.add_row("steps", f"{summary['steps']} ({ran} in this run)")
    table.add_row("loss", f"{fmt(summary['first_loss'], '.3f')} -> {fmt(summary['final_loss'], '.3f')}")
    table.add_row("tokens/s", fmt(summary["tokens_per_s"], ",.0f"))
    table.add_row("MFU", fmt(summary["mfu"], ".1%") if summary["mfu"] else "n/a (no known GPU peak)")
    table.add_row("tau (acceptance length)", f"{summary['tau_before']:.2f} -> {summary['tau_after']:.2f}")
    table.add_row("drafter (HF dir)", summary["drafter_dir"])
    table.add_row("checkpoints", summary["checkpoints"])
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="embedded", help="a TOML file, or a bundled config name (embedded)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a field")
    p.add_argument("--output-dir", help="where checkpoints, logs and the drafter go (overrides output_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the output dir")
    args = p.parse_args(argv)
    try:
        overrides = list(args.set) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
        cfg = load_config(args.config, overrides)
        run(cfg, resume=args.resume)
    except (ConfigError, DataError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
