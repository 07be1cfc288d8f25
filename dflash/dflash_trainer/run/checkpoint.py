"""Atomic training checkpoints: a step directory appears whole or not at all.

Layout under the run's checkpoint root:

    step-00001000/        the drafter as a Hugging Face dir (written by the caller) + the training state
    step-00002000/          (training_state.safetensors + training_state.json: data, see train_state.py)
                            + checkpoint.json (the step and every file's size: a truncated file shows)
    latest -> step-00002000   a relative symlink, replaced atomically; loadable as a model dir itself

Each save writes into a hidden temporary directory inside root (same filesystem, so rename is atomic),
fsyncs the files and the directory, renames it to step-XXXXXXXX, then swaps the `latest` link. A crash
at any point leaves the previous checkpoint and `latest` intact; `latest_checkpoint` also recovers
when the link points at nothing or at a damaged directory. `inspect` + `repair` handle what copies,
kills and damaged disks leave: `latest` copied as a directory (cp -rL, scp -r), leftover temporary
files, empty or half-pruned step directories, truncated files.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..infra import storage
from ..infra.storage import fsync_path
from . import train_state

__all__ = [
    "LATEST_LINK",
    "MANIFEST_FILE",
    "TRAIN_STATE_FILE",
    "DamagedCheckpoint",
    "Inspection",
    "damaged",
    "inspect",
    "latest_checkpoint",
    "list_checkpoints",
    "load_train_state",
    "repair",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "step_dir_name",
    "step_of",
    "verify",
]

TRAIN_STATE_FILE = train_state.STATE_JSON  # its presence makes a step directory a checkpoint
MANIFEST_FILE = "checkpoint.json"
LATEST_LINK = "latest"
DAMAGED_PREFIX = "damaged-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_PREFIX = ".tmp-step-"
_LATEST_TMP = f".{LATEST_LINK}.tmp-"


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


# ---- is a step directory whole? -----------------------------------------------------------------

def _zip_problem(path: Path) -> str | None:
    """torch.save writes a zip whose directory sits at the end: a truncated file has none."""
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return f"{path.name} is not a complete torch file ({exc}: truncated?)"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """The header lists every tensor's byte range: the file must be exactly that long."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        return f"{path.name} has no readable header ({exc})"
    if 8 + length + end != size:
        return f"{path.name} is {size} bytes, its header needs {8 + length + end} (truncated)"
    return None


