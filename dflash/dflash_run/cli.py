"""dflash-run {preflight,run,start,stop,status,logs,recipe} --run-dir DIR [--job train|regenerate|eval|recipe] ...

(python -m dflash_run is the same; see the package docstring.)
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shlex
import sys
import time
from pathlib import Path

from . import preflight, recipe, status, supervise
from .jobs import JOBS, RECIPE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dflash-run", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", type=run_dir_path, required=True,
                        help="the job's directory: the run's output directory, regeneration's or evaluation's --out")
    common.add_argument("--job", choices=list(JOBS), default="train", help="which job (default: train)")
    common.add_argument("--unit", help="the systemd unit of the job (production), if any")
    pf = sub.add_parser("preflight", parents=[common], help="check before starting; exit 1 with the problems")
    pf.add_argument("--cache-dir", type=Path, required=True)
    pf.add_argument("--gpus", type=int, default=0, help="GPUs the run needs (0: a CPU run)")
    pf.add_argument("--min-free-gb", type=float, default=20)
    pf.add_argument("--max-used-mib", type=int, default=500, help="memory in use above which a GPU is busy")
    pf.add_argument("--require-mount", action="store_true", help="the run dir must be outside the root fs")
    pf.add_argument("--require-launch", action="store_true", help="the job's launch.json must be there (deployed)")
    pf.add_argument("--config", type=Path, help="the rendered run config, loaded by the trainer's own loader")
    pf.add_argument("--stop-hint", default="make {job}-stop", help="how to stop a job; {job} stands for its name")
    pf.add_argument("--json", action="store_true")
    r = sub.add_parser("run", parents=[common], help="run the job in the foreground (systemd's ExecStart)")
    r.add_argument("--restart", action="store_true", help="restart after failures itself (no systemd)")
    sub.add_parser("start", parents=[common], help="start the detached process supervisor (no systemd)")
    sp = sub.add_parser("stop", parents=[common], help="graceful stop")
    sp.add_argument("--timeout", type=float, default=600)
    st = sub.add_parser("status", parents=[common], help="the job's state, progress (checkpoint, the last progress "
                        "line) and last log lines")
    st.add_argument("--json", action="store_true")
    lg = sub.add_parser("logs", parents=[common], help="the job's log (the supervisor's log file)")
    lg.add_argument("-n", "--lines", type=int, default=50)
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    rc = sub.add_parser("recipe", parents=[common], help="plan and start the recipe chain (regenerate -> train -> "
                        "eval) detached; again: continue where it stopped")
    rc.add_argument("--config", help="the run config (name or TOML; default: embedded)")
    rc.add_argument("--target", help="the target model's directory (default: embedded, built by the chain)")
    rc.add_argument("--data", nargs="+", help="the prompts regeneration answers (default: the bundled chats)")
    rc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a run config override")
    rc.add_argument("--args", action="append", default=[], metavar="STAGE=ARGS",
                    help="more arguments for one stage (target, regenerate, train, eval), e.g. "
                    "regenerate='--max-new-tokens 512'")
    rc.add_argument("--nproc", type=int, help="processes (GPUs) for regeneration and training (default: 1)")
    rc.add_argument("--job-dir", action="append", default=[], metavar="STAGE=DIR",
                    help="in a container: the deployed job (regenerate, train, eval) whose launch.json is that stage "
                    "(make recipe INVENTORY=... gives each); instead of --config, --target, --data, ...")
    rc.add_argument("--foreground", action="store_true", help="run the chain here, not detached")
    rc.add_argument("--plan-only", action="store_true", help="write the plan and say what will run; start nothing "
                    "(systemd starts the chain's unit then)")
    return ap.parse_args(argv)


def run_dir_path(text: str) -> Path:
    """--run-dir: a directory, or a path where one can be made (deploy makes it); a file is refused, exit 2."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a job's directory: give the run's output directory "
                                         "(regeneration's or evaluation's --out)")
    return path


def _stdout_closed() -> bool:
    """stdout is a pipe whose reader is gone (poll says POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    """The command, ended as every command of the trainer is (dflash_trainer/infra/entry.py): Ctrl-C (`logs -f`)
    in one line, exit 130; a reader that stops reading stdout (`status | head -1`) quietly, exit 0 (stdout pointed
    at /dev/null, as the Python docs advise for SIGPIPE)."""
    try:
        code = _command(argv)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("dflash-run: stopped by SIGINT", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _command(argv: list[str] | None) -> int:
    a = parse_args(argv)
    job = JOBS[a.job]

    if a.cmd == "preflight":
        problems = preflight.run_all(a.run_dir, a.cache_dir, a.gpus, a.min_free_gb, a.max_used_mib,
                                     a.require_mount, a.config, a.stop_hint, job if a.require_launch else None)
        if a.json:
            print(json.dumps([p.__dict__ for p in problems]))
        elif problems:
            print(f"preflight: {len(problems)} problem(s), nothing was started:\n" + "\n".join(map(str, problems)))
        else:
            print(f"preflight: ok ({a.run_dir})")
        return 1 if problems else 0
    if a.cmd == "recipe" or (job is RECIPE and a.cmd in ("status", "start", "run")):
        return recipe_command(a)
    if a.cmd == "run":
        return supervise.run(a.run_dir, a.restart, job)
    if a.cmd == "start":
        return supervise.start_detached(a.run_dir, job)
    if a.cmd == "stop":
        return recipe.stop(a.run_dir, a.unit, a.timeout) if job is RECIPE else supervise.stop(a.run_dir, a.unit,
                                                                                               a.timeout, job)
    if a.cmd == "status":
        rep = status.report(a.run_dir, a.unit, job=job)
        print(json.dumps(rep, indent=1) if a.json else status.format_report(rep))
        return status.exit_code(rep)
    return logs(a.run_dir, a.lines, a.follow, a.unit, job.log)


def recipe_command(a: argparse.Namespace) -> int:
    """The recipe chain's own commands: plan and start it, its status, start or run an existing plan."""
    if a.cmd == "recipe":
        return start_recipe(a)
    if a.cmd == "status":
        rep = recipe.report(a.run_dir)
        print(json.dumps(rep, indent=1) if a.json else recipe.format_report(rep))
        return recipe.exit_code(rep)
    if a.cmd == "start":
        return supervise.start_detached(a.run_dir, RECIPE, recipe.run_chain)
    return recipe.run_chain(a.run_dir)


