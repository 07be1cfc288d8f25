"""The run's writes: a published directory replaces the old one whole; failed writes are said in words."""

from __future__ import annotations

import errno

import pytest
from dflash_trainer import storage


def write_files(**files):
    def write(directory):
        for name, text in files.items():
            (directory / name).write_text(text)

    return write


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_publish_dir_replaces_the_old_directory_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(storage, "_exchange", lambda a, b: False)  # file systems without RENAME_EXCHANGE
    final = tmp_path / "drafter"
    storage.publish_dir(final, write_files(a="old", b="old"))
    storage.publish_dir(final, write_files(a="new"))
    assert sorted(p.name for p in final.iterdir()) == ["a"] and (final / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temporary or old directory left
    assert oct(final.stat().st_mode & 0o777) == oct(0o777 & ~storage._umask())


def test_a_failed_publish_leaves_the_old_directory(tmp_path):
    final = tmp_path / "drafter"
    storage.publish_dir(final, write_files(a="old"))

    def fails(directory):
        (directory / "a").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        storage.publish_dir(final, fails)
    assert (final / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def raise_inside(exc: BaseException, fix: str = "Fix it.") -> None:
    with storage.explained("saving x", storage.Path("/"), fix):
        raise exc


def test_errors_in_words():
    full = r"saving x: disk full \(no space left on device\), .* MiB free there. Free space."
    with pytest.raises(storage.StorageError, match=full):  # safetensors' own error type, errno in its text
        raise_inside(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
                     "Free space.")
    with pytest.raises(storage.StorageError, match="saving x: read-only file system. Fix it."):
        raise_inside(OSError(errno.EROFS, "Read-only file system"))
    with pytest.raises(KeyError):  # not a storage problem: passes through
        raise_inside(KeyError("x"))
