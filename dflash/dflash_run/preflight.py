"""Preflight before a job starts: every check runs, each problem names itself and its fix.

GPUs idle with memory free (nvidia-smi), no job process left (training, regeneration or evaluation: each
holds GPUs), disk space for checkpoints,
the compile cache writable, and the run directory on persistent storage (a mount point outside the
root filesystem, so `make rebuild` and re-creating the container keep outputs and checkpoints).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import procs as procs_mod
from .jobs import TRAIN, Job
from .supervise import launch_problem

GPU_QUERY = ["nvidia-smi", "--query-gpu=index,memory.used,memory.total,utilization.gpu",
             "--format=csv,noheader,nounits"]
APPS_QUERY = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class Problem:
    check: str
    detail: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.detail}\n    fix: {self.fix}"


def _rows(csv_text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in csv_text.splitlines() if line.strip()]


def check_gpus(gpu_csv: str, apps_csv: str, need: int, max_used_mib: int) -> list[Problem]:
    """nvidia-smi's CSV (GPU_QUERY, APPS_QUERY) -> problems: too few GPUs, memory in use, compute processes."""
    problems = []
    gpus = _rows(gpu_csv)
    if len(gpus) < need:
        problems.append(Problem("gpus", f"the run needs {need} GPUs (target + drafter ranks), nvidia-smi shows "
                                f"{len(gpus)}", "give the container more GPUs (proxmox_gpu_devices, make provision) "
                                "or lower training_run_target_gpus / training_run_drafter_gpus"))
    for row in gpus:
        try:
            index, used, total = row[0], int(float(row[1])), int(float(row[2]))
        except (IndexError, ValueError):
            problems.append(Problem("gpus", f"cannot read nvidia-smi's line {','.join(row)!r}",
                                    "check `nvidia-smi` in the container (make provision matches the driver)"))
            continue
        if used > max_used_mib:
            problems.append(Problem("gpus", f"GPU {index} has {used} MiB of {total} MiB in use (more than "
                                    f"{max_used_mib} MiB): something else runs on it",
                                    "stop it (make train-stop, regenerate-stop or eval-stop, or the process "
                                    "nvidia-smi lists), then retry"))
    for row in _rows(apps_csv):
        problems.append(Problem("gpus", f"process {row[0]} ({row[1] if len(row) > 1 else '?'}) holds GPU memory",
                                f"stop it (kill {row[0]}) or wait for it to end"))
    return problems


def query_gpus(need: int, max_used_mib: int) -> list[Problem]:
    if need == 0:
        return []  # a CPU run (the embedded default) needs no GPU
    if shutil.which("nvidia-smi") is None:
        return [Problem("gpus", f"the run needs {need} GPUs but nvidia-smi is missing",
                        "make provision installs the NVIDIA userspace matching the host driver")]
    try:
        gpu = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=60, check=False)
        apps = subprocess.run(APPS_QUERY, capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return [Problem("gpus", "nvidia-smi hung for 60 s", "check the GPUs on the Proxmox host (nvidia-smi there)")]
    if gpu.returncode != 0:
        return [Problem("gpus", f"nvidia-smi failed (exit {gpu.returncode}): {(gpu.stderr or gpu.stdout).strip()}",
                        "check the driver match: make provision, then `dflash-doctor` (driver findings)")]
    return check_gpus(gpu.stdout, apps.stdout if apps.returncode == 0 else "", need, max_used_mib)


def check_stale(run_dir: Path, found: list[procs_mod.Proc], stop_hint: str) -> list[Problem]:
    """Any job process is in the way: it holds GPUs, or it writes this job's directory.

    stop_hint says how to stop one, `{job}` standing for its job (make {job}-stop)."""
    problems = []
    for p in found:
        mine = p.output_dir() == Path(os.path.abspath(run_dir))
        what = f"this {'run' if p.job is TRAIN else 'job'}" if mine else \
            f"another {'run' if p.job is TRAIN else 'job'} ({p.output_dir() or 'unknown output dir'})"
        problems.append(Problem("processes", f"{p.job.what} process {p.pid} of {what} is still running: "
                                f"{' '.join(p.argv)[:200]}",
                                f"{stop_hint.format(job=p.job.name)}, or `kill {p.pid}` (SIGTERM, graceful)"))
    return problems


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(run_dir: Path, min_free_gb: float) -> list[Problem]:
    free = shutil.disk_usage(_existing(run_dir)).free / 2**30
    if free < min_free_gb:
        return [Problem("disk", f"{free:.1f} GiB free under {run_dir}, the run needs {min_free_gb:g} GiB for "
                        "checkpoints", "free space (old runs, keep_last) or raise the mount point's size")]
    return []


def check_writable(directory: Path, what: str) -> list[Problem]:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".preflight-"):
            pass
    except OSError as exc:
        return [Problem(what, f"{directory} is not writable: {exc.strerror or exc}",
                        f"mount persistent storage there read-write, or point the {what} elsewhere")]
    return []


def mount_points(mountinfo: str) -> list[str]:
    """Mount points from /proc/self/mountinfo (field 5, octal escapes such as \\040 for a space)."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def check_persistent(run_dir: Path, mountinfo: str | None = None) -> list[Problem]:
    """The run directory must sit on its own mount point, not the root filesystem: a rebuild or a new
    container would lose it. (A bind mount shares the device with / on the host, so st_dev can't tell.)"""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    path = os.path.realpath(run_dir)  # resolves what exists, keeps the rest
    under = max((m for m in mount_points(mountinfo) if path == m or path.startswith(m.rstrip("/") + "/")),
                key=len, default="/")
    if under == "/":
        return [Problem("storage", f"{run_dir} is on the root filesystem: checkpoints would be lost with the "
                        "container", "give the container a mount point (mpN: ...,mp=<training_run_root>) or set "
                        "training_run_require_mount: false")]
    return []


def check_config(config: Path) -> list[Problem]:
    """The trainer's own loader reads the rendered config (unknown keys and bad values are its errors)."""
    try:
        from dflash_trainer.config import ConfigError, load_config
    except ImportError as exc:
        return [Problem("config", f"the trainer cannot be imported: {exc}", "make deploy (installs the trainer wheel)")]
    try:
        load_config(str(config), [])
    except (ConfigError, OSError, ValueError) as exc:
        return [Problem("config", f"{config}: {exc}", "fix the training_run_* variables in the inventory and "
                        "make deploy again")]
    return []


def check_launch(run_dir: Path, job: Job) -> list[Problem]:
    """`make deploy` wrote this job's launch.json (what the supervisor starts)."""
    problem = launch_problem(run_dir, job)
    return [] if problem is None else [Problem("launch", *problem)]


def run_all(run_dir: Path, cache_dir: Path, gpus: int, min_free_gb: float, max_used_mib: int,
            require_mount: bool, config: Path | None, stop_hint: str, job: Job | None = None) -> list[Problem]:
    """Every check; `job`: also check that job's launch.json (the containers' jobs, which deploy describes)."""
    problems = [] if job is None else check_launch(run_dir, job)
    if config is not None:
        problems += check_config(config)
    problems += query_gpus(gpus, max_used_mib)
    problems += check_stale(run_dir, procs_mod.job_processes(), stop_hint)
    problems += check_writable(run_dir, "run directory")
    problems += check_writable(cache_dir, "compile cache directory")
    problems += check_disk(run_dir, min_free_gb)
    if require_mount:
        problems += check_persistent(run_dir)
    return problems