def start_recipe(a: argparse.Namespace) -> int:
    """Write the chain's plan (the previous one when no plan argument is given), then start it."""
    current = supervise.read_state(a.run_dir.absolute())
    if current.get("state") in ("running", "starting") and supervise.alive(int(current.get("pid") or 0)):
        print(f"already running (pid {current['pid']}): make recipe-status / make recipe-stop")
        return 1
    given = any((a.config, a.target, a.data, a.set, a.args, a.nproc))
    if a.job_dir and given:
        print("--job-dir takes the stages from the deployed jobs: give it without --config, --target, --data, "
              "--set, --args and --nproc (the inventory sets those)", file=sys.stderr)
        return 2
    earlier = recipe.read_plan(a.run_dir.absolute())
    planned = plan_deployed(a) if a.job_dir else plan_local(a) if given or earlier is None else \
        save_plan(a.run_dir, earlier, "since the last start")  # the same plan: a config it reads may have changed
    if planned:
        return planned
    if stray := recipe.stray_processes(a.run_dir.absolute()):
        print("\n".join(stray), file=sys.stderr)
        return 1
    if a.plan_only:
        print(recipe.plan_summary(a.run_dir.absolute()))
        return 0
    if a.foreground:
        return recipe.run_chain(a.run_dir)
    rc = supervise.start_detached(a.run_dir, RECIPE, recipe.run_chain)
    if rc == 0:
        print(f"recipe chain started in {a.run_dir}: make recipe-status (dflash-run status --job recipe "
              f"--run-dir {a.run_dir})")
    return rc


def plan_deployed(a: argparse.Namespace) -> int:
    """The plan of a container's chain: its stages are the deployed jobs --job-dir names. 0, or 2 for bad input."""
    job_dirs = {}
    for item in a.job_dir:
        stage, sep, where = item.partition("=")
        if not sep or not where or stage not in ("regenerate", "train", "eval"):
            print(f"--job-dir {item!r}: give STAGE=DIR with STAGE one of regenerate, train, eval", file=sys.stderr)
            return 2
        job_dirs[stage] = Path(where)
    return save_plan(a.run_dir, recipe.deployed_plan(job_dirs), "the deployed jobs changed")


def plan_local(a: argparse.Namespace) -> int:
    """The plan of a chain on this machine, from --config, --target, --data, --set, --args and --nproc. 0, or 2 for
    bad input."""
    stage_args = {}
    for item in a.args:
        stage, sep, rest = item.partition("=")
        if not sep or stage not in (recipe.BUILD_TARGET, "regenerate", "train", "eval"):
            print(f"--args {item!r}: give STAGE=ARGS with STAGE one of target, regenerate, train, eval",
                  file=sys.stderr)
            return 2
        stage_args.setdefault(stage, []).extend(shlex.split(rest))
    if a.nproc is not None and a.nproc < 1:
        print(f"--nproc {a.nproc}: give 1 or more processes", file=sys.stderr)
        return 2
    plan = recipe.make_plan(a.run_dir, a.config or "embedded", a.target or recipe.EMBEDDED,
                            a.data or [recipe.default_data()], a.set, stage_args, a.nproc or 1)
    return save_plan(a.run_dir, plan, "the plan changed")


def save_plan(run_dir: Path, plan: dict, what: str) -> int:
    """Write the chain's plan and say which finished stages run again, and why. 0, or 2 when a config a stage reads
    is not there (nothing written)."""
    try:
        again = recipe.save_plan(run_dir.absolute(), plan)
    except recipe.InputMissing as exc:
        print(exc, file=sys.stderr)
        return 2
    if again:
        print(f"{what}: " + "; ".join(f"{name} will run again ({why})" for name, why in again.items()))
    return 0


def logs(run_dir: Path, lines: int, follow: bool, unit: str | None = None, log: str = supervise.LOG) -> int:
    recorded = supervise.read_state(run_dir.absolute()).get("log")
    path = Path(status.in_this_dir(run_dir, recorded, log) or run_dir / log)
    # Under systemd, what systemd itself says about the unit (exits, restarts, a unit that never started).
    journal = supervise.unit_journal(unit, min(lines, 20)) if unit else []
    said = "".join(f"\n  {x}" for x in journal)
    said = f"systemd about {unit} (all of it: journalctl -u {unit}):{said}" if said else ""
    if not path.is_file():
        print(f"no log at {path}: the job was never started detached (with INVENTORY), or it ran in the "
              "foreground (`make train` without INVENTORY) and printed to its terminal" + (f"\n{said}" if said else ""))
        return 1
    print("\n".join(status.tail(path, lines)))
    if not follow:
        if said:
            print(said)
        return 0
    with open(path, errors="replace") as f:
        f.seek(0, 2)
        while True:
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
                continue
            if supervise.read_state(run_dir.absolute()).get("state") not in ("running", "restarting", "starting"):
                return 0
            time.sleep(0.5)
