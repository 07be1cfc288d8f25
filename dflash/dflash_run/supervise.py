"""Run a job supervised: resume where it stopped, restart after a failure, stop gracefully.

Two supervisors share this code. Production: a systemd unit inside the container runs `dflash-run run`
(systemd restarts it, journald keeps its output). Containers without systemd (busybox init, the test
host's CTs): `dflash-run start` detaches a process supervisor that does the same restarts itself.
Either way the trainer starts with --resume once its directory holds a run (the first start is a new run), so
a restart continues from the last checkpoint (regeneration skips what it answered by itself), and the job's
output goes to stdout (journald) and to its log file.

Graceful stop: SIGTERM to the supervisor waits until no checkpoint is being written (the trainer's
checkpoints appear atomically from a .tmp-step-* directory), then sends SIGTERM to the trainer's
process group (to torchrun's workers under torchrun, see graceful_kill). Even if a save starts in that
instant, the previous checkpoint stays whole. A .tmp-step-* older than the trainer is what a killed save left
behind: nobody writes it, so the stop does not wait for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from itertools import pairwise
from pathlib import Path

from .jobs import JOBS, RECIPE, REGENERATE, TRAIN, Job, finished_run
from .procs import alive, job_processes, of_run, started_at, torchrun_workers

LAUNCH = "launch.json"  # written by `make deploy`: the job, its argv and the restart policy
STATE = "supervisor.json"
LOG = TRAIN.log
BAD_INPUT = 2  # the jobs' exit code for bad input (a config, data or path they refuse before doing any work)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def launch_problem(run_dir: Path, job: Job | None = None) -> tuple[str, str] | None:
    """What makes run_dir's launch.json unusable for `job` (any job when None), as (problem, fix); None if usable.

    The preflight reports it as a Problem, the supervisor refuses to start with it: a file that is missing,
    not JSON, not an object, another job's, or without a command line.
    """
    path = run_dir / LAUNCH
    what = job.what if job is not None else "job"
    redeploy = "make deploy again (it rewrites the file)"
    try:
        launch = json.loads(path.read_text())
    except FileNotFoundError:
        return (f"no {path}: the {what} was not deployed",
                "make deploy (with the same INVENTORY)" + (", after setting training_run_regenerate_data"
                                                           if job is REGENERATE else ""))
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}", "check the run directory's mount, then " + redeploy
    except ValueError as exc:
        return f"{path} is not JSON ({exc})", redeploy
    if not isinstance(launch, dict):
        return f"{path} holds a JSON {type(launch).__name__}, not an object (job, argv, ...)", redeploy
    kind = launch.get("job", TRAIN.name)
    if not isinstance(kind, str) or kind not in JOBS:
        return f"{path} names the job {kind!r}, which is none of {', '.join(JOBS)}", redeploy
    if job is not None and kind != job.name:
        return (f"{path} describes the {kind} job, not {job.name}",
                ("give each job a directory of its own (training_run_output_dir, training_run_regenerate_out, "
                 "training_run_eval_out), then make deploy"))
    argv = launch.get("argv")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        return f"{path} has no command line (argv: a non-empty list of strings)", redeploy
    if not isinstance(launch.get("env", {}), dict):
        return f"{path}: env is not an object of variables", redeploy
    return None


def load_launch(run_dir: Path, job: Job | None = None) -> dict:
    """launch.json; refused (SystemExit naming the problem and its fix) when launch_problem finds one."""
    problem = launch_problem(run_dir, job)
    if problem is not None:
        detail, fix = problem
        raise SystemExit(f"{detail}: {fix}")
    launch = json.loads((run_dir / LAUNCH).read_text())
    launch.setdefault("job", TRAIN.name)
    launch.setdefault("max_restarts", 3)
    launch.setdefault("restart_delay_s", 10)
    launch.setdefault("stop_timeout_s", 600)
    return launch


def write_state(run_dir: Path, **state) -> None:
    tmp = run_dir / (STATE + ".tmp")
    tmp.write_text(json.dumps(dict(state, updated=now()), indent=1))
    tmp.replace(run_dir / STATE)


def read_state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / STATE).read_text())
    except (OSError, ValueError):
        return {}


def checkpoint_in_progress(run_dir: Path, since: float = 0.0) -> bool:
    """A save is being written: a .tmp-step-* directory made at or after `since` (the trainer's start).

    Older ones are left-overs of a save that was killed (SIGKILL, OOM, a lost container): waiting for
    them would hold a stop up for its whole timeout; the trainer removes them at its next save.
    """
    for tmp in (run_dir / "checkpoints").glob(".tmp-step-*"):
        try:
            if tmp.stat().st_mtime >= since - 1:  # 1 s of slack for coarse file times
                return True
        except OSError:  # renamed into place or removed meanwhile
            continue
    return False


def _stop_gracefully(send, is_alive, run_dir: Path, timeout_s: float, since: float, force: bool) -> None:
    """Let a checkpoint in progress finish, SIGTERM, wait; with force, SIGKILL once timeout_s is up."""
    deadline = time.monotonic() + timeout_s
    while checkpoint_in_progress(run_dir, since) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        send(signal.SIGTERM)
    except ProcessLookupError:
        return
    while is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if force:
        try:
            send(signal.SIGKILL)
        except ProcessLookupError:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def graceful_kill(pgid: int, run_dir: Path, timeout_s: float, since: float = 0.0) -> None:
    """Let a checkpoint in progress finish, then SIGTERM the job; SIGKILL the group after timeout_s.

    Under torchrun the SIGTERM goes to its workers, not to torchrun: torchrun forwards a SIGTERM it gets and
    SIGKILLs its workers 30 s later (hard-coded before torch 2.12), which cuts short the checkpoint a
    large drafter writes when it stops; it also made each worker see the signal twice. torchrun exits by
    itself once its workers have. A job that is not torchrun (or torchrun before its workers start) gets it
    as a group, as before."""
    def send(sig: signal.Signals) -> None:
        workers = torchrun_workers(pgid) if sig == signal.SIGTERM else []
        if not workers:
            os.killpg(pgid, sig)
        for pid in workers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    _stop_gracefully(send, lambda: _group_alive(pgid), run_dir, timeout_s, since, force=True)


class Supervisor:
    def __init__(self, run_dir: Path, restart: bool, job: Job | None = None):
        self.run_dir = run_dir.absolute()
        self.launch = load_launch(self.run_dir, job)
        self.job = JOBS[self.launch["job"]]
        self.restart = restart
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None
        self.child_started = 0.0
        self.result, self.result_before = self.run_dir / self.job.result, None  # set at each start (run_job)
        self.log_path = self.run_dir / self.job.log
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

    def on_signal(self, signum, _frame) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.note(f"{signal.Signals(signum).name} received: stopping after the checkpoint in progress")
        if self.child is not None and self.child.poll() is None:
            threading.Thread(target=graceful_kill, daemon=True, args=(
                self.child.pid, self.run_dir, self.launch["stop_timeout_s"], self.child_started)).start()

    def note(self, line: str) -> None:
        self.emit(f"[dflash_run {now()}] {line}\n")

    def emit(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(line)
        sys.stdout.write(line)
        sys.stdout.flush()

    def run_job(self) -> int:
        argv = list(self.launch["argv"]) + list(self.job.start_args(self.run_dir))
        env = dict(os.environ, **self.launch.get("env", {}), PYTHONUNBUFFERED="1")
        self.note("start: " + " ".join(argv))
        self.result = self.result_path(argv)
        self.result_before = self.result_mark()
        self.child_started = time.time()
        # Own process group: the graceful stop finds torchrun's workers in it, and a forced one kills them all.
        self.child = subprocess.Popen(argv, cwd=self.run_dir, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True, text=True, bufsize=1,
                                      errors="replace")
        self.state("running", job_pid=self.child.pid)
        for line in self.child.stdout:
            self.emit(line)
        return self.child.wait()

    def result_path(self, argv: list[str]) -> Path:
        """Where the job writes its result: the directory its command line names last (`--out X` given again in
        the extra arguments wins, as argparse takes the last), else the job directory."""
        flag, where = self.job.dir_flag, None
        for arg, value in pairwise(argv):
            if arg == flag:
                where = value
        for arg in argv:
            if arg.startswith(flag + "="):
                where = arg.split("=", 1)[1]
        return (self.run_dir / where if where else self.run_dir) / self.job.result

    def result_mark(self) -> tuple | None:
        """The result file's identity and time, None while there is none: compared before and after a start,
        so no clock is involved (a network mount's server clock may differ from this host's)."""
        try:
            st = self.result.stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def wrote_result(self) -> bool:
        """The job's result file (summary.json, eval.json) was written, replaced or touched since this start."""
        mark = self.result_mark()
        return mark is not None and mark != self.result_before

    def state(self, state: str, **extra) -> None:
        write_state(self.run_dir, state=state, job=self.job.name, pid=os.getpid(), restarts=self.restarts,
                    log=str(self.log_path), supervisor=self.launch.get("supervisor", "process"), **extra)

    def loop(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.restarts = 0
        while True:
            rc = self.run_job()
            noun = self.job.noun
            if self.stopping.is_set():
                self.note(f"stopped ({noun} exit {rc}); {self.job.again}")
                self.state("stopped", rc=rc)
                return 0
            if rc in SIGNALLED and not self.wrote_result():
                # Ended by a SIGTERM / Ctrl-C sent to it before it could stop cleanly (its start-up): said so by
                # the job itself (exit 128 + the signal), a stop as well, not a failure to restart.
                self.note(f"stopped: the {noun} was ended by a signal sent to it, not to dflash-run (exit {rc}); "
                          f"{self.job.again}")
                self.state("stopped", rc=rc)
                return 0
            if rc == 0 and not self.wrote_result() and not (self.job is TRAIN and finished_run(self.result.parent)):
                # The job stops cleanly on SIGTERM / SIGINT too (exit 0, its work kept): a signal sent to it, not
                # to this supervisor (a `kill` of its pid), is a stop, not the end of the work.
                self.note(f"stopped: the {noun} exited 0 before it finished (no new {self.job.result}; a signal "
                          f"sent to it, not to dflash-run); {self.job.again}")
                self.state("stopped", rc=0)
                return 0
            if rc == 0:
                self.note("finished")
                self.state("finished", rc=0)
                return 0
            if rc == BAD_INPUT:  # a restart would be refused the same way: the error above names the fix
                self.note(f"{noun} refused its input (exit {rc}): not restarted; fix what it names, then start again")
                self.state("failed", rc=rc)
                return rc
            if not self.restart or self.restarts >= self.launch["max_restarts"]:
                self.note(f"{noun} failed (exit {rc})" + ("" if not self.restart else
                          f" after {self.restarts} restarts; giving up"))
                self.state("failed", rc=rc)
                return rc
            self.restarts += 1
            self.note(f"{noun} failed (exit {rc}); restart {self.restarts}/{self.launch['max_restarts']} in "
                      f"{self.launch['restart_delay_s']} s" + (" from the last checkpoint" if self.job is TRAIN else ""))
            self.state("restarting", rc=rc)
            if self.stopping.wait(self.launch["restart_delay_s"]):
                self.state("stopped", rc=rc)
                return 0


# The exit of a job a SIGTERM or SIGINT ended: 128 + the signal as the trainer's commands exit on it, or the
# negative signal Popen reports for a process the signal killed.
SIGNALLED = {128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT}


def run(run_dir: Path, restart: bool, job: Job | None = None) -> int:
    return Supervisor(run_dir, restart, job).loop()


def start_detached(run_dir: Path, job: Job = TRAIN, body: Callable[[Path], int] | None = None) -> int:
    """The process supervisor, detached from the caller (double fork, new session): survives disconnects.
    body: what the detached process runs in run_dir (default: the job's supervisor; the recipe chain's own)."""
    run_dir = run_dir.absolute()
    if body is None:
        load_launch(run_dir, job)  # fail here, in the caller, when the job was never deployed
        body = partial(run, restart=True, job=job)
    current = read_state(run_dir)
    if current.get("state") in ("running", "restarting") and alive(int(current.get("pid", 0))):
        print(f"already running (supervisor pid {current['pid']}); make {job.name}-status / make {job.name}-stop")
        return 1
    write_state(run_dir, state="starting", job=job.name, pid=0, restarts=0, log=str(run_dir / job.log),
                supervisor="process")
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        for _ in range(100):  # until the supervisor has recorded itself
            if read_state(run_dir).get("pid"):
                break
            time.sleep(0.1)
        return 0
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        code = body(run_dir)
    except BaseException:  # noqa: BLE001 - a detached process has nobody to tell but its log
        import traceback

        with open(run_dir / job.log, "a") as log:
            traceback.print_exc(file=log)
        code = 1
    os._exit(code)


# Unit states in which it has (or is about to have) a trainer: `systemctl stop` is the way to stop it.
UNIT_RUNNING = ("active", "activating", "deactivating", "reloading")


def systemd_unit_state(unit: str) -> dict | None:
    """ActiveState etc. of the unit, or None where there is no systemd (or no such unit)."""
    if not Path("/run/systemd/system").is_dir():
        return None
    out = subprocess.run(["systemctl", "show", unit, "-p", "LoadState,ActiveState,SubState,Result,NRestarts,MainPID"],
                         capture_output=True, text=True, check=False).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return None if props.get("LoadState") in (None, "not-found") else props


def unit_journal(unit: str, lines: int) -> list[str]:
    """systemd's own lines about the unit (starts, exit statuses, restarts, the restart limit): only journald
    has them; the job's log has the job's and dflash-run's. Empty where there is no systemd."""
    if not Path("/run/systemd/system").is_dir():
        return []
    name = unit if "." in unit else unit + ".service"
    res = subprocess.run(["journalctl", "--no-pager", "-q", "-o", "short-iso", "-n", str(lines), "_PID=1",
                          f"UNIT={name}"], capture_output=True, text=True, check=False)
    return res.stdout.splitlines() if res.returncode == 0 else []


def stop(run_dir: Path, unit: str | None, timeout_s: float, job: Job = TRAIN) -> int:
    """Graceful stop through whichever supervisor runs it; a foreground run gets the same treatment."""
    run_dir = run_dir.absolute()
    unit_state = systemd_unit_state(unit) if unit else None
    if unit_state and unit_state.get("ActiveState") in UNIT_RUNNING:
        # SIGTERM to dflash-run (KillMode=mixed): it waits for the checkpoint in progress, the trainer writes
        # one at the step it is on; `systemctl stop` returns when the unit is down.
        rc = subprocess.run(["systemctl", "stop", unit], check=False).returncode
        after = systemd_unit_state(unit) or {}
        if rc != 0:
            print(f"systemctl stop {unit} failed (exit {rc}; unit {after.get('ActiveState')}): journalctl -u {unit}",
                  file=sys.stderr)
            return rc
        print(f"stopped {unit} (unit {after.get('ActiveState')}, result {after.get('Result')}): "
              f"{read_state(run_dir).get('state')}; checkpoints in {run_dir / 'checkpoints'}")
        return 0
    st = read_state(run_dir)
    pid = int(st.get("pid") or 0)
    if st.get("state") in ("running", "restarting") and pid and alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if alive(pid):
            print(f"supervisor {pid} still running after {timeout_s:g} s", file=sys.stderr)
            return 1
        kept = RECIPE.again if job is RECIPE else f"checkpoints in {run_dir / 'checkpoints'}"
        print(f"stopped: {read_state(run_dir).get('state')}; {kept}")
        return 0
    found = of_run(run_dir, job_processes(), job)
    if not found:
        print(f"nothing to stop: no {job.what} process writes to {run_dir}")
        return 0
    # torchrun's workers carry the flag too: signal them, not torchrun (which would kill them 30 s later, see
    # graceful_kill); it exits once they have.
    found = [p for p in found if not torchrun_workers(p.pid)]
    for p in found:  # `make train` in the foreground (local): the same graceful rule
        _term_one(p.pid, run_dir, timeout_s)
    print(f"stopped {len(found)} {job.what} process(es) of {run_dir}")
    return 0


def _term_one(pid: int, run_dir: Path, timeout_s: float) -> None:
    """A foreground job: the same graceful rule, SIGTERM only (its owner decides what comes next)."""
    _stop_gracefully(lambda sig: os.kill(pid, sig), lambda: alive(pid), run_dir, timeout_s,
                     started_at(pid) or 0.0, force=False)
