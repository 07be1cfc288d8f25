"""The output directory: `part-*.jsonl` shards written atomically, the settings they were made with, the summary.

A shard appears under its final name only when it is complete (written to a hidden temporary file,
fsynced, renamed), so a killed run leaves whole shards and loses only the one in progress. Its name
says which chunk of the sorted jobs it holds and hashes the keys inside, so a resumed run writes the
same names as an uninterrupted one and never overwrites a shard. `regenerate.json` pins what every
shard was made with: a second run into the same directory must use the same target and settings.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ..data import DataError

MANIFEST = "regenerate.json"
SUMMARY = "summary.json"


class OutputDir:
    def __init__(self, path: str | Path, rank: int = 0):
        self.path = Path(path)
        self.rank = rank
        self._lock: FileLock | None = None

    # -- setup -------------------------------------------------------------------------------------
    def check_or_create(self, manifest: dict) -> None:
        """Create the directory with its manifest, or check that an existing one was made the same way."""
        file = self.path / MANIFEST
        if self.path.exists() and not self.path.is_dir():
            raise DataError(f"--out {self.path} exists and is not a directory")
        if file.is_file():
            before = json.loads(file.read_text())
            changed = {k: (before.get(k), v) for k, v in manifest.items() if before.get(k) != v}
            if changed:
                lines = "; ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items())
                raise DataError(f"{self.path} holds answers made differently ({lines}). Run with the same "
                                "settings to resume it, or give another --out")
            return
        if self.path.is_dir() and any(self.path.glob("part-*.jsonl")):
            raise DataError(f"{self.path} holds part-*.jsonl shards but no {MANIFEST}: not a regeneration "
                            "output; give another --out")
        if self.rank == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            _write_atomic(file, json.dumps(manifest, indent=2) + "\n")

    def lock(self) -> None:
        """One writer per rank: a second command on the same directory is refused, not interleaved."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(self.path / f".rank{self.rank}.lock")
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise DataError(f"another dflash-regenerate (rank {self.rank}) is writing {self.path}; wait for it or "
                            "give another --out") from None

    def clean_partial(self) -> int:
        """Remove shards a killed run left half-written (hidden temporaries); the lead rank does it before work."""
        stale = list(self.path.glob(".*.tmp"))
        for f in stale:
            f.unlink()
        return len(stale)

    # -- shards ------------------------------------------------------------------------------------
    def shards(self) -> list[Path]:
        return sorted(self.path.glob("part-*.jsonl"))

    def rows(self) -> Iterator[dict]:
        for shard in self.shards():
            with open(shard) as f:
                for n, line in enumerate(f, 1):
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{shard} line {n} is not JSON ({exc}): the file was changed after it was "
                                        "written; move it out of the directory and run again") from None

    def done_keys(self) -> set[str]:
        return {row["regen"]["key"] for row in self.rows()}

    def write_shard(self, chunk: int, rows: list[dict]) -> Path:
        digest = hashlib.sha256("".join(r["regen"]["key"] for r in rows).encode()).hexdigest()[:8]
        final = self.path / f"part-{chunk:06d}-{digest}.jsonl"
        _write_atomic(final, "".join(json.dumps(r) + "\n" for r in rows))
        return final

    def write_summary(self, summary: dict) -> Path:
        file = self.path / SUMMARY
        _write_atomic(file, json.dumps(summary, indent=2) + "\n")
        return file


def _write_atomic(final: Path, text: str) -> None:
    tmp = final.with_name(f".{final.stem}.{os.getpid()}.tmp" if final.name.startswith("part-")
                          else f".{final.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)
