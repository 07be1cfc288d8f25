"""What a job is doing: supervisor state, its processes, its progress (checkpoint, shards, result), last log lines."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from . import supervise
from .jobs import EVAL, JOBS, REGENERATE, TRAIN, Job
from .procs import alive, job_processes, of_run

PROGRESS_FILE = "progress.txt"  # dflash_trainer.run.run_dir.PROGRESS: the trainer's latest progress line

STEP_DIR = re.compile(r"^step-(\d{8,})$")
TRAINING_STATE = ("training_state.json", "training_state.pt")  # a checkpoint's state; .pt: an older trainer's
# The plain progress lines a job writes to its log (dflash_trainer.infra.metrics): "train: step 120/3000 | ...",
# "regenerate: 40/9262 prompts | ...", "eval: gsm8k 12/32 prompts | ..." (after a "[rank0]:" tag, if any).
PROGRESS_LINE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?((?:train: step|regenerate:|eval: \S+) \d+/\d+.*)$")


def last_checkpoint(run_dir: Path) -> int | None:
    steps = [int(m.group(1)) for e in (run_dir / "checkpoints").glob("step-*")
             if (m := STEP_DIR.match(e.name)) and any((e / name).is_file() for name in TRAINING_STATE)]
    return max(steps) if steps else None


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def total_steps(run_dir: Path) -> int | None:
    try:
        return int((read_json(run_dir / "config.json") or {})["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 256 * 1024))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def last_progress(path: Path) -> str | None:
    """The last progress line in the log's last 256 KiB, or None; a job run with --log-format json writes each
    line as a JSON object, whose message is the line."""
    for line in reversed(tail(path, 1 << 20)):
        if m := PROGRESS_LINE.match(_message(line.strip())):
            return m.group(1)
    return None


def _message(line: str) -> str:
    if not line.startswith("{"):
        return line
    try:
        record = json.loads(line)
    except ValueError:
        return line
    return record["message"] if isinstance(record, dict) and isinstance(record.get("message"), str) else line


def progress(job: Job, job_dir: Path) -> dict:
    """What the job has written so far, read from its directory."""
    if job is REGENERATE:
        s = read_json(job_dir / "summary.json")
        return {"shards": len(list(job_dir.glob("part-*.jsonl"))),
                "summary": s and {"prompts": s.get("prompts"), "answer_tokens": s.get("answer_tokens"),
                                  "tokens_per_s": (s.get("this_run") or {}).get("tokens_per_s")}}
    if job is EVAL:
        s = read_json(job_dir / "eval.json")
        overall = (s or {}).get("overall") or {}
        return {"summary": s and {"sets": list(s.get("sets") or {}), "prompts": overall.get("prompts"),
                                  "tau": overall.get("tau"), "speedup": overall.get("speedup")}}
    s = read_json(job_dir / "summary.json")
    summary = s and {k: s.get(k) for k in ("steps", "final_loss", "tau_before", "tau_after", "drafter_dir")}
    if summary:
        summary["drafter_dir"] = in_this_dir(job_dir, summary["drafter_dir"], "drafter")
    return {"last_checkpoint": last_checkpoint(job_dir), "total_steps": total_steps(job_dir), "summary": summary}


def in_this_dir(run_dir: Path, recorded, where: str) -> str | None:
    """A path the run recorded inside its directory (summary.json's drafter, state.json's log), as `where` in this
    one: a run copied or moved elsewhere recorded the paths it had, where its files may no longer be (or be another
    run's)."""
    if not isinstance(recorded, str) or not recorded:
        return recorded
    here = run_dir.absolute() / where
    if not Path(recorded).absolute().is_relative_to(run_dir.absolute()) and here.exists():
        return str(here)
    return recorded
    here = run_dir / Path(recorded).name
    if Path(recorded).parent.absolute() != run_dir.absolute() and here.is_dir():
        return str(here)
    return recorded


def other_job(run_dir: Path, job: Job) -> Job | None:
    """The job run_dir belongs to, where that is not `job` (status asked with the wrong --job): the one its
    launch.json names (a deployed job), else the one whose files it holds, where it holds none of `job`'s."""
    if supervise.launch_problem(run_dir) is None:  # a usable launch.json (a damaged one names no job here)
        launched = JOBS[read_json(run_dir / supervise.LAUNCH).get("job", TRAIN.name)]
        return launched if launched is not job else None
    if not run_dir.is_dir() or job.leaves_files_in(run_dir):
        return None
    return next((other for other in JOBS.values() if other is not job and other.leaves_files_in(run_dir)), None)


def report(run_dir: Path, unit: str | None, log_lines: int = 5, job: Job = TRAIN) -> dict:
    run_dir = run_dir.absolute()
    st = supervise.read_state(run_dir)
    state = st.get("state", "never started")
    unit_state = supervise.systemd_unit_state(unit) if unit else None
    if unit_state:
        state = {"active": "running", "activating": "restarting", "deactivating": "stopping"}.get(
            unit_state.get("ActiveState", ""), st.get("state", unit_state.get("ActiveState")))
    elif state in ("running", "restarting", "starting") and not alive(int(st.get("pid") or 0)):
        state = "dead"  # the supervisor went away without recording why (container restart, SIGKILL)
    found = of_run(run_dir, job_processes(), job)
    # How the job last ended: the supervisor's record (its exit code, when), or for a job started directly the
    # time of the result it wrote.
    ended = {"rc": st.get("rc"), "at": st.get("updated")} if state in ENDED and "rc" in st else None
    if found and state in ("never started", *ENDED, "dead"):
        state, ended = "running (foreground, unsupervised)", None
    elif state == "never started" and not run_dir.is_dir():  # a mistyped directory reads as this too
        state = NO_SUCH_DIRECTORY
    elif state == "never started":
        state, at = unsupervised_state(run_dir, job)
        ended = {"rc": None, "at": at} if at else None
    log = Path(in_this_dir(run_dir, st.get("log"), job.log) or run_dir / job.log)
    # A run started directly (a terminal, a script) has no log here: the trainer's own latest line.
    latest = last_progress(log) or (last_progress(run_dir / PROGRESS_FILE) if job is TRAIN else None)
    done = progress(job, run_dir)
    if not found and (other := other_job(run_dir, job)):  # what it read is another job's: said, not shown
        state, ended, latest, done["summary"] = (f"{WRONG_JOB}: {run_dir} holds {other.what} output, not {job.what}: "
                                                 f"dflash-run status --job {other.name}"), None, None, None
    return {"job": job.name, "run_dir": str(run_dir), "state": state, "supervisor": st.get("supervisor", "none"),
            "systemd": unit_state, "restarts": int((unit_state or {}).get("NRestarts") or st.get("restarts") or 0),
            "pids": [p.pid for p in found], "ended": ended, **done, "last_progress": latest,
            "log": str(log), "log_found": log.is_file(),
            "log_tail": tail(log, log_lines)}


ENDED = ("finished", "stopped", "failed")  # supervisor states that record the job's exit code (rc)
DIRECTLY = "started directly, not by dflash-run"


def _mtime(path: Path) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(path.stat().st_mtime))


