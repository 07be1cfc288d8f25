"""The output directory: `part-*.jsonl` shards written atomically, the settings they were made with, the summary.

A shard appears under its final name only when it is complete (written to a hidden temporary file,
fsynced, renamed), so a killed run leaves whole shards and loses only the one in progress. Its name
says which chunk of the sorted jobs it holds and hashes the keys inside, so a resumed run writes the
same names as an uninterrupted one and never overwrites a shard. `regenerate.json` pins what every
shard was made with: a second run into the same directory must use the same target and settings.
The rows there are read once per run, at its start; the summary's figures are kept from that read and
from the rows this process writes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from dflash_run.jobs import REGENERATE, other_job_problem
from filelock import FileLock, Timeout

from ..data.rows import DataError
from ..infra import storage
from .summary import Figures

MANIFEST = "regenerate.json"
SUMMARY = "summary.json"
FINGERPRINT = "target_fingerprint"  # the manifest's key for target_content_hash(): the target by content, not path


class OutputDir:
    def __init__(self, path: str | Path, rank: int = 0):
        self.path = Path(path)
        self.rank = rank
        self._lock: FileLock | None = None
        self.found = Figures()  # the rows there at the start (done_keys)
        self.added = Figures()  # the rows this process wrote since (write_shard)

    # -- setup -------------------------------------------------------------------------------------
    def check_or_create(self, manifest: dict) -> None:
        """Create the directory with its manifest, or check that an existing one was made the same way."""
        file = self.path / MANIFEST
        if self.path.exists() and not self.path.is_dir():
            raise DataError(f"--out {self.path} exists and is not a directory")
        if file.is_file():
            try:
                before = json.loads(file.read_text())
            except ValueError as exc:
                raise DataError(f"{file} is damaged ({exc}): a run was cut off while writing it, or it was edited. "
                                f"Move {self.path} aside and run again into a new --out") from None
            if not isinstance(before, dict):
                raise DataError(f"{file} is not a JSON object: it is damaged. Move {self.path} aside and run again "
                                "into a new --out")
            if lines := _differences(before, manifest):
                raise DataError(f"{self.path} holds answers made differently ({lines}). Run with the same "
                                "settings to resume it, or give another --out")
            return
        if self.path.is_dir() and any(self.path.glob("part-*.jsonl")):
            raise DataError(f"{self.path} holds part-*.jsonl shards but no {MANIFEST}: not a regeneration "
                            "output; give another --out")
        if self.rank == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            self._write(file, json.dumps(manifest, indent=2) + "\n")

    def check_writable(self) -> None:
        """Before the weights load: --out, or the directory it will be made in, takes files (nothing is created),
        and holds no other job's output (a training run's summary.json would be replaced by this one's)."""
        if problem := other_job_problem(self.path, REGENERATE):
            raise DataError(problem)
        try:
            storage.check_can_create(self.path, "--out")
        except ValueError as exc:
            raise DataError(str(exc)) from None

    def lock(self) -> None:
        """One writer per rank: a second command on the same directory is refused, not interleaved."""
        if self.path.exists() and not self.path.is_dir():
            raise DataError(f"--out {self.path} exists and is not a directory: give a directory")
        self._lock = FileLock(self.path / f".rank{self.rank}.lock")
        try:
            with storage.explained(f"cannot write to --out {self.path}", self.path,
                                   "Give a writable --out (or make this one writable)"):
                self.path.mkdir(parents=True, exist_ok=True)
                self._lock.acquire(timeout=0)
        except Timeout:
            raise DataError(f"another dflash-regenerate (rank {self.rank}) is writing {self.path}; wait for it or "
                            "give another --out") from None

    def clean_partial(self) -> int:
        """Remove shards a killed run left half-written (hidden temporaries); the lead rank does it before work."""
        # storage.write_text_atomic's temporaries, and the .NAME.PID.tmp ones that earlier versions wrote
        stale = list(self.path.glob(".*.tmp-*")) + list(self.path.glob(".*.tmp"))
        for f in stale:
            f.unlink()
        return len(stale)

    # -- shards ------------------------------------------------------------------------------------
    def shards(self) -> list[Path]:
        return sorted(self.path.glob("part-*.jsonl"))

    def rows(self) -> Iterator[tuple[Path, int, dict]]:
        """Every row there, with its shard and line number."""
        for shard in self.shards():
            with open(shard) as f:
                for n, line in enumerate(f, 1):
                    try:
                        yield shard, n, json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{shard} line {n} is not JSON ({exc}): the file was changed after it was "
                                        "written; move it out of the directory and run again") from None

    def done_keys(self) -> set[str]:
        """The keys the shards there answer, in the run's one read of them: their rows' figures are kept
        in `found` for the summary."""
        keys, found = set(), Figures()
        for shard, n, row in self.rows():
            try:
                keys.add(row["regen"]["key"])
            except (KeyError, TypeError):
                raise DataError(f"{self.path} holds a part-*.jsonl row without regen.key: not a regeneration row "
                                f"(a file copied in?). Move it out of {self.path} and run again") from None
            try:
                found.add(row["regen"])
            except (KeyError, TypeError) as exc:
                what = f"no regen.{exc.args[0]}" if isinstance(exc, KeyError) else "a regen statistic of the wrong type"
                raise DataError(f"{shard} line {n} has {what}: not a regeneration row (edited, or made by "
                                f"another tool?). Move it out of {self.path} and run again") from None
        self.found = found
        return keys

    def drop_answers_not_in(self, keys: set[str]) -> int:
        """Remove the rows whose key is not in `keys` (the source's prompts now): answers to prompts edited or
        removed since they were written, which would otherwise stay beside the new answers. Each shard holding
        some is replaced whole under its own name (which no later shard can take: its name hashes the dropped
        keys too), or removed when none of its rows is left. Returns the rows dropped."""
        dropped = 0
        for shard in self.shards():
            lines = shard.read_text().splitlines(keepends=True)
            kept = [line for line in lines if _key_of(shard, line) in keys]
            if len(kept) == len(lines):
                continue
            dropped += len(lines) - len(kept)
            with storage.explained(f"rewriting {shard}", self.path, "Free space (or give another --out) and run "
                                   "the same command again"):
                if kept:
                    storage.write_text_atomic(shard, "".join(kept))
                else:
                    shard.unlink()
        return dropped

    def write_shard(self, chunk: int, rows: list[dict]) -> Path:
        digest = hashlib.sha256("".join(r["regen"]["key"] for r in rows).encode()).hexdigest()[:8]
        final = self.path / f"part-{chunk:06d}-{digest}.jsonl"
        self._write(final, "".join(json.dumps(r) + "\n" for r in rows))
        for r in rows:  # on disk now: counted without reading it back
            self.added.add(r["regen"])
        return final

    def write_summary(self, summary: dict) -> Path:
        file = self.path / SUMMARY
        self._write(file, json.dumps(summary, indent=2) + "\n")
        return file

    def _write(self, file: Path, text: str) -> None:
        """Atomically (a temporary beside it, fsynced, renamed); a failed write leaves no temporary behind."""
        with storage.explained(f"writing {file}", self.path, "Free space (or give another --out) and run the same "
                               "command again: the answered shards are kept"):
            storage.write_text_atomic(file, text)



