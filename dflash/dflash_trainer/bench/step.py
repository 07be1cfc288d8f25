"""Drafter-step benchmark: `make bench` / `python -m dflash_trainer.bench --preset qwen3-8b`.

Times the full drafter training step (step.DrafterStep, the trainer's own: block inputs, drafter
forward, chunked LM head + CE, backward, fp32-master AdamW) at a fixed shape after the serialized
compile step, and reports step time, context tokens/s, MFU (against the GPU's dense bf16 datasheet
peak, README "Performance") and peak memory. The step is the one dflash-train builds from the same run config
(--config, --set and the flags: drafter.*, train.*, through the trainer's own loading), on a target of the
preset's shape: the preset gives the drafter's layers, block size and mask token where the config leaves them
unset. The JSON records the shape it timed. With --with-target a random-weight target of the preset's shape
produces the features, as in a one-GPU run; without it the features are random (the drafter step alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3Config

from .. import cli_args
from ..config import (
    DRAFTER_KINDS,
    MOMENTS_DTYPE_NAMES,
    TARGET_QUANTIZATIONS,
    ConfigError,
    RunConfig,
    given_keys,
    step_problems,
)
from ..distributed.sources import FeatureBatch, Wait
from ..infra.console import console
from ..infra.dtypes import DTYPES
from ..infra.gpu_clock import ClockSampler
from ..model.anchors import default_gamma, sample_anchors
from ..model.attention import dense_scores_bytes
from ..model.drafter import DFlashDrafter
from ..model.flops import peak_flops
from ..model.mask import dflash_block_mask
from ..model.optim import MOMENTS, MasterWeightAdamW
from ..run.compile_step import compile_drafter_step
from ..run.loading import attention_backend, drafter_config_for, drafter_step, new_drafter, new_optimizer
from ..run.step import DrafterStep, StepClock, phase

PRESETS = {
    # Qwen3-8B and its published drafter (z-lab/Qwen3-8B-DFlash-b16).
    "qwen3-8b": {
        "target": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
        "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 151669},
    },
    # A shape small enough for a CPU smoke run of this script.
    "tiny": {
        "target": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
        "drafter": {"num_layers": 2, "block_size": 8, "mask_token_id": 3},
    },
}


def build_target(cfg: Qwen3Config, device, dtype):
    """A random-weight causal LM of the preset's shape, initialised on the device (fast for 8B)."""
    from transformers import Qwen3ForCausalLM

    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    return model