def _manifest_problem(step_dir: Path) -> str | None:
    try:
        files = json.loads((step_dir / MANIFEST_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({exc})"
    for name, size in files.items():
        if not (step_dir / name).is_file():
            return f"{name} is missing"
        actual = (step_dir / name).stat().st_size
        if actual != size:
            return f"{name} is {actual} bytes, the save wrote {size} (truncated or changed)"
    return None


def verify(step_dir: Path) -> str | None:
    """What is wrong with a checkpoint directory, or None when it is whole."""
    step_dir = Path(step_dir)
    if (step_dir / train_state.STATE_JSON).is_file():
        if (step_dir / MANIFEST_FILE).is_file() and (problem := _manifest_problem(step_dir)):
            return problem
        tensors = step_dir / train_state.STATE_TENSORS
        if not tensors.is_file():
            return f"{tensors.name} is missing"
        return _safetensors_problem(tensors) or train_state.json_problem(step_dir)
    legacy = step_dir / train_state.LEGACY_STATE  # written before the training state was data
    if not legacy.is_file():
        return f"{TRAIN_STATE_FILE} is missing"
    if (step_dir / MANIFEST_FILE).is_file():
        return _manifest_problem(step_dir) or _zip_problem(legacy)
    # Written before manifests existed: check what the formats themselves say.
    problem = _zip_problem(legacy)
    if problem is None and (step_dir / "model.safetensors").is_file():
        problem = _safetensors_problem(step_dir / "model.safetensors")
    if problem is None and (step_dir / "config.json").is_file():
        try:
            json.loads((step_dir / "config.json").read_text())
        except ValueError as exc:
            problem = f"config.json is not valid JSON ({exc})"
    return problem


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Step directories holding a training state under root, oldest first (never temporary ones)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry)
        if step is not None and entry.is_dir() and not entry.is_symlink() and train_state.present(entry):
            found.append((step, entry))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The step directory `latest` points to when it is whole; else the newest whole one."""
    return _latest_whole(Path(root), lambda path: verify(path) is None)


def _latest_whole(root: Path, whole: Callable[[Path], bool]) -> Path | None:
    """latest_checkpoint's choice, with `whole` saying which step directories are (inspect's verdicts)."""
    link = root / LATEST_LINK
    if link.is_symlink():
        target = (root / os.readlink(link)).resolve()
        if target.is_dir() and step_of(target) is not None and whole(target):
            return target
    for _step, path in reversed(list_checkpoints(root)):
        if whole(path):
            return path
    return None


# ---- what a run directory's checkpoints look like, and the repair --------------------------------

@dataclass
class Inspection:
    """The checkpoint root as found: what to resume from and what needs cleaning."""

    root: Path
    resume_from: Path | None = None  # the newest whole checkpoint (None: nothing to resume)
    damaged: list[tuple[Path, str]] = field(default_factory=list)  # step dirs with a problem, oldest first
    empty: list[Path] = field(default_factory=list)
    leftovers: list[Path] = field(default_factory=list)  # temporary dirs and links of killed saves
    latest_copy: Path | None = None  # `latest` as a real directory (a run copied with cp -rL / scp -r)
    latest_copy_step: int | None = None

    @property
    def resume_step(self) -> int | None:
        """The step resume_from holds (a copied `latest` says it in its files, not in its name)."""
        if self.resume_from is None:
            return None
        return self.latest_copy_step if self.resume_from == self.latest_copy else step_of(self.resume_from)

    @property
    def latest_copy_name(self) -> Path | None:
        """The step directory a copied `latest` holds (its files say which): where repair renames it to."""
        return self.root / step_dir_name(self.latest_copy_step) if self.latest_copy_step is not None else None

    @property
    def resume_dir(self) -> Path | None:
        """resume_from where repair leaves it: a copied `latest` that is the newest step is renamed to it."""
        if self.resume_from is not None and self.resume_from == self.latest_copy:
            return self.latest_copy_name
        return self.resume_from

    @property
    def anything(self) -> bool:
        return bool(self.resume_from or self.damaged or self.empty or self.latest_copy)

    def needs_repair(self) -> bool:
        link = self.root / LATEST_LINK
        stale = self.resume_from is not None and (
            not link.is_symlink() or (self.root / os.readlink(link)).resolve() != self.resume_from.resolve())
        return bool(self.damaged or self.empty or self.leftovers or self.latest_copy or stale)


def _copy_step(path: Path) -> int | None:
    try:
        return int(json.loads((path / MANIFEST_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:  # a checkpoint from before manifests: the step is in the (memory-mapped, so cheap) state
        return int(train_state.read_legacy(path / train_state.LEGACY_STATE, mmap=True)["step"])
    except (RuntimeError, OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError,
            train_state.UnsafeCheckpoint):
        return None


def _scan(found: Inspection) -> dict[Path, str | None]:
    """Sort root's entries into found's leftovers, empty and damaged; verify's answer per step directory."""
    problems: dict[Path, str | None] = {}  # resolved step directory -> what is wrong with it (None: whole)
    for entry in sorted(found.root.iterdir()):
        if entry.name.startswith((_TMP_PREFIX, _LATEST_TMP)):
            found.leftovers.append(entry)
        elif step_of(entry) is not None and entry.is_dir() and not entry.is_symlink():
            if not any(entry.iterdir()):
                found.empty.append(entry)
            else:
                problems[entry.resolve()] = problem = verify(entry)
                if problem is not None:
                    found.damaged.append((entry, problem))
    return problems


def inspect(root: str | os.PathLike) -> Inspection:
    """Every step directory verified once; what to resume from is chosen from those verdicts."""
    root = Path(root)
    found = Inspection(root)
    if not root.is_dir():
        return found
    problems = _scan(found)

    def whole(path: Path) -> bool:  # `latest` may point outside root: such a directory is verified here
        if (key := path.resolve()) not in problems:
            problems[key] = verify(path)
        return problems[key] is None

    found.resume_from = _latest_whole(root, whole)
    latest = root / LATEST_LINK
    if latest.is_dir() and not latest.is_symlink() and verify(latest) is None:
        found.latest_copy, found.latest_copy_step = latest, _copy_step(latest)
        newest = step_of(found.resume_from) if found.resume_from else -1
        if found.latest_copy_step is not None and found.latest_copy_step > newest:
            found.resume_from = latest  # the only copy of the newest step: repair renames it
    elif latest.exists() and not latest.is_symlink():
        found.leftovers.append(latest)  # a damaged copy, or a file: not a pointer to anything
    return found


def _aside(path: Path) -> Path:
    target = path.with_name(DAMAGED_PREFIX + path.name)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{DAMAGED_PREFIX}{path.name}.{n}")
    os.rename(path, target)
    return target


def _repair_latest_copy(found: Inspection, notes: list[str]) -> Path | None:
    copy, named = found.latest_copy, found.latest_copy_name
    if found.resume_from == copy and named is not None and not named.exists():
        os.rename(copy, named)
        notes.append(f"`latest` was a directory (a copy made with cp -rL or scp -r): renamed to {named.name}")
        return named
    shutil.rmtree(copy)
    notes.append("`latest` was a directory (a copy made with cp -rL or scp -r) of a step directory that "
                 "exists: replaced by a link")
    return found.resume_from