def _differences(before: dict, manifest: dict) -> str:
    """What differs between the manifest there and this run's, in words ("" when nothing does)."""
    changed = {k: (before.get(k), v) for k, v in manifest.items() if before.get(k) != v}
    if before.get(FINGERPRINT) is None:  # written before targets were fingerprinted: the path decides
        changed.pop(FINGERPRINT, None)
    elif FINGERPRINT not in changed:  # the same target (its files' contents), moved or copied elsewhere
        changed.pop("target", None)
    lines = [f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items() if k != FINGERPRINT]
    if FINGERPRINT in changed:  # two hashes say nothing to a reader: what they stand for
        lines.append("the target's files (config, tokenizer or weights) are not those the answers were made with")
    return "; ".join(lines)


def _key_of(shard: Path, line: str) -> str | None:
    try:
        return json.loads(line)["regen"]["key"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{shard} holds a row that is not a regeneration row with a regen.key (edited, or a file "
                        "copied in?): move it out of the directory and run again") from None


# The files of a model directory read in full for its fingerprint; of the others (weights), the size and the first
# and last MiB: enough to tell another checkpoint of the same shape, without reading gigabytes.
_SMALL = 1 << 20


def target_content_hash(target: str) -> str | None:
    """A hash of the target directory's files (names, sizes, contents; of large files their ends): the same for a
    byte-identical copy anywhere, so a moved target resumes its regeneration. None for a hub name."""
    root = Path(target)
    if not root.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(root).parts)):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(file, "rb") as f:
            if size <= 2 * _SMALL:
                digest.update(f.read())
            else:
                digest.update(f.read(_SMALL))
                f.seek(-_SMALL, 2)
                digest.update(f.read())
    return digest.hexdigest()
