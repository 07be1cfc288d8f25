"""What a run is doing: supervisor state, trainer processes, last checkpoint, summary, last log lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import supervise
from .procs import alive, of_run, training_processes

STEP_DIR = re.compile(r"^step-(\d{8,})$")


def last_checkpoint(run_dir: Path) -> int | None:
    steps = [int(m.group(1)) for e in (run_dir / "checkpoints").glob("step-*")
             if (m := STEP_DIR.match(e.name)) and (e / "training_state.pt").is_file()]
    return max(steps) if steps else None


def total_steps(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "config.json").read_text())["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 256 * 1024))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def report(run_dir: Path, unit: str | None, log_lines: int = 5) -> dict:
    run_dir = run_dir.absolute()
    st = supervise.read_state(run_dir)
    state = st.get("state", "never started")
    unit_state = supervise.systemd_unit_state(unit) if unit else None
    if unit_state:
        state = {"active": "running", "activating": "restarting", "deactivating": "stopping"}.get(
            unit_state.get("ActiveState", ""), st.get("state", unit_state.get("ActiveState")))
    elif state in ("running", "restarting", "starting") and not alive(int(st.get("pid") or 0)):
        state = "dead"  # the supervisor went away without recording why (container restart, SIGKILL)
    found = of_run(run_dir, training_processes())
    if found and state in ("never started", "finished", "stopped", "failed", "dead"):
        state = "running (foreground, unsupervised)"
    summary = None
    if (run_dir / "summary.json").is_file():
        try:
            s = json.loads((run_dir / "summary.json").read_text())
            summary = {k: s.get(k) for k in ("steps", "final_loss", "tau_before", "tau_after", "drafter_dir")}
        except ValueError:
            pass
    log = Path(st.get("log") or run_dir / supervise.LOG)
    return {"run_dir": str(run_dir), "state": state, "supervisor": st.get("supervisor", "none"),
            "systemd": unit_state, "restarts": int((unit_state or {}).get("NRestarts") or st.get("restarts") or 0),
            "trainer_pids": [p.pid for p in found], "last_checkpoint": last_checkpoint(run_dir),
            "total_steps": total_steps(run_dir), "summary": summary, "log": str(log),
            "log_tail": tail(log, log_lines)}


def format_report(r: dict) -> str:
    ck = r["last_checkpoint"]
    lines = [f"run:         {r['run_dir']}",
             f"state:       {r['state']} (supervisor: {r['supervisor']}, restarts: {r['restarts']})",
             f"trainer:     {', '.join(map(str, r['trainer_pids'])) or 'no process'}",
             f"checkpoint:  {'none yet' if ck is None else f'step {ck}'}"
             + (f" of {r['total_steps']}" if r["total_steps"] else ""),
             f"log:         {r['log']}"]
    if r["summary"]:
        s = r["summary"]
        lines.append(f"summary:     {s['steps']} steps, final loss {s['final_loss']}, tau {s.get('tau_before')} -> "
                     f"{s.get('tau_after')}, drafter {s['drafter_dir']}")
    if r["log_tail"]:
        lines += ["last log lines:"] + ["  " + x for x in r["log_tail"]]
    return "\n".join(lines)