def repair(found: Inspection) -> list[str]:
    """Clean what inspect found; `latest` then links to the checkpoint to resume from. Returns what it did.

    Damaged step directories older than that checkpoint are what a killed prune left (it removes the
    oldest first): removed. Newer ones are moved aside as damaged-step-N for a look, never deleted.
    """
    notes: list[str] = []
    root, resume = found.root, found.resume_from
    for path in found.leftovers:
        storage.remove(path)
        notes.append(f"removed {path.name} (left by a save that was killed)")
    for path in found.empty:
        path.rmdir()
        notes.append(f"removed the empty {path.name}")
    resume_step = found.resume_step
    for path, problem in found.damaged:
        if resume_step is not None and step_of(path) < resume_step:
            shutil.rmtree(path)
            notes.append(f"removed {path.name}: {problem} (a prune that was killed)")
        else:
            notes.append(f"{path.name} is damaged ({problem}): moved aside to {_aside(path).name}")
    if found.latest_copy is not None:
        resume = _repair_latest_copy(found, notes)
    if resume is not None:
        _point_latest(root, resume)
    return notes


# ---- save, prune, load -----------------------------------------------------------------------------

def _point_latest(root: Path, step_dir: Path) -> None:
    tmp_link = root / f"{_LATEST_TMP}{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    tmp_link.symlink_to(step_dir.name)  # relative: the run dir can be moved or mounted elsewhere
    os.replace(tmp_link, root / LATEST_LINK)  # rename(2) over the old link is atomic
    fsync_path(root)


def _prune(root: Path, keep_last: int, protect: Path) -> None:
    checkpoints = list_checkpoints(root)
    kept = checkpoints[max(0, len(checkpoints) - keep_last):]
    oldest_kept = kept[0][0] if kept else 0
    for entry in root.iterdir():
        step = step_of(entry)
        if step is None or step >= oldest_kept or entry.is_symlink() or entry.resolve() == protect.resolve():
            continue
        # Renamed first: a kill during the removal leaves a temporary name, never a half step directory.
        doomed = root / f"{_TMP_PREFIX}{step:08d}-pruned-{os.getpid()}"
        os.rename(entry, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    # Leftovers of saves that were killed (SIGKILL skips our cleanup); only rank 0 writes here.
    for entry in root.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _write_manifest(directory: Path, step: int) -> None:
    files = {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*"))
             if p.is_file()}
    (directory / MANIFEST_FILE).write_text(json.dumps({"step": step, "files": files}, indent=1))


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    write_model: Callable[[Path], None],
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write root/step-XXXXXXXX atomically, point `latest` at it, keep the newest keep_last; return it.

    write_model(dir) writes the drafter (config.json + model.safetensors) into dir. state holds optimizer,
    scheduler, RNG (rng_state()), data position, step: tensors, numbers, strings, lists, tuples and dicts of
    them (train_state.write keeps them as data).
    Call it from one rank only. Saving a step that exists replaces it (a resumed run re-reaching it).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (it keeps the checkpoint just written), got {keep_last}")
    if not isinstance(state, dict):
        raise TypeError(f"the training state must be a dict, got {type(state).__name__}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)

    def write(tmp: Path) -> None:
        write_model(tmp)
        train_state.write(state, tmp)
        _write_manifest(tmp, step)

    # The temporary's prefix is how inspect() and _prune() recognise a killed save's leftover.
    storage.publish_dir(final, write, prefix=f"{_TMP_PREFIX}{step:08d}-")
    _point_latest(root, final)
    _prune(root, keep_last, protect=final)
    return final


class DamagedCheckpoint(RuntimeError):
    """A checkpoint whose files have the right sizes but do not load."""


def damaged(step_dir: Path, exc: BaseException) -> DamagedCheckpoint | None:
    """The error to report when loading step_dir raised exc because its bytes are bad (None: another cause)."""
    unreadable = (isinstance(exc, (EOFError, pickle.UnpicklingError, KeyError, json.JSONDecodeError))
                  or "PytorchStreamReader" in str(exc) or type(exc).__name__ == "SafetensorError")
    if not unreadable or storage.os_error_in(exc) is not None:
        return None
    aside = step_dir.parent / (DAMAGED_PREFIX + step_dir.name)
    return DamagedCheckpoint(
        f"checkpoint {step_dir} cannot be loaded ({type(exc).__name__}: {exc}): it is damaged. Move it aside "
        f"(mv {step_dir} {aside}), then --resume continues from the checkpoint before it")


def load_train_state(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The training state of a step directory (or of root's latest checkpoint when given the root): data
    only (train_state.read); an old training_state.pt that would run code is refused (UnsafeCheckpoint)."""
    path = Path(path)
    if not train_state.present(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(
                f"no {TRAIN_STATE_FILE} in {path} and no complete step-XXXXXXXX checkpoint under it; "
                "pass a step directory or the checkpoint root of a run that has saved at least once."
            )
        path = latest
    return train_state.read(path, map_location)


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
