"""The jobs a container runs detached: training, regeneration, evaluation, and the recipe chain of the three.

Each job has a directory of its own (the run's output directory, regeneration's --out, the evaluation's
--out) holding what `make deploy` wrote for it (launch.json), what the supervisor records (supervisor.json)
and its log (logs/<job>.log). Any of them holds GPUs, so each one's preflight refuses to start beside
another one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path


@dataclass(frozen=True)
class Job:
    name: str  # train, regenerate, eval: the make targets' prefix and the systemd unit's (dflash-<name>-<run>)
    what: str  # in messages: "training process 123 ..."
    modules: tuple[str, ...]  # on a process's command line (python -m X, torchrun -m X) ...
    scripts: tuple[str, ...]  # ... or as the console script it runs
    dir_flag: str  # the option naming the directory it writes to
    resume_args: tuple[str, ...]  # what a restart adds (regeneration resumes by itself when rerun)
    noun: str  # in the log: "trainer failed (exit 1)"
    again: str  # what starting it again does, said when it stopped
    result: str  # the file it writes once it has done all its work (not when a signal stopped it early)
    marks: tuple[str, ...]  # what only this job leaves in its directory (both training and regeneration write
    #                          summary.json): tells a directory's job where status is asked for another

    def leaves_files_in(self, job_dir: Path) -> bool:
        return bool(self.marks_in(job_dir))

    def marks_in(self, job_dir: Path) -> list[str]:
        """This job's marks that job_dir holds (as they are named: config.json, part-*.jsonl, ...)."""
        return [pattern for pattern in self.marks if next(job_dir.glob(pattern), None) is not None]

    def start_args(self, job_dir: Path) -> tuple[str, ...]:
        """What a start adds to the deployed command line: resume_args once job_dir holds what they resume (the
        trainer's --resume refuses a directory without a run, so the first start of a deployment is a new run)."""
        return self.resume_args if self.resume_args and holds_run(job_dir) else ()

    @property
    def log(self) -> str:
        return f"logs/{self.name}.log"

    def matches(self, argv: list[str]) -> bool:
        """Its module right after a -m (python -m X, torchrun ... -m X), or its console script as the program
        (argv[0], or argv[1] under the python of its shebang). Only those places: an argument such as
        `--run /srv/runs/dflash-train` names a directory, not the job."""
        if any(flag == "-m" and mod in self.modules for flag, mod in pairwise(argv)):
            return True
        programs = argv[:1] + (argv[1:2] if argv and Path(argv[0]).name.startswith("python") else [])
        return any(Path(a).name in self.scripts for a in programs)


# The marks: the trainer's run config, checkpoints and progress line (dflash_trainer.run.run_dir), regeneration's
# manifest and shards (dflash_trainer.regenerate.shards), the evaluation's result and requests (dflash_trainer.eval).
TRAIN = Job("train", "training", ("dflash_trainer.train",), ("dflash-train",), "--output-dir", ("--resume",),
            "trainer", "`make train` resumes from the last checkpoint", "summary.json",
            ("config.json", "checkpoints", "progress.txt"))
REGENERATE = Job("regenerate", "regeneration", ("dflash_trainer.regenerate",), ("dflash-regenerate",), "--out", (),
                 "regeneration", "`make regenerate` answers the rest (the shards written are kept)", "summary.json",
                 ("regenerate.json", "part-*.jsonl"))
EVAL = Job("eval", "evaluation", ("dflash_trainer.eval",), ("dflash-eval",), "--out", (),
           "evaluation", "`make eval` evaluates again", "eval.json", ("eval.json", "requests.jsonl"))
# The recipe chain (recipe.py): regenerate -> train -> eval, each stage one of the jobs above in a subdirectory of
# the chain's. No process of its own to find (it is dflash-run itself), so no module or script names it.
RECIPE = Job("recipe", "recipe chain", (), (), "--run-dir", (), "recipe chain",
             "`make recipe` continues from the stage it stopped at", "eval/eval.json", ("recipe.json",))
JOBS = {job.name: job for job in (TRAIN, REGENERATE, EVAL, RECIPE)}


