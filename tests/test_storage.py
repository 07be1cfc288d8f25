"""The run's writes: a published file or directory replaces the old one whole; failed writes are said in words."""

from __future__ import annotations

import errno

import pytest
from dflash_trainer.infra import storage

from tests.helpers.mounts import tmpfs


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


def test_publish_file_replaces_the_file_in_one_step_and_a_failed_write_leaves_the_old_one(tmp_path):
    final = tmp_path / "shard.bin"
    storage.publish_file(final, lambda tmp: tmp.write_bytes(b"old"))
    storage.publish_file(final, lambda tmp: tmp.write_bytes(b"new"))
    assert final.read_bytes() == b"new" and oct(final.stat().st_mode & 0o777) == oct(0o666 & ~storage._umask())

    def fails(tmp):
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        storage.publish_file(final, fails)
    assert final.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


def test_dumped_features_read_back_and_a_full_disk_is_said_in_words(tmp_path):
    import torch
    from dflash_trainer.data import features

    batch = {"features": torch.arange(24, dtype=torch.bfloat16).view(2, 3, 4).transpose(1, 2),  # not contiguous
             "input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}
    root = tmp_path / "feats"
    features.write_shard(root, 0, batch)
    features.write_meta(root, "t", [1, 3], 1, 2)
    shards = features.FeatureShards(root)
    assert all(torch.equal(shards.load(5, "cpu")[k], v) for k, v in batch.items())
    assert sorted(p.name for p in root.iterdir()) == ["mb-00000000.safetensors", "meta.json"]
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        big = {"features": torch.zeros(2**19)}  # 2 MiB into 1 MiB
        with pytest.raises(storage.StorageError, match=rf"writing features to {mnt / 'feats'}: disk full \(no space "
                                                       r"left on device\), [\d.,]+ MiB free there\. Free space"):
            features.write_shard(mnt / "feats", 0, big)
        assert list((mnt / "feats").iterdir()) == []  # no temporary, no half shard


def test_published_files_are_readable_by_other_users_as_open_would_make_them(tmp_path):
    """safetensors writes its file 0600 and mkstemp/mkdtemp make 0600/0700: a server running as another user
    could not read the weights. Published files get open()'s and mkdir's permissions (umask respected)."""
    import torch
    from safetensors.torch import save_file

    def weights(directory):
        (directory / "sub").mkdir(mode=0o700)
        save_file({"w": torch.zeros(2)}, str(directory / "sub" / "model.safetensors"))

    final = storage.publish_dir(tmp_path / "drafter", weights)
    single = storage.publish_file(tmp_path / "one.safetensors", lambda tmp: save_file({"w": torch.zeros(2)}, str(tmp)))
    umask = storage._umask()
    assert oct((final / "sub" / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert oct(single.stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert oct((final / "sub").stat().st_mode & 0o777) == oct(0o777 & ~umask)
