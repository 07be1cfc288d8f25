"""Atomic checkpoints: a crash mid-save leaves nothing half-written, `latest` moves only on success."""

from __future__ import annotations

import json
import os
import pickle
import random

import pytest
import torch
from dflash_trainer.run.checkpoint import (
    LATEST_LINK,
    TRAIN_STATE_FILE,
    latest_checkpoint,
    list_checkpoints,
    load_train_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def write_tiny_model(tag: str):
    def write(directory):
        (directory / "config.json").write_text(json.dumps({"tag": tag}))
        (directory / "model.safetensors").write_bytes(b"weights-" + tag.encode())

    return write


def test_save_writes_model_state_and_latest(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"step": 10, "optimizer": opt.state_dict(), "data_position": {"epoch": 0, "index": 40}}
    path = save_checkpoint(tmp_path, 10, write_tiny_model("a"), state, keep_last=3)
    assert path == tmp_path / "step-00000010"
    assert json.loads((path / "config.json").read_text()) == {"tag": "a"}
    assert os.readlink(tmp_path / LATEST_LINK) == "step-00000010"  # relative link
    assert latest_checkpoint(tmp_path) == path.resolve()
    loaded = load_train_state(tmp_path)  # the root resolves to latest
    assert loaded["step"] == 10 and loaded["data_position"] == {"epoch": 0, "index": 40}
    torch.testing.assert_close(
        loaded["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_step_directory_has_the_permissions_mkdir_gives(tmp_path):
    """Not mkdtemp's 0700: a serving engine or a colleague under another uid reads the checkpoints."""
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path, 1, write_tiny_model("a"), {"step": 1}, keep_last=1)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755


def test_crash_inside_write_model_leaves_no_partial_dir_and_keeps_latest(tmp_path):
    first = save_checkpoint(tmp_path, 1, write_tiny_model("a"), {"step": 1}, keep_last=2)

    def crashing_writer(directory):
        (directory / "config.json").write_text("{}")
        raise OSError("disk full while writing model.safetensors")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, crashing_writer, {"step": 2}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_LINK, "step-00000001"]
    assert latest_checkpoint(tmp_path) == first.resolve()
    assert load_train_state(tmp_path)["step"] == 1


def test_unpicklable_state_fails_before_the_rename(tmp_path):
    save_checkpoint(tmp_path, 1, write_tiny_model("a"), {"step": 1}, keep_last=2)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):  # the type varies by Python
        save_checkpoint(tmp_path, 2, write_tiny_model("b"), {"step": 2, "bad": lambda: 0}, keep_last=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    assert latest_checkpoint(tmp_path).name == "step-00000001"


def test_keep_last_prunes_oldest_and_resave_replaces(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, write_tiny_model(str(step)), {"step": step}, keep_last=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 4]
    # A resumed run that reaches step 4 again replaces it whole.
    save_checkpoint(tmp_path, 4, write_tiny_model("again"), {"step": 4, "again": True}, keep_last=2)
    assert json.loads((tmp_path / "step-00000004" / "config.json").read_text()) == {"tag": "again"}
    assert load_train_state(tmp_path)["again"] is True
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        save_checkpoint(tmp_path, 5, write_tiny_model("x"), {}, keep_last=0)


def test_stale_latest_link_and_leftover_tmp_dirs(tmp_path):
    save_checkpoint(tmp_path, 1, write_tiny_model("a"), {"step": 1}, keep_last=5)
    save_checkpoint(tmp_path, 2, write_tiny_model("b"), {"step": 2}, keep_last=5)
    (tmp_path / LATEST_LINK).unlink()
    (tmp_path / LATEST_LINK).symlink_to("step-00000099")  # e.g. a crash between two renames
    (tmp_path / ".tmp-step-00000003-killed").mkdir()  # a save killed by SIGKILL
    (tmp_path / "step-00000003").mkdir()  # a dir without a training state is not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step-00000002"
    save_checkpoint(tmp_path, 4, write_tiny_model("c"), {"step": 4}, keep_last=5)
    assert not (tmp_path / ".tmp-step-00000003-killed").exists()
    assert latest_checkpoint(tmp_path).name == "step-00000004"


def test_empty_root_and_missing_state(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(FileNotFoundError, match="no complete step-XXXXXXXX"):
        load_train_state(tmp_path)
    assert TRAIN_STATE_FILE == "training_state.json"


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1)
    torch.manual_seed(1)
    saved = rng_state()
    save_checkpoint(tmp_path, 7, write_tiny_model("a"), {"rng": saved}, keep_last=1)
    expected = (random.random(), torch.rand(3))
    random.seed(999)
    torch.manual_seed(999)
    set_rng_state(load_train_state(tmp_path)["rng"])
    again = (random.random(), torch.rand(3))
    assert again[0] == expected[0]
    torch.testing.assert_close(again[1], expected[1])
    if "numpy" in saved:
        import numpy as np

        set_rng_state(saved)
        first = np.random.rand()
        set_rng_state(saved)
        assert np.random.rand() == first


def test_cuda_rng_device_count_mismatch_is_explained():
    state = rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 9
    with pytest.raises(RuntimeError, match="CUDA RNG states for 9 device"):
        set_rng_state(state)


def _train(steps: int, root, resume: bool, stop_after: int | None = None) -> list[float]:
    """A tiny loop with everything resume must restore: weights, AdamW, LR schedule, dropout RNG, data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    start = 0
    if resume and (latest := latest_checkpoint(root)) is not None:
        state = load_train_state(latest)
        model.load_state_dict(torch.load(latest / "model.pt", weights_only=True))
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start = state["data_position"]
    losses = []
    for step in range(start, steps):
        x = data[(step * 4) % 64 : (step * 4) % 64 + 4]
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state(),
                 "data_position": step + 1}
        save_checkpoint(root, step + 1, lambda d: torch.save(model.state_dict(), d / "model.pt"), state, 2)
        if stop_after is not None and step + 1 == stop_after:
            break
    return losses


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    straight = _train(8, tmp_path / "a", resume=False)
    first = _train(8, tmp_path / "b", resume=False, stop_after=3)
    rest = _train(8, tmp_path / "b", resume=True)
    assert first + rest == straight  # bit for bit: dropout masks, LR and AdamW moments all restored


# ---- damaged directories: verify, inspect, repair ------------------------------------------------

def save_real(root, step: int, keep_last: int = 10):
    from safetensors.torch import save_file

    return save_checkpoint(root, step, lambda d: save_file({"w": torch.ones(64)}, d / "model.safetensors"),
                           {"step": step, "blob": torch.zeros(256)}, keep_last=keep_last)


def test_manifest_catches_truncation_and_old_checkpoints_are_checked_by_format(tmp_path):
    from dflash_trainer.run.checkpoint import MANIFEST_FILE, verify

    path = save_real(tmp_path, 1)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["step"] == 1 and set(manifest["files"]) == {"model.safetensors", TRAIN_STATE_FILE,
                                                               "training_state.safetensors"}
    assert verify(path) is None
    tensors = (path / "training_state.safetensors").read_bytes()
    (path / "training_state.safetensors").write_bytes(tensors[:-10])
    assert "training_state.safetensors is" in verify(path) and "truncated" in verify(path)
    (path / "training_state.safetensors").write_bytes(tensors)
    (path / MANIFEST_FILE).unlink()  # without a manifest the formats speak for themselves
    assert verify(path) is None
    (path / "training_state.safetensors").write_bytes(tensors[:-10])
    assert "training_state.safetensors is" in verify(path) and "(truncated)" in verify(path)
    (path / "training_state.safetensors").write_bytes(tensors)
    (path / TRAIN_STATE_FILE).write_text('{"format": 1, "sta')
    assert "training_state.json is not readable JSON" in verify(path)


def test_old_checkpoints_are_checked_by_format(tmp_path):
    """Written before the state was data (training_state.pt) and before manifests."""
    from dflash_trainer.run.checkpoint import MANIFEST_FILE, verify

    path = save_real(tmp_path, 1)
    for name in (TRAIN_STATE_FILE, "training_state.safetensors", MANIFEST_FILE):
        (path / name).unlink()
    torch.save({"step": 1, "blob": torch.zeros(256)}, path / "training_state.pt")
    assert verify(path) is None and [s for s, _ in list_checkpoints(tmp_path)] == [1]
    data = (path / "training_state.pt").read_bytes()
    weights = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(weights[:-4])
    assert "model.safetensors is" in verify(path) and "(truncated)" in verify(path)
    (path / "model.safetensors").write_bytes(weights)
    (path / "training_state.pt").write_bytes(data[: len(data) // 2])
    assert "not a complete torch file" in verify(path)


def test_latest_skips_a_damaged_checkpoint(tmp_path):
    save_real(tmp_path, 1)
    second = save_real(tmp_path, 2)
    (second / "model.safetensors").write_bytes(b"x")
    assert latest_checkpoint(tmp_path).name == "step-00000001"  # `latest` points at step 2, which is damaged


def test_inspect_and_repair(tmp_path):
    from dflash_trainer.run.checkpoint import inspect, repair

    for step in (1, 2, 3, 4):
        save_real(tmp_path, step)
    (tmp_path / "step-00000001" / TRAIN_STATE_FILE).unlink()  # half-pruned
    (tmp_path / "step-00000004" / "model.safetensors").write_bytes(b"short")  # damaged newest
    (tmp_path / "step-00000005").mkdir()  # empty
    (tmp_path / ".latest.tmp-99").symlink_to("step-00000003")
    found = inspect(tmp_path)
    assert found.resume_from.name == "step-00000003" and found.needs_repair()
    assert [p.name for p, _ in found.damaged] == ["step-00000001", "step-00000004"]
    notes = repair(found)
    assert any("removed step-00000001" in n for n in notes) and any("moved aside" in n for n in notes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "damaged-step-00000004", "latest", "step-00000002", "step-00000003"]
    assert os.readlink(tmp_path / LATEST_LINK) == "step-00000003"
    assert not inspect(tmp_path).needs_repair()


def test_prune_renames_before_it_removes(tmp_path, monkeypatch):
    """A kill inside the prune leaves a temporary name (removed by the next save), never a half step dir."""
    import shutil

    from dflash_trainer.run import checkpoint

    for step in (1, 2):
        save_real(tmp_path, step, keep_last=5)
    removed, rmtree = [], shutil.rmtree
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda p, **kw: removed.append(p.name))  # killed here
    save_real(tmp_path, 3, keep_last=2)
    assert removed[0].startswith(".tmp-step-00000001-pruned")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    save_real(tmp_path, 4, keep_last=2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_inspect_verifies_each_step_directory_once(tmp_path, monkeypatch):
    """`latest` at a damaged step: the choice falls back to the newest whole one on the verdicts the scan
    made (it used to verify the link's target and every candidate again); a copied `latest` is one more."""
    import shutil

    from dflash_trainer.run import checkpoint

    for step in (1, 2, 3):
        save_real(tmp_path, step)
    weights = tmp_path / "step-00000003" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(b"short")
    real, verified = checkpoint.verify, []
    monkeypatch.setattr(checkpoint, "verify", lambda step_dir: verified.append(step_dir.name) or real(step_dir))
    found = checkpoint.inspect(tmp_path)
    assert sorted(verified) == ["step-00000001", "step-00000002", "step-00000003"]
    assert [(p.name, problem) for p, problem in found.damaged] == [
        ("step-00000003", f"model.safetensors is 5 bytes, the save wrote {size} (truncated or changed)")]
    assert found.resume_from.name == "step-00000002" and found.resume_step == 2

    (tmp_path / LATEST_LINK).unlink()
    shutil.copytree(tmp_path / "step-00000002", tmp_path / LATEST_LINK)  # as cp -rL leaves it
    shutil.rmtree(tmp_path / "step-00000002")
    verified.clear()
    found = checkpoint.inspect(tmp_path)
    assert sorted(verified) == [LATEST_LINK, "step-00000001", "step-00000003"]
    assert found.resume_from == tmp_path / LATEST_LINK and found.resume_step == 2
    assert found.resume_dir == tmp_path / "step-00000002"  # where repair renames it
    checkpoint.repair(found)
    assert (found.resume_dir / TRAIN_STATE_FILE).is_file()
