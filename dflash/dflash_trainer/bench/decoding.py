"""`dflash-eval --bench`: what one decoding step costs, at a model shape with random weights.

    dflash-eval --bench [--preset qwen3-8b] [--batch-size 8] [--max-new-tokens 128]

A random target of the preset's shape (bench/step.py's presets: Qwen3-8B and its published drafter's shape) and
a random drafter decode random prompts with the loops dflash-eval and the trainer's evaluation run
(decoding/fast.py), at batch 1 and at --batch-size: target-only tokens/s and step time, the speculative step
time (drafter block + target verify + acceptance), their ratio, and the speedup a drafter of tau 4 would give
(tau x target-only step / speculative step). A random drafter accepts almost nothing (tau about 1), so the
measured speculative tokens/s is the loop's cost, not a drafter's speedup. At batch 1 the reference loops
(decoding/speculative.py, eager, step by step) are timed too, on fewer tokens, for comparison.
"""

from __future__ import annotations

import json
import time

import torch

from ..decoding.fast import FastDecoding
from ..decoding.speculative import greedy_generate, speculative_generate
from ..target.frozen import FrozenTarget

REFERENCE_TOKENS = 32  # the eager reference loops are slow at 8B: a short run shows their rate
PROMPT_TOKENS = 128
PROJECTED_TAU = 4.0


def build_models(preset: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config

    from ..model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from .step import PRESETS, build_target

    torch.manual_seed(0)
    model = build_target(Qwen3Config(**PRESETS[preset]["target"], tie_word_embeddings=False), device, dtype).eval()
    config = drafter_config(model.config, DrafterShape(**PRESETS[preset]["drafter"]))
    with torch.device(device):
        drafter = DFlashDrafter(config).to(dtype).eval()
    return FrozenTarget(model, drafter.target_layer_ids, compile_layers=False), drafter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall(device: torch.device, fn, *args):
    _sync(device)
    started = time.perf_counter()
    out = fn(*args)
    _sync(device)
    return out, time.perf_counter() - started


def measure_batch(target, drafter, prompts: list[list[int]], batch: int, new_tokens: int, device) -> dict:
    """Both fast loops over `prompts` in batches of `batch`, after one untimed batch (recording the steps)."""
    loops = FastDecoding(target, drafter, batch, log=print)
    loops.greedy(prompts[:batch], new_tokens)
    loops.speculative(prompts[:batch], new_tokens)
    greedy, greedy_s = _wall(device, loops.greedy, prompts, new_tokens)
    spec, spec_s = _wall(device, loops.speculative, prompts, new_tokens)
    batches = len(prompts) // batch
    target_tokens = sum(len(g) - len(p) for g, p in zip(greedy, prompts, strict=True))
    spec_tokens = sum(len(r.tokens) - len(p) for r, p in zip(spec, prompts, strict=True))
    spec_steps = sum(max(len(r.accept_lengths) for r in spec[i : i + batch]) for i in range(0, len(spec), batch))
    target_step = greedy_s / (batches * new_tokens)  # the prefill counted in: an upper bound
    verify_step = spec_s / spec_steps
    lengths = [n for r in spec for n in r.accept_lengths]
    return {"batch_size": batch, "prompts": len(prompts), "target_only_tokens_per_s": target_tokens / greedy_s,
            "target_only_step_ms": 1e3 * target_step, "speculative_tokens_per_s": spec_tokens / spec_s,
            "verify_step_ms": 1e3 * verify_step, "verify_over_target_step": verify_step / target_step,
            "tau": sum(lengths) / len(lengths), "speedup": (spec_tokens / spec_s) / (target_tokens / greedy_s),
            f"speedup_at_tau_{PROJECTED_TAU:g}": PROJECTED_TAU * target_step / verify_step,
            "outputs_equal": sum(r.tokens == g for r, g in zip(spec, greedy, strict=True))}


def measure_reference(target, drafter, prompt: list[int], device) -> dict:
    """The eager reference loops on one prompt: what dflash-eval ran before the fast loops."""
    spec, spec_s = _wall(device, speculative_generate, drafter, target, prompt, REFERENCE_TOKENS)
    greedy, greedy_s = _wall(device, greedy_generate, target, prompt, REFERENCE_TOKENS)
    return {"new_tokens": REFERENCE_TOKENS, "target_only_tokens_per_s": (len(greedy) - len(prompt)) / greedy_s,
            "speculative_tokens_per_s": (len(spec.tokens) - len(prompt)) / spec_s,
            "verify_step_ms": 1e3 * spec_s / len(spec.accept_lengths)}


def run(preset: str, batch_size: int, new_tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
    target, drafter = build_models(preset, device, dtype)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "preset": preset, "dtype": str(dtype).removeprefix("torch."), "prompt_tokens": PROMPT_TOKENS,
              "new_tokens": new_tokens, "block_size": drafter.block_size, "results": []}
    for batch in sorted({1, batch_size}):
        prompts = torch.randint(vocab, (2 * batch, PROMPT_TOKENS), generator=g).tolist()
        report["results"].append(measure_batch(target, drafter, prompts, batch, new_tokens, device))
    with torch.inference_mode():
        report["reference_loops_batch_1"] = measure_reference(target, drafter, prompts[0], device)
    return report


def print_report(report: dict) -> None:
    print(f"{report['preset']} shape, random weights, {report['dtype']} on {report['device']} (torch "
          f"{report['torch']}, transformers {report['transformers']}); prompts of {report['prompt_tokens']} tokens, "
          f"{report['new_tokens']} new tokens each, block {report['block_size']}")
    print(f"{'batch':>5s} {'target tok/s':>12s} {'target step ms':>14s} {'verify step ms':>14s} {'ratio':>6s} "
          f"{'tau':>5s} {'speedup':>7s} {'at tau 4':>8s}")
    for r in report["results"]:
        print(f"{r['batch_size']:5d} {r['target_only_tokens_per_s']:12.1f} {r['target_only_step_ms']:14.2f} "
              f"{r['verify_step_ms']:14.2f} {r['verify_over_target_step']:6.2f} {r['tau']:5.2f} {r['speedup']:7.2f} "
              f"{r[f'speedup_at_tau_{PROJECTED_TAU:g}']:8.2f}")
    ref = report["reference_loops_batch_1"]
    print(f"reference loops (eager, batch 1, {ref['new_tokens']} tokens): target-only {ref['target_only_tokens_per_s']:.1f}"
          f" tok/s, speculative {ref['speculative_tokens_per_s']:.1f} tok/s, verify step {ref['verify_step_ms']:.2f} ms")
    print(json.dumps(report))


def main(preset: str, batch_size: int, new_tokens: int, device: torch.device, dtype: torch.dtype) -> int:
    from .step import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"--preset {preset}: choose one of {', '.join(sorted(PRESETS))}")
    if device.type == "cpu" and preset != "tiny":
        raise ValueError(f"--preset {preset} needs a CUDA GPU; use --preset tiny for a CPU run")
    print_report(run(preset, batch_size, new_tokens, device, dtype))
    return 0
