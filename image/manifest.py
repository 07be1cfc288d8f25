"""The build manifest of a venv: every file's sha256 and every link's target, written when the venv is built.

A wheel's RECORD sits inside the venv, so whatever rewrites a file can rewrite its RECORD line too (an
installer does, a careful hand can). The manifest is written by the rebuild (image build, `make rebuild`,
the training_venv role) right after the hash-checked offline install from the lock, and kept outside
the venv, beside it: /opt/venv -> /opt/venv.manifest.json. The doctor compares the venv with it.
One exception: packages installed from a local wheel (the trainer, whose wheel `make deploy` may
install again, a newer one) are listed as replaceable, and the doctor checks those against their RECORD.
Standard library only: the rebuild runs under a bare system Python.
"""

from __future__ import annotations

import csv
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_image.digest import sha256_of

FORMAT = 1


class ManifestError(ValueError):
    """The manifest is missing or not one this code wrote."""


def path_for(venv: str | Path) -> Path:
    """Where the manifest of `venv` lives: beside it, never inside."""
    venv = Path(os.path.abspath(venv))
    return venv.with_name(venv.name + ".manifest.json")


def snapshot(venv: Path) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:
    """(files: relative path -> (sha256, size), links: relative path -> target) of everything under venv."""
    files, links = [], {}
    for root, dirs, names in os.walk(venv):
        for name in [*dirs, *names]:
            path = Path(root) / name
            rel = path.relative_to(venv).as_posix()
            if path.is_symlink():
                links[rel] = os.readlink(path)
            elif name in names:
                files.append(rel)
    with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 2) * 2)) as pool:
        digests = pool.map(lambda rel: (sha256_of(venv / rel), (venv / rel).stat().st_size), files)
        return dict(zip(files, digests, strict=True)), links


def replaceable(venv: Path) -> list[str]:
    """Files (relative to venv) of the packages installed from a local wheel: those with a direct_url.json,
    which an installer writes for a file it was given, never for one from an index or a --find-links folder."""
    out = set()
    for direct_url in venv.glob("lib/python*/site-packages/*.dist-info/direct_url.json"):
        site = direct_url.parent.parent
        with open(direct_url.parent / "RECORD", newline="") as f:
            for row in csv.reader(f):
                if row:
                    out.add(Path(os.path.relpath(os.path.normpath(site / row[0]), venv)).as_posix())
    return sorted(out)


def write(venv: Path, lock_sha256: str) -> Path:
    """Record the venv as it is now (call it right after a clean build); returns the manifest's path."""
    files, links = snapshot(venv)
    body = {"format": FORMAT, "lock_sha256": lock_sha256, "replaceable": replaceable(venv),
            "files": {rel: list(entry) for rel, entry in sorted(files.items())}, "links": dict(sorted(links.items()))}
    dest = path_for(venv)
    part = dest.with_name(dest.name + ".part")
    part.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    part.rename(dest)
    return dest


def load(path: Path) -> dict:
    """The manifest at `path`: {"lock_sha256", "files": {rel: (sha256, size)}, "links": {rel: target},
    "replaceable": {rel}}."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ManifestError(f"no build manifest at {path}") from exc
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path} is not a readable build manifest ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        raise ManifestError(f"{path} is not a build manifest of format {FORMAT}")
    return {"lock_sha256": data.get("lock_sha256"), "links": data.get("links") or {},
            "replaceable": set(data.get("replaceable") or ()),
            "files": {rel: (entry[0], int(entry[1])) for rel, entry in data["files"].items()}}