def unsupervised_state(run_dir: Path, job: Job = TRAIN) -> tuple[str, str | None]:
    """A job no supervisor recorded (dflash-train, dflash-regenerate or dflash-eval run directly) and no process of
    it alive: what its directory says, and when its result was written (None: no result)."""
    result = run_dir / job.result  # a job started directly has no supervisor record: its result says it ended
    if result.is_file():
        return f"finished ({DIRECTLY})", _mtime(result)
    if job is TRAIN and (run_dir / "config.json").is_file():
        return (f"not running: {DIRECTLY}, and ended before its last step; --resume continues it from its last "
                "checkpoint"), None
    if job is REGENERATE and any(run_dir.glob("part-*.jsonl")):
        return (f"not running: {DIRECTLY}, and ended before it answered every prompt (no summary.json); the same "
                "command again answers the rest"), None
    return "never started", None


NO_SUCH_DIRECTORY = "never started (no such directory: deploy creates it, or check the path)"
WRONG_JOB = "another job's directory"


def exit_code(r: dict) -> int:
    """2 for a run directory that does not exist and no job of it running, or one of another job (a mistyped path
    or --job is bad input), else 0."""
    return 2 if r["state"] == NO_SUCH_DIRECTORY or r["state"].startswith(WRONG_JOB) else 0


def progress_lines(r: dict) -> list[str]:
    s = r["summary"]
    if r["job"] == REGENERATE.name:
        lines = [f"shards:      {r['shards']} (data.train takes {r['run_dir']}/part-*.jsonl)"]
        if s:
            lines.append(f"summary:     {s['prompts']} prompts answered, {s['answer_tokens']} answer tokens"
                         + (f", {s['tokens_per_s']:.1f} tok/s in the last run" if s["tokens_per_s"] else ""))
        return lines
    if r["job"] == EVAL.name:
        if not s:
            return ["result:      none yet (eval.json is written when the evaluation completes)"]
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "n/a"
        speedup = f"{s['speedup']:.2f}x" if s["speedup"] else "n/a"
        return [(f"result:      tau {tau}, speedup {speedup} on {s['prompts']} prompts "
                 f"({', '.join(s['sets'])}): {r['run_dir']}/eval.json, eval.png")]
    ck = r["last_checkpoint"]
    lines = [f"checkpoint:  {'none yet' if ck is None else f'step {ck}'}"
             + (f" of {r['total_steps']}" if r["total_steps"] else "")]
    if s:
        loss = f"{s['final_loss']:.4f}" if isinstance(s["final_loss"], (int, float)) else "n/a"
        tau = (f", tau {s['tau_before']:.2f} -> {s['tau_after']:.2f}"
               if isinstance(s.get("tau_before"), (int, float)) and isinstance(s.get("tau_after"), (int, float))
               else ", tau n/a (no target in this run: dflash-eval --run measures it)")
        lines.append(f"summary:     {s['steps']} steps, final loss {loss}{tau}, drafter {s['drafter_dir']}")
    return lines


def format_report(r: dict) -> str:
    log = r["log"] if r.get("log_found", True) or r["supervisor"] != "none" else \
        "none here (a run started directly logs to its own terminal or file)"
    ended = r.get("ended")
    lines = [f"job:         {r['job']} in {r['run_dir']}",
             f"state:       {r['state']} (supervisor: {r['supervisor']}, restarts: {r['restarts']})",
             *(["ended:       " + (f"exit {ended['rc']}" if ended["rc"] is not None else "its result written")
                + (f" at {ended['at']}" if ended.get("at") else "")] if ended else []),
             f"processes:   {', '.join(map(str, r['pids'])) or 'none'}",
             *([] if r["state"].startswith(WRONG_JOB) else progress_lines(r)),
             *([f"progress:    {r['last_progress']}"] if r.get("last_progress") else []),
             f"log:         {log}"]
    if r["log_tail"]:
        lines += ["last log lines:"] + ["  " + x for x in r["log_tail"]]
    return "\n".join(lines)
