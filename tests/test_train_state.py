"""A checkpoint's training state is data: safetensors + JSON, exact on the way back; an old training_state.pt
loads through torch's weights-only unpickler, and one that would run code is refused without running it."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from dflash_trainer.model.optim import MasterWeightAdamW, warmup_cosine
from dflash_trainer.run import checkpoint as ckpt
from dflash_trainer.run import train_state


def real_state() -> dict:
    """What train.save_checkpoint hands over: the optimizer (fp32 masters of bf16 weights, AdamW moments), the
    schedule, every RNG, the step and data position, a config and the losses so far."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).bfloat16()
    opt = MasterWeightAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = warmup_cosine(opt.opt, 10, 2, 0.1)
    for _ in range(2):
        model(torch.randn(2, 4).bfloat16()).float().sum().backward()
        opt.step()
        scheduler.step()
    random.random(), np.random.rand(), torch.rand(1)
    return {"optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(), "rng": ckpt.rng_state(),
            "step": 2, "data_position": 8, "config": {"train": {"lr": 1e-3, "dtype": "bfloat16"}, "x": None},
            "losses": [2.5, float("inf"), 1.25]}


def assert_same(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_the_state_comes_back_exactly_and_the_files_are_data(tmp_path):
    state = real_state()
    train_state.write(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["training_state.json", "training_state.safetensors"]
    skeleton = json.loads((tmp_path / "training_state.json").read_text())  # plain JSON: readable by anything
    assert skeleton["state"]["step"] == 2 and skeleton["state"]["config"]["train"]["dtype"] == "bfloat16"
    back = train_state.read(tmp_path)
    assert_same(state, back)  # int keys (the optimizer's param ids), tuples (the Python RNG), numpy arrays
    ckpt.set_rng_state(back["rng"])  # the RNGs restored from the files draw what the saved ones would have
    drawn = (random.random(), float(np.random.rand()), torch.rand(3))
    ckpt.set_rng_state(state["rng"])
    assert_same(drawn, (random.random(), float(np.random.rand()), torch.rand(3)))


def test_what_is_not_data_is_refused_when_saving(tmp_path):
    with pytest.raises(TypeError, match=r"training state state.extra: a function is not data"):
        train_state.write({"step": 1, "extra": lambda: 0}, tmp_path)


def test_an_old_training_state_pt_loads_with_the_weights_only_unpickler(tmp_path):
    """What earlier versions wrote (torch.save of the same dict, the numpy RNG pickled as an array) resumes."""
    state = real_state()
    torch.save(state, tmp_path / "training_state.pt")
    assert_same(state, ckpt.load_train_state(tmp_path))


class RunsCode:
    """What a crafted pickle carries: unpickling it calls os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_training_state_pt_that_would_run_code_is_refused_unrun(tmp_path):
    step_dir = tmp_path / "checkpoints" / "step-00000006"
    step_dir.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    torch.save({"step": 6, "optimizer": RunsCode(f"touch {marker}")}, step_dir / "training_state.pt")
    with pytest.raises(train_state.UnsafeCheckpoint) as refused:
        ckpt.load_train_state(step_dir)
    assert not marker.exists()
    message = str(refused.value)
    assert f"{step_dir / 'training_state.pt'} is a pickle that names Python objects" in message, message
    assert "system" in message and "loading it would run code" in message, message
    assert f"mv {step_dir} {tmp_path / 'checkpoints' / 'damaged-step-00000006'}" in message, message
    assert f"--set drafter.init_from={step_dir}" in message, message
    assert ckpt._copy_step(step_dir) is None and not marker.exists()  # inspect's look at a copied `latest` too
    torch.load(step_dir / "training_state.pt", weights_only=False)  # the file really runs code when unpickled
    assert marker.exists()