# What a training run leaves in its directory (dflash_trainer.run.run_dir.RUN_MARKS): --resume continues it.
RUN_FILES = ("config.json", "summary.json", "drafter")
STEP_DIR = re.compile(r"^step-(\d{8,})$")  # dflash_trainer.run.checkpoint's step directories
# What a training run writes in its directory, and --overwrite removes (dflash_trainer.run.run_dir takes it from
# here). Not a run's: embedded/ and compile-cache/ (caches), launch.json and run.toml (the deployment's), and
# supervisor.json and logs/ (the supervisor's).
RUN_OUTPUTS = ("config.json", "summary.json", "eval_prompts.jsonl", "drafter", "checkpoints", "tb", "progress.txt")
# What a run moved aside takes with it besides those: the tracker runs it logged to (dflash_trainer.infra.metrics),
# so `dflash-eval --run` of the kept run adds to them, and its log.
RUN_RECORDS = ("trackers.json", TRAIN.log)


def holds_run(run_dir: Path) -> bool:
    """run_dir holds a training run to resume: its config, summary or drafter, or a step directory under
    checkpoints/ (as the trainer's run_dir.prepare counts them)."""
    checkpoints = run_dir / "checkpoints"
    return (any((run_dir / name).exists() for name in RUN_FILES)
            or (checkpoints.is_dir() and any(e.is_dir() and not e.is_symlink() and STEP_DIR.match(e.name)
                                             for e in checkpoints.iterdir())))


def other_job_problem(job_dir: Path, job: Job) -> str | None:
    """What is wrong with writing `job`'s output into job_dir, when it holds another job's (by the other's marks):
    one job's files would mix with (and, for summary.json, replace) another's. None when it holds none."""
    if not job_dir.is_dir():
        return None
    for other in JOBS.values():
        if other is not job and (found := other.marks_in(job_dir)):
            return (f"{job_dir} holds the output of a {other.what} job ({', '.join(found)}), not of a {job.what} job: "
                    f"give {job.dir_flag} a directory of its own (a new one), so neither overwrites the other")
    return None


def job_of(argv: list[str]) -> Job | None:
    return next((job for job in JOBS.values() if job.matches(argv)), None)


def finished_run(run_dir: Path) -> bool:
    """run_dir holds a training run that wrote its summary and that no later start continued past the summary's
    steps (as the trainer's run_dir._finished decides; a damaged summary counts as written): what a start with
    nothing left to train finds, and leaves as it is."""
    try:
        steps = json.loads((run_dir / "summary.json").read_text()).get("steps")
    except FileNotFoundError:
        return False
    except (OSError, ValueError, AttributeError):
        return True
    checkpoints = run_dir / "checkpoints"
    done = [int(m.group(1)) for e in (checkpoints.iterdir() if checkpoints.is_dir() else ())
            if (m := STEP_DIR.match(e.name)) and e.is_dir() and not e.is_symlink()]
    return not isinstance(steps, int) or not done or max(done) <= steps


def replaced_dir(run_dir: Path) -> Path:
    """Where the run in run_dir is kept when a new run replaces it there: a directory beside it named after it and
    this moment (UTC), one that is not there yet."""
    run_dir = run_dir.absolute()
    base = f"{run_dir.name}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    kept, n = run_dir.with_name(base), 1
    while kept.exists():
        n += 1
        kept = run_dir.with_name(f"{base}.{n}")
    return kept


def move_run_aside(run_dir: Path, kept: Path) -> list[str]:
    """Move the training run in run_dir (RUN_OUTPUTS and RUN_RECORDS) into kept, a new directory beside it, so that the
    next start there is a new run and the previous one stays whole: `dflash-eval --run KEPT` evaluates it, `--resume
    --output-dir KEPT` trains it further (a run stores its paths relative to its directory). Renames only, so nothing
    is copied; OSError (with nothing moved, the entries moved before the failure are moved back) where a rename fails,
    e.g. run_dir is a mount point of its own. Returns the names moved."""
    names = [name for name in (*RUN_OUTPUTS, *RUN_RECORDS) if os.path.lexists(run_dir / name)]
    kept.mkdir(parents=True)
    moved: list[str] = []
    try:
        for name in names:
            (kept / name).parent.mkdir(parents=True, exist_ok=True)
            os.rename(run_dir / name, kept / name)
            moved.append(name)
    except OSError:
        for name in reversed(moved):
            os.rename(kept / name, run_dir / name)
        with contextlib.suppress(OSError):  # only the empty directories this made are left
            for sub in [*sorted(kept.rglob("*"), reverse=True), kept]:
                sub.rmdir()
        raise
    return moved
