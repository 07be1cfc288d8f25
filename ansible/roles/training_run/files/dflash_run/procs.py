"""Training processes on this machine, found through /proc (no psutil in the frozen environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# What a training process has on its command line: the module, torchrun's -m form, or the console script.
MARKERS = ("dflash_trainer.train", "dflash-train")


@dataclass(frozen=True)
class Proc:
    pid: int
    argv: list[str]
    cwd: str

    def output_dir(self) -> Path | None:
        """The run directory it writes to (--output-dir), resolved against its working directory."""
        for i, arg in enumerate(self.argv):
            if arg == "--output-dir" and i + 1 < len(self.argv):
                value = self.argv[i + 1]
            elif arg.startswith("--output-dir="):
                value = arg.split("=", 1)[1]
            else:
                continue
            return Path(os.path.normpath(os.path.join(self.cwd, value)))
        return None


def training_processes(proc_root: str | os.PathLike = "/proc", exclude: set[int] | None = None) -> list[Proc]:
    exclude = (exclude or set()) | {os.getpid()}
    found = []
    for entry in Path(proc_root).iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            cwd = os.readlink(entry / "cwd") if (entry / "cwd").exists() else "/"
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(m in a for a in argv for m in MARKERS) and not any("dflash_run" in a for a in argv):
            found.append(Proc(int(entry.name), argv, cwd))
    return sorted(found, key=lambda p: p.pid)


def of_run(run_dir: str | os.PathLike, procs: list[Proc]) -> list[Proc]:
    """The processes writing to run_dir (torchrun and its workers all carry --output-dir)."""
    want = Path(os.path.abspath(run_dir))
    return [p for p in procs if p.output_dir() == want]


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