def make_assets(root: Path, preset: str, seq: int, rows: int) -> None:
    """A random-weight target directory of the preset's shape, a tokenizer and pre-tokenized data.

    For end-to-end benchmarks of the real trainer (torchrun, target ranks, drafter ranks) where no
    real checkpoint can be downloaded. Data rows are random token ids of `seq` tokens with the last
    3/4 supervised, so every micro-batch has the benchmark's shape.
    """
    from transformers import Qwen3ForCausalLM

    from ..embedded import build_tokenizer, read_corpus

    cfg = Qwen3Config(**PRESETS[preset]["target"], tie_word_embeddings=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(root / "target")
    tokenizer = build_tokenizer([m["content"] for c in read_corpus() for m in c])
    tokenizer.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(1)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(rows):
            ids = torch.randint(len(tokenizer), (seq,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (seq // 4) + [1] * (seq - seq // 4)}) + "\n")
    print(f"bench assets in {root}: target ({cfg.num_hidden_layers} layers, random weights), {rows} rows of {seq}")


# The flags that set one run-config key each: --config / --set give the same keys (the defaults are the config's).
KEY_FLAGS = {"--seq": "data.max_length", "--anchors": "train.num_anchors", "--micro-batch": "train.micro_batch",
             "--grad-accum": "train.grad_accum", "--chunk-rows": "train.loss_chunk_rows",
             "--moments-dtype": "train.moments_dtype", "--no-compile-layers": "train.compile_layers",
             "--target-quantization": "target.quantization", "--kind": "drafter.kind"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    cli_args.key_flag(p, "--kind", "drafter.kind", "the drafter kind to time (its settings: --set drafter.*)",
                      choices=DRAFTER_KINDS)
    cli_args.key_flag(p, "--seq", "data.max_length", "context tokens per sequence (S)")
    cli_args.key_flag(p, "--anchors", "train.num_anchors", "blocks per sequence (N)")
    cli_args.key_flag(p, "--micro-batch", "train.micro_batch", "rows per micro-batch")
    cli_args.key_flag(p, "--grad-accum", "train.grad_accum", "micro-batches per optimizer step")
    cli_args.key_flag(p, "--no-compile-layers", "train.compile_layers", "eager layers around the compiled "
                      "flex_attention (A/B against the default)", action="store_const", const=False)
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of the timed steps")
    p.add_argument("--no-memory-probe", action="store_true", help="skip the attention memory probe")
    p.add_argument("--steps", type=cli_args.integer(ge=1, le=100_000), default=10)
    p.add_argument("--untimed-steps", type=cli_args.integer(ge=0, le=100_000), default=2,
                   help="steps run after the compile step, before timing")
    cli_args.key_flag(p, "--chunk-rows", "train.loss_chunk_rows", "token rows per chunk of the LM head + CE")
    cli_args.key_flag(p, "--moments-dtype", "train.moments_dtype", "AdamW's moments: the bf16-moment A/B",
                      choices=MOMENTS_DTYPE_NAMES)
    p.add_argument("--with-target", action="store_true", help="features from a random-weight target")
    p.add_argument("--target-sdpa", choices=["default", "cudnn", "flash"], default="default",
                   help="SDPA kernels the target's forward prefers (--with-target)")
    cli_args.key_flag(p, "--target-quantization", "target.quantization", "the target's decoder GEMMs: bf16, or fp8 "
                      "(FP8-dynamic; --with-target)", choices=TARGET_QUANTIZATIONS)
    p.add_argument("--cache-dir", default="runs/bench/compile-cache")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--make-assets", metavar="DIR", help="write a random target + data for end-to-end runs")
    p.add_argument("--rows", type=cli_args.integer(ge=1, le=1_000_000), default=64, help="data rows for --make-assets")
    p.add_argument("--stack-dump-after", type=cli_args.SECONDS, help="dump every thread's stack after N s (diagnosis)")
    cli_args.add_config_flags(p)
    return p


@dataclass
class Setup:
    """The drafter step at the benchmark's shape, and the random-weight target that feeds it (None: random features)."""

    device: torch.device
    dtype: torch.dtype
    tcfg: Qwen3Config
    dcfg: object
    frozen: object | None
    drafter: DFlashDrafter
    opt: MasterWeightAdamW
    step: DrafterStep
    attention: str


def frozen_target(args, cfg: RunConfig, tcfg: Qwen3Config, dcfg, device, dtype):
    """A random-weight target of the preset's shape behind the trainer's FrozenTarget (--with-target)."""
    from torch.nn.attention import SDPBackend

    from ..target.frozen import FrozenTarget

    backends = {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
                "flash": [SDPBackend.FLASH_ATTENTION]}[args.target_sdpa]
    return FrozenTarget(build_target(tcfg, device, dtype), dcfg.dflash_config["target_layer_ids"],
                        sdpa_backends=backends, quantization=cfg.target.quantization)


def bench_problems(c: RunConfig) -> list[str]:
    """The step's settings refused as dflash-train refuses them; and no saved drafter: the bench times a new one."""
    problems = step_problems(c)
    if c.drafter.init_from:
        problems.append(f"drafter.init_from = {json.dumps(c.drafter.init_from)}: the benchmark times a new drafter "
                        "on the preset's target, not a saved one: unset it (--set drafter.init_from=null) and give that "
                        "drafter's shape instead (--set drafter.num_layers=N --set drafter.block_size=B)")
    return problems


def step_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    """The drafter's dtype: train.dtype where the config gives it; else bf16 on a GPU, and fp32 on a CPU unless bf16
    moments need bf16 parameters (the one-pass update)."""
    low = device.type == "cuda" or cfg.train.moments_dtype != "float32"
    return DTYPES[cli_args.chosen(cfg, "train.dtype", "bfloat16" if low else "float32")]


def preset_config(cfg: RunConfig, preset: str) -> RunConfig:
    """The config the step is built from: the preset's drafter shape (layers, block, mask token) for the keys the
    config file, --set and the flags leave unset, and the preset's target named as the target in errors."""
    given = given_keys(cfg)
    shape = {key: value for key, value in PRESETS[preset]["drafter"].items() if f"drafter.{key}" not in given}
    return dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, **shape),
                               target=dataclasses.replace(cfg.target, path=f"--preset {preset}"))


def setup(args, cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> Setup:
    """The drafter, optimizer and step as dflash-train builds them from `cfg` (preset_config's), on the preset's
    target: random-weight, or random features and embedding."""
    tcfg = Qwen3Config(**PRESETS[args.preset]["target"], tie_word_embeddings=False)
    try:  # the trainer's: the kind's shape, the taps checked against the target
        dcfg = drafter_config_for(cfg, tcfg, tokenizer=None)  # the preset or the config gives the mask token
    except ConfigError as exc:  # a shape the preset's target cannot take (taps past its layers, DFlash 2's group)
        raise ConfigError(f"{exc} (--preset {args.preset}: {tcfg.num_hidden_layers} layers, hidden size "
                          f"{tcfg.hidden_size}, vocabulary {tcfg.vocab_size})") from exc
    torch.manual_seed(0)
    frozen = frozen_target(args, cfg, tcfg, dcfg, device, dtype) if args.with_target else None
    if frozen is not None:
        embed, head = frozen.embed_weight, frozen.head_weight
    else:
        embed = torch.randn(tcfg.vocab_size, tcfg.hidden_size, device=device, dtype=dtype) * 0.02
        head = torch.randn(tcfg.vocab_size, tcfg.hidden_size, device=device, dtype=dtype) * 0.02
    drafter = new_drafter(cfg, tcfg, None, device=device, config=dcfg).to(dtype)
    opt, scheduler = new_optimizer(cfg, drafter)
    attention = attention_backend(cfg, device)
    step = drafter_step(cfg, drafter, embed, head, opt, scheduler, attention)
    return Setup(device, dtype, tcfg, dcfg, frozen, drafter, opt, step, attention)


def feature_batches(s: Setup, ids: torch.Tensor, loss_mask: torch.Tensor):
    """Features from the target (its GPU time measured between two events) or random, endlessly; with the
    target's final hidden states where the loss reads its distribution (train.loss_kl, train.loss_tv)."""
    b, seq = ids.shape
    feat_dim = len(s.drafter.target_layer_ids) * s.dcfg.hidden_size
    with_final = s.step.objective is not None and s.step.objective.needs_target
    while True:
        if s.frozen is not None:
            wait = Wait.interval(s.device)
            final = None
            with phase("target"):
                if with_final:
                    feats, final = s.frozen.features_and_final(ids)
                else:
                    feats = s.frozen.features(ids)
            yield FeatureBatch(feats, ids, loss_mask, b * seq, 0, wait.stop(), final)
        else:
            final = torch.randn(b, seq, s.dcfg.hidden_size, device=s.device, dtype=s.dtype) if with_final else None
            yield FeatureBatch(torch.randn(b, seq, feat_dim, device=s.device, dtype=s.dtype), ids, loss_mask, b * seq,
                               0, Wait(within_step=False), final)


def timed_steps(args, s: Setup, batches, grad_accum: int) -> tuple[list, ClockSampler]:
    """The untimed steps, then the timed ones (profiled with --profile): [(step figures, seconds)], the clock."""
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    profiler = _profiler(s.device) if args.profile else None
    sampler = ClockSampler(s.device)  # the SM clock and power over the timed steps (gpu_clock: why)
    launched = []
    try:
        for it in range(args.untimed_steps + args.steps):
            if it == args.untimed_steps:
                if profiler is not None:
                    profiler.start()
                sampler.start()
                clock = StepClock(s.device)  # as the train loop: no host sync between steps
            done = s.step.run(batches, grad_accum)  # the micro-batches (features, blocks, forward, backward), AdamW
            if it >= args.untimed_steps:
                launched.append((done, clock.lap()))
        figures = [(done.read(), StepClock.seconds(lap)) for done, lap in launched]
    finally:
        sampler.stop()
    if profiler is not None:
        profiler.stop()
        _print_profile(profiler, args.steps)
    return figures, sampler


def bench_result(args, cfg: RunConfig, s: Setup, figures: list, sampler: ClockSampler, compiled) -> dict:
    """The figures of the timed steps; `compiled`: (the compile report or None, its seconds)."""
    report, compile_s = compiled
    b, S, N, A = cfg.train.micro_batch, cfg.data.max_length, cfg.train.num_anchors, cfg.train.grad_accum
    board = sampler.summary()  # the SM clock and power
    print(sampler.describe())
    flops = figures[-1][0].flops
    times = [seconds - f.step_wait_s for f, seconds in figures]  # the drafter's share of each step
    target_s = statistics.mean(f.step_wait_s for f, _ in figures) if s.frozen is not None else None
    step_s = statistics.mean(times)
    peak = peak_flops(s.device)
    states = list(s.opt.opt.state.values())
    return {
        "preset": args.preset, "kind": cfg.drafter.kind, "device": torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "micro_batch": b, "grad_accum": A, "seq": S, "anchors": N,
        # the shape it timed, as the config and the preset gave it
        "drafter_layers": s.dcfg.num_hidden_layers, "block": s.dcfg.block_size,
        "gamma": default_gamma(s.dcfg.block_size) if s.step.gamma is None else s.step.gamma,
        "position_weighting": cfg.train.position_weighting, "target_layer_ids": list(s.drafter.target_layer_ids),
        "intermediate_size": s.dcfg.intermediate_size, "dtype": str(s.dtype).removeprefix("torch."),
        "attention": s.attention, "compiled_layers": s.step.compiled_layers,
        # as the optimizer holds them after the steps, not as asked
        "moments_dtype": sorted({str(st[k].dtype).removeprefix("torch.") for st in states for k in MOMENTS}),
        "optimizer_state_gib": sum(t.numel() * t.element_size() for st in states for t in st.values()) / 2**30,
        "drafter_params_m": s.drafter.num_params() / 1e6,
        "loss": {"ce": cfg.train.loss_ce, "kl": cfg.train.loss_kl, "tv": cfg.train.loss_tv},
        "compile_s": compile_s,
        "compile_cache_hits": report.cache_hits if report else None,
        "compile_cache_misses": report.cache_misses if report else None,
        "drafter_step_ms": 1e3 * step_s,
        "drafter_step_ms_min": 1e3 * min(times),
        "target_ms": 1e3 * target_s if target_s is not None else None,
        "target_quantization": cfg.target.quantization if s.frozen is not None else None,
        "context_tokens_per_s_drafter": A * b * S / step_s,
        "context_tokens_per_s_one_gpu": A * b * S / (step_s + target_s) if target_s is not None else None,
        "model_tflop_per_step": flops / 1e12,
        "achieved_tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if s.device.type == "cuda" else None,
        **(board or {"clock_unavailable": sampler.unavailable}),
        "dense_scores_gib_per_layer": dense_scores_bytes(b, s.dcfg.num_attention_heads, N * s.dcfg.block_size,
                                                         S + N * s.dcfg.block_size) / 2**30,
    }


def run_bench(args, cfg: RunConfig, device: torch.device) -> dict:
    """Build the step at the shape, compile it (flex), time it, and (flex) probe the attention's memory."""
    dtype = step_dtype(cfg, device)
    cfg = preset_config(cfg, args.preset)
    s = setup(args, cfg, device, dtype)
    b, S = cfg.train.micro_batch, cfg.data.max_length
    t0 = time.perf_counter()
    report = None
    if s.attention == "flex":
        report = compile_drafter_step(s.step, [S], b, Path(args.cache_dir), log=print, target=s.frozen)
    compile_s = time.perf_counter() - t0
    ids = torch.randint(s.tcfg.vocab_size, (b, S), device=device)
    loss_mask = torch.ones(b, S, dtype=torch.uint8, device=device)
    figures, sampler = timed_steps(args, s, feature_batches(s, ids, loss_mask), cfg.train.grad_accum)
    result = bench_result(args, cfg, s, figures, sampler, (report, compile_s))
    if s.attention == "flex" and not args.no_memory_probe:
        result.update(attention_memory_probe(s.dcfg, loss_mask, cfg.train.num_anchors))
    return result


def main(argv=None) -> int:
    parsed = cli_args.parse_with_config(parser(), argv, KEY_FLAGS, console, checks=bench_problems)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    if args.stack_dump_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_after, repeat=True)
    if args.make_assets:
        make_assets(Path(args.make_assets), args.preset, cfg.data.max_length, args.rows)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.preset != "tiny":
        print(f"error: --preset {args.preset} needs a CUDA GPU; use --preset tiny for a CPU smoke run",
              file=sys.stderr)
        return 2
    try:
        result = run_bench(args, cfg, device)
    except ConfigError as exc:
        cli_args.say_error(console, str(exc))
        return 2
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def attention_memory_probe(dcfg, loss_mask, num_anchors: int) -> dict:
    """The fused attention's extra memory (forward + backward, one layer's call at the benchmark shape)
    against what the dense path would hold: one fp32 score copy, and the ~3.3 copies the eager math path
    peaks at (measured on an H200). Runs after the timed steps and compiles the standalone
    flex_attention for this shape, so it leaves the fail-on-recompile stance first.
    """
    from ..compile.guard import leave_run_phase
    from ..model.attention import DENSE_PEAK_COPIES, attend

    leave_run_phase()
    device = loss_mask.device
    b, S = loss_mask.shape
    h, d = dcfg.num_attention_heads, dcfg.head_dim
    anchors, keep = sample_anchors(loss_mask, num_anchors)
    mask = dflash_block_mask(anchors, keep, dcfg.block_size, S)
    q_len, kv_len = mask.seq_lengths
    q = torch.randn(b, h, q_len, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, h, kv_len, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, h, kv_len, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    for measure in (False, True):  # the first call compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = attend(q, k, v, mask)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        q.grad = k.grad = v.grad = None
        del out
    dense = dense_scores_bytes(b, h, q_len, kv_len)
    print(f"attention memory probe [{b}, {h}, {q_len} x {kv_len}]: fused forward + backward used "
          f"{peak / 2**20:,.0f} MiB above its inputs (outputs and gradients included); one dense fp32 score "
          f"copy is {dense / 2**30:.1f} GiB and the eager math path peaks near {DENSE_PEAK_COPIES * dense / 2**30:.0f} GiB")
    return {"attention_probe_shape": [b, h, q_len, kv_len], "attention_fused_peak_mib": peak / 2**20,
            "attention_dense_copy_gib": dense / 2**30,
            "attention_dense_eager_peak_gib": DENSE_PEAK_COPIES * dense / 2**30}


def _profiler(device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True)


# Kernel-name patterns -> what they are, for the profile summary.
_KERNEL_KINDS = [
    ("flex attention", ("flex", "triton_tem_fused_flex")),
    ("GEMM", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "mm_", "triton_tem_fused_mm", "triton_tem_fused_addmm")),
    # "lerp": the one-pass AdamW update (optim.ONE_PASS_UPDATE), an Inductor kernel named after its ops
    ("optimizer", ("adam", "foreach", "multi_tensor", "clip", "lerp")),
    ("fused elementwise (Inductor)", ("triton_poi", "triton_red", "triton_per")),
    ("elementwise (eager)", ("elementwise", "vectorized", "reduce_kernel", "copy", "index", "scatter", "gather")),
]


def _print_profile(profiler, steps: int) -> None:
    # Kernels only: CPU-side ops (aten::mm, ...) also carry the device time of the kernels they launch.
    # and so do user annotations such as Optimizer.step#AdamW.step (kernel time counted twice).
    events = [e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and not e.key.startswith("Optimizer.")]
    rows = sorted(((e.key, e.self_device_time_total, e.count) for e in events if e.self_device_time_total > 0),
                  key=lambda r: -r[1])
    total = sum(t for _, t, _ in rows) or 1
    kinds: dict[str, float] = {}
    for name, t, _ in rows:
        low = name.lower()
        kind = next((k for k, pats in _KERNEL_KINDS if any(p in low for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + t
    print(f"GPU time per step by kind ({steps} steps profiled):")
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:32s} {t / steps / 1e3:8.1f} ms  {t / total:6.1%}")
    print("top kernels (ms per step, calls per step):")
    for name, t, n in rows[:25]:
        print(f"  {t / steps / 1e3:8.2f} ms  x{n / steps:5.1f}  {name[:110]}")
    _print_gemm_shapes(profiler, steps)
    _print_idle(profiler, steps)


def _print_gemm_shapes(profiler, steps: int) -> None:
    """GEMM time and rate per shape (from the aten ops' recorded input shapes): which GEMMs lag the rest."""
    rows = []
    for e in profiler.key_averages(group_by_input_shape=True):
        if e.key not in ("aten::mm", "aten::addmm") or e.device_time_total <= 0:
            continue
        # mm(a, b[, out]) or addmm(bias, a, b): the first two 2-D shapes that chain are a and b.
        shapes = list(e.input_shapes)
        pair = next(((a, b) for a, b in itertools.pairwise(shapes) if len(a) == len(b) == 2 and a[1] == b[0]), None)
        if pair is None:
            continue
        (m, k), (_, n) = pair
        rows.append((e.device_time_total / steps / 1e3, e.count / steps, m, k, n,
                     2 * m * k * n * e.count / e.device_time_total / 1e6))
    if not rows:
        return
    print("GEMMs by shape (ms per step, calls per step, [M x K] @ [K x N], TFLOP/s):")
    for ms, calls, m, k, n, rate in sorted(rows, key=lambda r: -r[0])[:20]:
        print(f"  {ms:8.2f} ms  x{calls:5.1f}  [{m} x {k}] @ [{k} x {n}]  {rate:6.0f} TFLOP/s")


def _print_idle(profiler, steps: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        charged, gaps = idle_gaps(json.loads(trace.read_text())["traceEvents"])
    if not gaps:
        return
    print(f"GPU idle {sum(charged.values()) / steps / 1e3:.1f} ms per step ({gaps / steps:.0f} gaps > 5 us), "
          "by phase and the CPU op at the gap's middle:")
    for (where, op), t in sorted(charged.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {t / steps / 1e3:8.2f} ms  {where:10s} {op[:90]}")


def idle_gaps(trace_events: list[dict], min_gap_us: float = 5.0) -> tuple[dict[tuple[str, str], float], int]:
    """Where the GPU waits for the CPU, from a Chrome trace: gaps between GPU work longer than min_gap_us,
    charged to the step phase (a `step/*` range, step.phase) and the innermost CPU op the main thread was in at
    the gap's middle (a sync, a Python-side loop, a slow launch path). Returns ({(phase, op): us}, gaps).
    """
    events = [e for e in trace_events if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step/")]
    if not gpu or not phases:
        return {}, 0
    main_tid = phases[0]["tid"]
    cpu = [e for e in events if e.get("tid") == main_tid and e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
    charged: dict[tuple[str, str], float] = {}
    count, end = 0, gpu[0][1]
    for start, stop in gpu[1:]:
        if start - end > min_gap_us:
            mid = (start + end) / 2
            around = [e for e in cpu if e["ts"] <= mid <= e["ts"] + e["dur"]]
            where = next((e["name"][len("step/"):] for e in around if e["name"].startswith("step/")), "-")
            ops = [e for e in around if e["cat"] != "user_annotation"]
            op = min(ops, key=lambda e: e["dur"])["name"] if ops else "(python)"
            charged[(where, op)] = charged.get((where, op), 0.0) + start - end
            count += 1
        end = max(end, stop)
    return charged, count


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
