"""The job processes on this machine (training, regeneration, evaluation), found through /proc (no psutil in
the frozen environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .jobs import Job, job_of


@dataclass(frozen=True)
class Proc:
    pid: int
    argv: list[str]
    cwd: str
    job: Job

    def output_dir(self) -> Path | None:
        """The directory it writes to (its job's --output-dir or --out), resolved against its working directory."""
        flag = self.job.dir_flag
        for i, arg in enumerate(self.argv):
            if arg == flag and i + 1 < len(self.argv):
                value = self.argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            return Path(os.path.normpath(os.path.join(self.cwd, value)))
        return None


def job_processes(proc_root: str | os.PathLike = "/proc", exclude: set[int] | None = None) -> list[Proc]:
    """Every process running one of the jobs: its module (python -m, torchrun -m) or console script."""
    exclude = (exclude or set()) | {os.getpid()}
    found = []
    for entry in Path(proc_root).iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        argv = argv_of(int(entry.name), proc_root)
        try:
            cwd = os.readlink(entry / "cwd") if (entry / "cwd").exists() else "/"
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if argv is None:
            continue
        job = job_of(argv)
        if job is not None:
            found.append(Proc(int(entry.name), argv, cwd, job))
    return sorted(found, key=lambda p: p.pid)


def of_run(run_dir: str | os.PathLike, procs: list[Proc], job: Job | None = None) -> list[Proc]:
    """The processes (of `job`, if given) writing to run_dir (torchrun and its workers all carry the flag)."""
    want = Path(os.path.abspath(run_dir))
    return [p for p in procs if p.output_dir() == want and job in (None, p.job)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive: it only waits for its parent to reap it
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def started_at(pid: int) -> float | None:
    """When pid started, in wall-clock seconds (boot time + its start time in /proc); None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def argv_of(pid: int, proc_root: str | os.PathLike = "/proc") -> list[str] | None:
    """pid's command line; None when it is gone or not ours to read."""
    try:
        return [a.decode(errors="replace") for a in (Path(proc_root) / str(pid) / "cmdline").read_bytes().split(b"\0")
                if a]
    except OSError:
        return None


def children(pid: int, proc_root: str | os.PathLike = "/proc") -> list[int]:
    """pid's direct children (the parent pid is field 4 of /proc/<n>/stat)."""
    found = []
    for entry in Path(proc_root).iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return sorted(found)


def torchrun_workers(pid: int, proc_root: str | os.PathLike = "/proc") -> list[int]:
    """The worker processes when pid is torchrun (its console script or python -m torch.distributed.run);
    [] when it is not, or has started none yet."""
    argv = argv_of(pid, proc_root) or []
    launcher = any(Path(a).name == "torchrun" for a in argv[:2]) or "torch.distributed.run" in argv[:3]
    return children(pid, proc_root) if launcher else []
