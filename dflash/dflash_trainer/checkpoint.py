"""Atomic training checkpoints: a step directory appears whole or not at all.

Layout under the run's checkpoint root:

    step-00001000/        the drafter as a Hugging Face dir (written by the caller) + training_state.pt
    step-00002000/
    latest -> step-00002000   a relative symlink, replaced atomically; loadable as a model dir itself

Each save writes into a hidden temporary directory inside root (same filesystem, so rename is atomic),
fsyncs the files and the directory, renames it to step-XXXXXXXX, then swaps the `latest` link. A crash
at any point leaves the previous checkpoint and `latest` intact; `latest_checkpoint` also recovers
when the link points at nothing.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LATEST_LINK",
    "TRAIN_STATE_FILE",
    "latest_checkpoint",
    "list_checkpoints",
    "load_train_state",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "step_dir_name",
]

TRAIN_STATE_FILE = "training_state.pt"
LATEST_LINK = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_PREFIX = ".tmp-step-"


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    # Files first, then the directories that name them: after a power loss the rename must not
    # expose a directory whose entries or contents are still only in the page cache.
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete step directories under root, oldest first (temporary directories are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and (entry / TRAIN_STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The step directory `latest` points to; the newest complete one if the link is missing or stale."""
    root = Path(root)
    link = root / LATEST_LINK
    if link.is_symlink():
        target = (root / os.readlink(link)).resolve()
        if target.is_dir() and (target / TRAIN_STATE_FILE).is_file() and _STEP_DIR.match(target.name):
            return target
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def _point_latest(root: Path, step_dir: Path) -> None:
    tmp_link = root / f".{LATEST_LINK}.tmp-{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    tmp_link.symlink_to(step_dir.name)  # relative: the run dir can be moved or mounted elsewhere
    os.replace(tmp_link, root / LATEST_LINK)  # rename(2) over the old link is atomic
    _fsync_path(root)


def _prune(root: Path, keep_last: int, protect: Path) -> None:
    checkpoints = list_checkpoints(root)
    for _step, path in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        if path.resolve() != protect.resolve():
            shutil.rmtree(path, ignore_errors=True)
    # Leftovers of saves that were killed (SIGKILL skips our cleanup); only rank 0 writes here.
    for entry in root.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    write_model: Callable[[Path], None],
    train_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write root/step-XXXXXXXX atomically, point `latest` at it, keep the newest keep_last; return it.

    write_model(dir) writes the drafter (config.json + model.safetensors) into dir. train_state holds
    optimizer, scheduler, RNG (rng_state()), data position, step, anything torch.save can pickle.
    Call it from one rank only. Saving a step that exists replaces it (a resumed run re-reaching it).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (it keeps the checkpoint just written), got {keep_last}")
    if not isinstance(train_state, dict):
        raise TypeError(f"train_state must be a dict, got {type(train_state).__name__}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:08d}-", dir=root))
    try:
        write_model(tmp)
        torch.save(train_state, tmp / TRAIN_STATE_FILE)
        _fsync_tree(tmp)
        if final.exists():
            # rename(2) cannot replace a non-empty directory: move the old one aside first. A crash in
            # between leaves `latest` stale; latest_checkpoint then falls back to the newest complete dir.
            old = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:08d}-old-", dir=root))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _point_latest(root, final)
    _prune(root, keep_last, protect=final)
    return final


def load_train_state(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """training_state.pt of a step directory (or of root's latest checkpoint when given the root).

    Uses weights_only=False: the file holds arbitrary picklable state (scheduler, python RNG), so only
    load checkpoints you wrote.
    """
    path = Path(path)
    if not (path / TRAIN_STATE_FILE).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(
                f"no {TRAIN_STATE_FILE} in {path} and no complete step-XXXXXXXX checkpoint under it; "
                "pass a step directory or the checkpoint root of a run that has saved at least once."
            )
        path = latest
    return torch.load(path / TRAIN_STATE_FILE, map_location=map_location, weights_only=False)


def rng_state() -> dict[str, Any]:
    """Python, numpy (when installed), torch CPU and every visible CUDA device's RNG state."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() captured; a CUDA state for a different device count is an error."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state:
        saved = state["cuda"]
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(saved) != visible:
            raise RuntimeError(
                f"the checkpoint holds CUDA RNG states for {len(saved)} device(s) but this process sees "
                f"{visible}; resume with the same GPUs per process (CUDA_VISIBLE_DEVICES) as the saving run."
            )
        torch.cuda.set_rng_state_all([s.cpu() for s in saved])
