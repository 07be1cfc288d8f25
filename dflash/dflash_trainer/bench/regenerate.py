"""Regeneration benchmark: `make bench-regenerate` / `python -m dflash_trainer.regenerate.bench`.

A random-weight target of the preset's shape (or the target of bench assets, --assets DIR from
`python -m dflash_trainer.bench --preset qwen3-8b --make-assets DIR`) answers random prompts of a fixed
length, greedy, every answer exactly --new-tokens long (EOS disabled), side by side in one process:

  hf              the hf engine (length buckets, large batches, static cache; compiled decode on a GPU)
  hf_eager        the same without compiling the decode step (not run unless named in --contenders)
  baseline        the first regeneration path: batches of 32, left-padded, plain `model.generate`
  generate_batch  transformers' continuous batching (`model.generate_batch`)

Each contender first runs one warm-up batch of the same shape (compiles, CUDA graphs, allocator), then
the timed run; it reports generated tokens/s, wall time, warm-up time and peak GPU memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from .. import cli_args
from ..config import ConfigError, given_keys
from ..decoding.buckets import bucket
from ..regenerate.baseline import generate_batched
from ..regenerate.engine_hf import HFEngine
from ..regenerate.sampling import Sampling

CONTENDERS = ("hf", "baseline", "generate_batch", "hf_eager")
DEFAULT = ("hf", "baseline", "generate_batch")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def load_model(args, cfg, device):
    """--assets DIR/target, else the run config's target.path, else a random-weight target of the preset's shape;
    in target.dtype when the config gives it (bfloat16 on a GPU, float32 on the CPU otherwise)."""
    from transformers import Qwen3Config

    from ..infra.dtypes import DTYPES
    from .step import PRESETS, build_target

    dtype_name = cli_args.chosen(cfg, "target.dtype", None)
    dtype = DTYPES[dtype_name] if dtype_name else torch.bfloat16 if device.type == "cuda" else torch.float32
    path = Path(args.assets) / "target" if args.assets else cli_args.chosen(cfg, "target.path", None)
    if path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     trust_remote_code=cfg.target.trust_remote_code).to(device)
    else:
        torch.manual_seed(0)
        model = build_target(Qwen3Config(**PRESETS[args.preset]["target"], tie_word_embeddings=False), device, dtype)
    return model.eval()


def run_hf(model, args, eager: bool = False):
    sampling = Sampling(max_new_tokens=args.new_tokens, ignore_eos=True)
    engine = HFEngine(model, None, sampling, stop_ids=[], batch_size=args.batch_size, log=print,
                      compile=False if (args.no_compile or eager) else None)

    def go(batch):
        out = []
        for rows in engine.batches(batch):
            out += engine.generate([batch[i] for i in rows])
        return out

    return go, {"batch_size": args.batch_size, "compiled": engine.compiled,
                "rows_per_batch": engine.rows_for(bucket(args.prompt_tokens))}


def run_baseline(model, args):
    def go(batch):
        return generate_batched(model, batch, args.new_tokens, pad=0, eos=None, batch_size=args.baseline_batch,
                                min_new_tokens=args.new_tokens)

    return go, {"batch_size": args.baseline_batch}


def run_generate_batch(model, args):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    def go(batch):
        results = model.generate_batch(inputs=batch, generation_config=config)
        return [list(r.generated_tokens) for r in results.values()]

    return go, {}


RUNNERS = {"hf": run_hf, "baseline": run_baseline, "generate_batch": run_generate_batch,
           "hf_eager": lambda model, args: run_hf(model, args, eager=True)}


def measure(name, model, prompts, args, device) -> tuple[dict, list[list[int]]]:
    """One warm-up batch of the timed shape, then the timed run: (figures, answers)."""
    go, info = RUNNERS[name](model, args)
    warm_n = args.batch_size if name.startswith("hf") else args.baseline_batch
    _sync(device)
    t0 = time.perf_counter()
    go(prompts[: min(warm_n, len(prompts))])
    _sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    answers = go(prompts)
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(map(len, answers))
    expected = len(prompts) * args.new_tokens
    result = {"contender": name, **info, "prompts": len(answers), "generated_tokens": tokens,
              "all_answers_full_length": tokens == expected, "seconds": wall,
              "tokens_per_s": tokens / wall, "warmup_s": warmup_s,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    return result, answers


def parser() -> argparse.ArgumentParser:
    from .step import PRESETS

    p = argparse.ArgumentParser(prog="dflash-bench-regenerate", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    p.add_argument("--assets", metavar="DIR", help="use DIR/target (bench --make-assets) instead of a fresh random one")
    p.add_argument("--prompts", type=cli_args.PROMPTS, default=512)
    p.add_argument("--prompt-tokens", type=cli_args.TOKENS, default=256)
    p.add_argument("--new-tokens", type=cli_args.NEW_TOKENS, default=256)
    p.add_argument("--batch-size", type=cli_args.ROWS, default=256, help="hf engine: most prompts per batch")
    p.add_argument("--baseline-batch", type=cli_args.ROWS, default=32, help="baseline: prompts per generate call")
    p.add_argument("--no-compile", action="store_true", help="hf engine: eager decode on the GPU too")
    p.add_argument("--contenders", default=",".join(DEFAULT), help=f"comma-separated, from {CONTENDERS}")
    p.add_argument("--json", help="write the results here")
    cli_args.add_config_flags(p)  # target.path (instead of a random target) and target.dtype
    return p


def run_contenders(contenders: list[str], model, prompts, args, device) -> tuple[list[dict], dict]:
    """Each contender's figures (or its error: one failing must not hide the others'), and its answers."""
    results, answers = [], {}
    for name in contenders:
        print(f"== {name}", flush=True)
        try:
            result, answers[name] = measure(name, model, prompts, args, device)
        except Exception as exc:  # noqa: BLE001 - one contender failing must not hide the others' figures
            result = {"contender": name, "error": f"{exc.__class__.__name__}: {exc}"}
        print(json.dumps(result), flush=True)
        results.append(result)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results, answers


def compare_to_baseline(results: list[dict], answers: dict, prompts: int) -> None:
    """Each result's speedup over the baseline and its share of answers equal to the baseline's."""
    base = next((r for r in results if r["contender"] == "baseline" and "error" not in r), None)
    for r in results:
        if base and "error" not in r:
            r["speedup_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
        if "error" not in r and "baseline" in answers and r["contender"] != "baseline":
            same = sum(a == b for a, b in zip(answers[r["contender"]], answers["baseline"]))
            r["answers_equal_to_baseline"] = same / prompts  # bf16 batching may flip near-tied argmaxes


def checked_args(argv):
    """The parsed flags, the run config and the contenders; p.error (exit 2) on a bad one."""
    p = parser()
    args = p.parse_args(argv)
    try:
        cfg = cli_args.run_config(args, whole_run=False)
    except ConfigError as exc:
        p.error(str(exc))
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        p.error(f"unknown contender(s) {unknown}: choose from {CONTENDERS}")
    return args, cfg, contenders


def main(argv=None) -> int:
    args, cfg, contenders = checked_args(argv)
    if args.print_config:
        cli_args.print_config(cfg)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    own_target = args.assets or "target.path" in given_keys(cfg)
    if device.type == "cpu" and args.preset != "tiny" and not own_target:
        print(f"error: --preset {args.preset} needs a CUDA GPU; use --preset tiny for a CPU smoke run",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = load_model(args, cfg, device)
    load_s = time.perf_counter() - t0
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(vocab, (args.prompts, args.prompt_tokens), generator=g).tolist()
    head = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "preset": args.preset, "assets": args.assets,
            "model_load_s": load_s, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens}
    results, answers = run_contenders(contenders, model, prompts, args, device)
    compare_to_baseline(results, answers, len(prompts))
    report = {**head, "results": results}
    _print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all("error" not in r for r in results) else 1


def _print_table(report: dict) -> None:
    print(f"\n{report['prompts']} prompts x {report['prompt_tokens']} tokens, {report['new_tokens']} new tokens each "
          f"(greedy, EOS disabled) on {report['device']}, torch {report['torch']}, "
          f"transformers {report['transformers']}")
    print(f"{'contender':16s} {'tok/s':>10s} {'x baseline':>10s} {'seconds':>9s} {'warm-up s':>9s} {'peak GiB':>9s}")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['contender']:16s} failed: {r['error'][:200]}")
            continue
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        speed = f"{r['speedup_vs_baseline']:.2f}" if "speedup_vs_baseline" in r else "-"
        print(f"{r['contender']:16s} {r['tokens_per_s']:10,.0f} {speed:>10s} {r['seconds']:9.1f} {r['warmup_s']:9.1f} "
              f"{peak:>9s}")


if __name__ == "__main__":
    sys.exit(main())
