"""PVE worker tasks: UPIDs in pve-common's format, running -> stopped, exitstatus and a task log."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class TaskWarning(str):
    """A log line that counts as a warning (PVE prints them as 'WARN: ...')."""


def _pstart(tid: int) -> int:
    # Field 22 of /proc/<pid>/task/<tid>/stat: start time in clock ticks since boot, as PVE records.
    stat = Path(f"/proc/{os.getpid()}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def make_upid(node: str, pid: int, pstart: int, starttime: int, dtype: str, vmid: str, user: str) -> str:
    return f"UPID:{node}:{pid:08X}:{pstart:08X}:{starttime:08X}:{dtype}:{vmid}:{user}:"


# pve-common src/PVE/UPID.pm decode
UPID_RE = re.compile(r"UPID:([a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?):([0-9A-Fa-f]{8}):([0-9A-Fa-f]{8,9}):"
                     r"([0-9A-Fa-f]{8}):([^:\s/]+):([^:\s/]*):([^:\s/]+):")
# pve-access-control AccessControl.pm: a token id is <user>@<realm>!<token name>
TOKEN_ID_RE = re.compile(r"([^\s:/]+@[A-Za-z][A-Za-z0-9.\-_]+)!([A-Za-z][A-Za-z0-9.\-_]+)")


def parse_upid(upid: str) -> dict:
    m = UPID_RE.fullmatch(upid)
    if not m:
        raise ValueError(f"unable to parse worker upid '{upid}'")
    return {"node": m[1], "pid": int(m[3], 16), "pstart": int(m[4], 16), "starttime": int(m[5], 16),
            "type": m[6], "id": m[7], "user": m[8]}


def split_token_user(user: str) -> dict:
    """pve-manager API2/Tasks.pm convert_token_task: 'root@pam!ci' -> user root@pam, tokenid ci."""
    m = TOKEN_ID_RE.fullmatch(user)
    return {"user": m[1], "tokenid": m[2]} if m else {"user": user}


@dataclass
class Task:
    upid: str
    node: str
    type: str
    id: str
    user: str
    pid: int
    pstart: int
    starttime: int
    status: str = "running"
    exitstatus: str | None = None
    endtime: int | None = None
    lines: list[str] = field(default_factory=list)
    warnings: int = 0

    def log(self, line: str) -> None:
        for part in str(line).splitlines() or [""]:
            self.lines.append(part)
        if isinstance(line, TaskWarning) or str(line).startswith("WARN: "):
            self.warnings += 1  # PVE counts the 'WARN: ...' lines of a task

    def warn(self, msg: str) -> None:
        self.log(TaskWarning(f"WARN: {msg}"))

    def status_dict(self) -> dict:
        """GET tasks/{upid}/status (pve-manager API2/Tasks.pm read_task_status): the decoded UPID with
        a token's user split into user and tokenid, plus status and, once stopped, exitstatus."""
        d = {"upid": self.upid, "node": self.node, "pid": self.pid, "pstart": self.pstart,
             "starttime": self.starttime, "type": self.type, "id": self.id, **split_token_user(self.user),
             "status": self.status}
        if self.status == "stopped":
            d["exitstatus"] = self.exitstatus
        return d

    def list_entry(self) -> dict:
        """An entry of GET nodes/{node}/tasks (node_tasks): the same fields, endtime and the status
        text of the task index ('OK', 'WARNINGS: n', the error) once it ended, 'RUNNING' before."""
        d = {k: v for k, v in self.status_dict().items() if k != "exitstatus"}
        if self.status == "stopped":
            d["endtime"] = self.endtime
            d["status"] = self.exitstatus
        else:
            d["status"] = "RUNNING"
        return d


class TaskManager:
    """Runs each operation in its own thread; the thread's Linux TID is the UPID's pid."""

    def __init__(self, node: str, failures_dir: Path, log_dir: Path | None = None):
        self.node = node
        self.failures_dir = failures_dir
        self.log_dir = log_dir
        self.tasks: dict[str, Task] = {}
        self._lock = threading.Lock()

    def take_injected_failure(self, dtype: str) -> str | None:
        """A failure planted by the tests (set_task_failure) for the next task of this type."""
        f = self.failures_dir / f"fail-{dtype}"
        try:
            msg = f.read_text().strip()
            f.unlink()
            return msg or "injected failure"
        except FileNotFoundError:
            return None

    def start(self, dtype: str, vmid: str, user: str, work: Callable[[Task], None],
              on_error: Callable[[], None] | None = None) -> str:
        """Run work(task) as a task; on_error undoes what a failed (or injected-failing) task left."""
        ready = threading.Event()
        holder: dict[str, Task] = {}

        def run() -> None:
            tid = threading.get_native_id()
            task = Task(upid=make_upid(self.node, tid, _pstart(tid), int(time.time()), dtype, vmid, user),
                        node=self.node, type=dtype, id=vmid, user=user, pid=tid, pstart=_pstart(tid),
                        starttime=int(time.time()))
            with self._lock:
                self.tasks[task.upid] = task
            holder["task"] = task
            ready.set()
            self._run(task, work, on_error)

        threading.Thread(target=run, name=f"task-{dtype}-{vmid}", daemon=True).start()
        ready.wait()
        return holder["task"].upid

    def _run(self, task: Task, work: Callable[[Task], None], on_error: Callable[[], None] | None) -> None:
        injected = self.take_injected_failure(task.type)
        try:
            if injected is not None:
                raise RuntimeError(injected)
            work(task)
        except Exception as exc:  # noqa: BLE001 - the task's error text is what PVE reports as exitstatus
            # RESTEnvironment::fork_worker: chomp, then every newline becomes a blank
            msg = str(exc).rstrip("\n").replace("\n", " ") or type(exc).__name__
            logging.getLogger("pve_testhost").info("task %s failed:\n%s", task.upid, traceback.format_exc())
            task.log(f"TASK ERROR: {msg}")
            task.exitstatus = msg
            if on_error is not None:
                on_error()
        else:
            if task.warnings:
                task.log(f"TASK WARNINGS: {task.warnings}")
                task.exitstatus = f"WARNINGS: {task.warnings}"
            else:
                task.log("TASK OK")
                task.exitstatus = "OK"
        task.endtime = int(time.time())
        task.status = "stopped"
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / task.upid.replace(":", "_")).write_text("\n".join(task.lines) + "\n")

    def get(self, upid: str) -> Task | None:
        with self._lock:
            return self.tasks.get(upid)

    def list(self) -> list[Task]:
        with self._lock:
            return sorted(self.tasks.values(), key=lambda t: t.starttime, reverse=True)

    def wait(self, upid: str, timeout: float = 60) -> Task:
        deadline = time.monotonic() + timeout
        task = self.get(upid)
        while task is not None and task.status == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        return task
