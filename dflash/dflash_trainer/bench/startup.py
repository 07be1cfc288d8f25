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
from ..infra import storage
from .step import PRESETS


def train_args(preset: str, assets: Path, seq: int, anchors: int) -> list[str]:
    """The bundled benchmark config, pointed at the assets and shaped like the preset."""
    drafter = PRESETS[preset]["drafter"]
    sets = {"target.path": str(assets / "target"), "data.train": json.dumps([str(assets / "train.jsonl")]),
            "data.max_length": seq, "data.context_buckets": f"[{seq}]", "train.num_anchors": anchors,
            **{f"drafter.{k}": v for k, v in drafter.items()}}
    return ["--config", "bench-qwen3-8b", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


def run(cmd: list[str], log: Path, what: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise SystemExit(f"error: {what} failed (exit {done.returncode}); the end of {log}:\n{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dflash-bench-startup", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    p.add_argument("--seq", type=cli_args.for_key("data.max_length"), default=3072,
                   help="context tokens per sequence (S)")
    p.add_argument("--anchors", type=cli_args.for_key("train.num_anchors"), default=512,
                   help="blocks per sequence (N)")
    p.add_argument("--drafter-ranks", type=cli_args.for_key("parallel.drafter_ranks"), default=1,
                   help="drafter processes (one per GPU)")
    p.add_argument("--starts", type=cli_args.integer(ge=1, le=100), default=3,
                   help="starts on one cache: the first cold, the rest warm")
    p.add_argument("--work", default="runs/bench-startup", help="assets, features, compile cache and runs")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    work = Path(args.work).absolute()
    try:
        storage.check_can_create(work, "--work")
    except (ValueError, storage.StorageError) as exc:
        p.error(str(exc))
    if args.json:
        try:
            storage.check_can_create(Path(args.json).absolute().parent, "--json")
        except (ValueError, storage.StorageError) as exc:
            p.error(str(exc))
    work.mkdir(parents=True, exist_ok=True)
    # One folder per shape: a rerun with another preset, length or rank count never times the old one.
    shape = work / f"{args.preset}-s{args.seq}-n{args.anchors}-d{args.drafter_ranks}"
    assets, features, cache = shape / "assets", shape / "features", shape / "compile-cache"
    py = sys.executable
    if not (assets / "train.jsonl").is_file():
        shape.mkdir(exist_ok=True)
        run([py, "-m", "dflash_trainer.bench", "--preset", args.preset, "--make-assets", str(assets),
             "--seq", str(args.seq), "--rows", str(4 * args.drafter_ranks)], work / "assets.log", "making the assets")
    base = train_args(args.preset, assets, args.seq, args.anchors)
    if not (features / "meta.json").is_file():  # written last: a dump that was killed is made again
        shutil.rmtree(features, ignore_errors=True)
        run([py, "-m", "dflash_trainer.train", *base, "--dump-features", str(features), "--dump-batches",
             str(2 * args.drafter_ranks), "--output-dir", str(shape / "dump"), "--overwrite"],
            work / "dump.log", "dumping the features")
    shutil.rmtree(cache, ignore_errors=True)  # the first start is cold
    starts = []
    for i in range(args.starts):
        out = shape / f"start-{i}"
        run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.drafter_ranks),
             "-m", "dflash_trainer.train", *base, "--set", f"data.features_dir={features}", "--target-gpus", "0",
             "--drafter-gpus", str(args.drafter_ranks), "--set", "train.steps=1", "--set",
             f"train.compile_cache_dir={cache}", "--output-dir", str(out), "--overwrite"],
            work / f"start-{i}.log", f"start {i}")
        summary = json.loads((out / "summary.json").read_text())
        starts.append({"cache": "cold" if i == 0 else "warm", "time_to_first_step_s": summary["time_to_first_step_s"],
                       "startup_s": summary["startup_s"], "compile_cache_hits": summary["compile_cache_hits"]})
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in summary["startup_s"].items())
        print(f"start {i} ({starts[-1]['cache']} cache): time to first step {summary['time_to_first_step_s']:.1f}s: "
              f"{phases}", flush=True)
    result = {"preset": args.preset, "drafter_ranks": args.drafter_ranks, "seq": args.seq, "anchors": args.anchors,
              "starts": starts}
    if args.json:
        storage.write_text_atomic(Path(args.json).absolute(), json.dumps(result, indent=2) + "\n")
    warm = [s["time_to_first_step_s"] for s in starts[1:]]
    print(f"time to first step, {args.drafter_ranks} drafter rank(s): {starts[0]['time_to_first_step_s']:.1f}s cold"
          + (f", {min(warm):.1f}-{max(warm):.1f}s warm" if warm else ""))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
