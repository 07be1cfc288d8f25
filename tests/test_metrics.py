"""Metrics: TensorBoard always (when installed), W&B only when installed and configured."""

import sys
import types

from dflash_trainer.infra.metrics import Metrics


class FakeRun:
    def __init__(self, **kwargs):
        self.init_kwargs, self.logged, self.summary, self.finished, self.name = kwargs, [], {}, False, "fake-run"

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_scalars_go_to_tensorboard_and_to_wandb_when_configured(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: FakeRun(**kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    lines = []
    m = Metrics(tmp_path / "tb", {"train": {"lr": 1e-3}}, "drafters", "run-7", log=lines.append)
    m.scalars({"train/loss": 2.5, "slot_acc/01": 0.4}, step=3)
    m.summary({"final_loss": 2.5, "losses": [1, 2], "drafter_dir": "/x"})
    m.close()
    run = m.wandb
    assert run.init_kwargs["project"] == "drafters" and run.init_kwargs["name"] == "run-7"
    assert run.init_kwargs["config"] == {"train": {"lr": 1e-3}}
    assert run.logged == [(3, {"train/loss": 2.5, "slot_acc/01": 0.4})]
    assert run.summary == {"final_loss": 2.5, "drafter_dir": "/x"} and run.finished  # lists are left out
    assert "W&B: run fake-run in project drafters" in lines[-1]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_wandb_is_off_unless_configured_and_missing_wandb_is_said(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    lines = []
    assert Metrics(tmp_path / "a", {}, None, log=lines.append).wandb is None and not lines
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    m = Metrics(tmp_path / "b", {}, None, log=lines.append)
    assert m.wandb is None and "'from-env' is configured but wandb is not installed" in lines[0]
    m.scalars({"train/loss": 1.0}, 1)
    m.close()
