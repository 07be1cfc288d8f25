"""Time-to-first-step benchmark: `make bench-startup` / `python -m dflash_trainer.bench_startup`.

Starts the real trainer as users do (torchrun, offline drafter ranks reading dumped features, so no
target rank's load is in the figure) several times on one compile cache: the first start finds the
cache empty (cold), the later ones warm. Prints each start's phases as the run itself measured them
(summary.json's `startup_s`: imports, process group, drafter, embedding + head, compile step, step 1).
Assets (a random-weight target of the preset's shape and token rows) and the dumped features are made
once in --work and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .. import cli_args
from ..config import ConfigError
from ..infra import storage
from .step import PRESETS


def train_args(preset: str, assets: Path, seq: int, anchors: int, config: str = "bench-qwen3-8b",
               sets: list[str] = ()) -> list[str]:
    """The benchmark's config (bundled, or --config) and its --set, pointed at the assets and shaped like the
    preset."""
    drafter = PRESETS[preset]["drafter"]
    shape = {"target.path": str(assets / "target"), "data.train": json.dumps([str(assets / "train.jsonl")]),
             "data.max_length": seq, "data.context_buckets": f"[{seq}]", "train.num_anchors": anchors,
             **{f"drafter.{k}": v for k, v in drafter.items()}}
    overrides = [*sets, *(f"{k}={v}" for k, v in shape.items())]
    return ["--config", config, *[a for text in overrides for a in ("--set", text)]]


def run(cmd: list[str], log: Path, what: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise SystemExit(f"error: {what} failed (exit {done.returncode}); the end of {log}:\n{tail}")


# The flags that set one run-config key each: --config / --set give the same keys.
KEY_FLAGS = {"--seq": "data.max_length", "--anchors": "train.num_anchors", "--drafter-ranks": "parallel.drafter_ranks"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench-startup", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    cli_args.key_flag(p, "--seq", "data.max_length", "context tokens per sequence (S)")
    cli_args.key_flag(p, "--anchors", "train.num_anchors", "blocks per sequence (N)")
    cli_args.key_flag(p, "--drafter-ranks", "parallel.drafter_ranks", "drafter processes (one per GPU)")
    p.add_argument("--starts", type=cli_args.integer(ge=1, le=100), default=3,
                   help="starts on one cache: the first cold, the rest warm")
    p.add_argument("--work", default="runs/bench-startup", help="assets, features, compile cache and runs")
    p.add_argument("--json", help="write the result here")
    cli_args.add_config_flags(p, default="bench-qwen3-8b")
    return p


def check_outputs(p: argparse.ArgumentParser, args) -> Path:
    """--work and --json can be written (p.error otherwise, exit 2, nothing made); --work, absolute."""
    work = Path(args.work).absolute()
    try:
        storage.check_can_create(work, "--work")
        if args.json:
            storage.check_can_create(Path(args.json).absolute().parent, "--json")
    except (ValueError, storage.StorageError) as exc:
        p.error(str(exc))
    return work


def prepare(args, cfg, work: Path, shape: Path, base: list[str]) -> Path:
    """The assets and the dumped features of this shape, made once (a dump that was killed is made again)."""
    assets, features = shape / "assets", shape / "features"
    ranks = cfg.parallel.drafter_ranks
    if not (assets / "train.jsonl").is_file():
        shape.mkdir(exist_ok=True)
        run([sys.executable, "-m", "dflash_trainer.bench", "--preset", args.preset, "--make-assets", str(assets),
             "--seq", str(cfg.data.max_length), "--rows", str(4 * ranks)], work / "assets.log", "making the assets")
    if not (features / "meta.json").is_file():  # written last
        shutil.rmtree(features, ignore_errors=True)
        run([sys.executable, "-m", "dflash_trainer.train", *base, "--dump-features", str(features), "--dump-batches",
             str(2 * ranks), "--output-dir", str(shape / "dump"), "--overwrite"], work / "dump.log",
            "dumping the features")
    return features


def start(i: int, ranks: int, work: Path, shape: Path, base: list[str], features: Path) -> dict:
    """Start i of the trainer on the shape's compile cache: its time to the first step and phases."""
    out, cache = shape / f"start-{i}", shape / "compile-cache"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "-m", "dflash_trainer.train", *base, "--set", f"data.features_dir={features}", "--target-gpus", "0",
         "--drafter-gpus", str(ranks), "--set", "train.steps=1", "--set",
         f"train.compile_cache_dir={cache}", "--output-dir", str(out), "--overwrite"],
        work / f"start-{i}.log", f"start {i}")
    summary = json.loads((out / "summary.json").read_text())
    one = {"cache": "cold" if i == 0 else "warm", "time_to_first_step_s": summary["time_to_first_step_s"],
           "startup_s": summary["startup_s"], "compile_cache_hits": summary["compile_cache_hits"]}
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in summary["startup_s"].items())
    print(f"start {i} ({one['cache']} cache): time to first step {summary['time_to_first_step_s']:.1f}s: {phases}",
          flush=True)
    return one


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        cfg = cli_args.run_config(args, KEY_FLAGS, whole_run=False)
    except ConfigError as exc:
        p.error(str(exc))
    if args.print_config:
        cli_args.print_config(cfg)
        return 0
    seq, anchors, ranks = cfg.data.max_length, cfg.train.num_anchors, cfg.parallel.drafter_ranks
    work = check_outputs(p, args)
    work.mkdir(parents=True, exist_ok=True)
    # One folder per shape: a rerun with another preset, length or rank count never times the old one.
    shape = work / f"{args.preset}-s{seq}-n{anchors}-d{ranks}"
    base = train_args(args.preset, shape / "assets", seq, anchors, args.config, args.set)
    features = prepare(args, cfg, work, shape, base)
    shutil.rmtree(shape / "compile-cache", ignore_errors=True)  # the first start is cold
    starts = [start(i, ranks, work, shape, base, features) for i in range(args.starts)]
    result = {"preset": args.preset, "drafter_ranks": ranks, "seq": seq, "anchors": anchors, "starts": starts}
    if args.json:
        storage.write_text_atomic(Path(args.json).absolute(), json.dumps(result, indent=2) + "\n")
    warm = [s["time_to_first_step_s"] for s in starts[1:]]
    print(f"time to first step, {ranks} drafter rank(s): {starts[0]['time_to_first_step_s']:.1f}s cold"
          + (f", {min(warm):.1f}-{max(warm):.1f}s warm" if warm else ""))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
