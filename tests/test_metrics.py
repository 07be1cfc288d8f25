"""Trackers: train.report_to chooses them (TensorBoard by default), a missing package is refused at the start
with its pip command, and what a run logged to is recorded for dflash-eval --run."""

import json
import sys
import types

import pytest
from dflash_trainer.config import ConfigError, load_config, missing_trackers
from dflash_trainer.infra.metrics import TRACKERS_FILE, Metrics

from tests.helpers.trackers import scalars_in


def test_tensorboard_gets_the_scalars_and_the_run_records_its_trackers(tmp_path):
    lines = []
    m = Metrics(tmp_path, ["tensorboard"], {"train": {"lr": 1e-3}}, "run-7", log=lines.append)
    m.scalars({"train/loss": 2.5, "slot_acc/01": 0.5}, step=3)
    m.summary({"final_loss": 2.5, "losses": [1, 2]})
    m.close()
    found = scalars_in(tmp_path / "tb")
    assert found["train/loss"] == [(3, 2.5)] and found["slot_acc/01"] == [(3, 0.5)]
    assert json.loads((tmp_path / TRACKERS_FILE).read_text()) == {"tensorboard": {"dir": str(tmp_path / "tb")}}
    assert lines == [f"metrics: tensorboard (dir {tmp_path / 'tb'})"]
    later = Metrics.of_run(tmp_path, log=lines.append)  # dflash-eval --run: the same TensorBoard run
    later.scalars({"dflash_eval/all/tau": 3.25}, step=6)
    later.close()
    assert scalars_in(tmp_path / "tb")["dflash_eval/all/tau"] == [(6, 3.25)]


def test_none_reports_nowhere(tmp_path):
    m = Metrics(tmp_path, ["none"], {}, log=print)
    m.scalars({"train/loss": 1.0}, 1)
    m.close()
    assert list(tmp_path.iterdir()) == []
    assert Metrics.of_run(tmp_path).sinks == []  # a run without trackers.json: nothing to add to


def config_with(*settings):
    return load_config("embedded", list(settings))


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_is_refused_with_its_install_command(tracker):
    if not missing_trackers([tracker]):
        pytest.skip(f"{tracker} is installed here")
    with pytest.raises(ConfigError) as refused:
        config_with(f'train.report_to=["tensorboard", "{tracker}"]')
    assert (f"train.report_to names {tracker}, which is not installed: pip install {tracker} (or leave {tracker} "
            "out of train.report_to)") in str(refused.value)


@pytest.mark.parametrize(("setting", "expected"), [
    ('train.report_to=["none", "tensorboard"]', '"none" reports nowhere, and the others report somewhere'),
    ('train.report_to=["tensorboard", "tensorboard"]', "names a tracker twice"),
    ('train.report_to=["comet"]', "train.report_to = [\"comet\"]: must be one of none, tensorboard, wandb, mlflow"),
])
def test_report_to_is_checked(setting, expected):
    with pytest.raises(ConfigError, match="invalid config") as refused:
        config_with(setting)
    assert expected in " ".join(str(refused.value).split()), str(refused.value)


def test_a_wandb_project_without_wandb_in_report_to_is_refused():
    with pytest.raises(ConfigError) as refused:
        config_with('train.wandb_project="drafters"')
    assert 'add "wandb" to train.report_to, or leave train.wandb_project out' in str(refused.value)


class FakeRun:
    """wandb.init's run, as far as Metrics uses it."""

    def __init__(self, **kwargs):
        self.init_kwargs, self.logged, self.summary, self.finished = kwargs, [], {}, False
        self.id, self.project = kwargs.get("id", "abc123"), kwargs.get("project")

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_gets_the_scalars_and_evaluation_resumes_its_run(tmp_path, monkeypatch):
    import importlib.machinery

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # installed, as find_spec sees it
    fake.init = lambda **kwargs: FakeRun(**kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    m = Metrics(tmp_path, ["wandb"], {"train": {"lr": 1e-3}}, "run-7", wandb_project="drafters", log=lambda _: None)
    m.scalars({"train/loss": 2.5}, step=3)
    m.summary({"final_loss": 2.5, "losses": [1, 2], "drafter_dir": "/x"})
    m.close()
    run = m.sinks[0].run
    assert run.init_kwargs["project"] == "drafters" and run.init_kwargs["name"] == "run-7"
    assert run.logged == [(3, {"train/loss": 2.5})] and run.finished
    assert run.summary == {"final_loss": 2.5, "drafter_dir": "/x"}  # lists are left out
    assert json.loads((tmp_path / TRACKERS_FILE).read_text()) == {"wandb": {"id": "abc123", "project": "drafters"}}
    later = Metrics.of_run(tmp_path, log=lambda _: None)
    assert later.sinks[0].run.init_kwargs == {"project": "drafters", "id": "abc123", "resume": "allow",
                                              "dir": str(tmp_path)}


def test_mlflow_gets_the_scalars_and_evaluation_resumes_its_run(tmp_path, monkeypatch):
    """Where mlflow is installed (it is no dependency of the trainer): a local file store, read back with
    mlflow's own client."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    out = tmp_path / "run"
    out.mkdir()
    m = Metrics(out, ["mlflow"], {"train": {"lr": 1e-3, "ids": [1, 2]}}, "run-7", log=lambda _: None)
    m.scalars({"train/loss": 2.5, "slot_acc/01": 0.5}, step=3)
    m.summary({"final_loss": 2.0, "losses": [1]})
    m.close()
    later = Metrics.of_run(out, log=lambda _: None)
    later.scalars({"dflash_eval/all/tau": 3.25}, step=6)
    later.close()
    record = json.loads((out / TRACKERS_FILE).read_text())["mlflow"]
    client = MlflowClient(record["tracking_uri"])
    run = client.get_run(record["run_id"])
    assert run.data.params == {"train.lr": "0.001", "train.ids": "[1, 2]"}
    assert run.data.metrics == {"train/loss": 2.5, "slot_acc/01": 0.5, "summary/final_loss": 2.0,
                                "dflash_eval/all/tau": 3.25}
    assert [(x.step, x.value) for x in client.get_metric_history(run.info.run_id, "dflash_eval/all/tau")] == [(6, 3.25)]


def test_a_resumed_run_continues_its_tracker_runs_and_starts_the_ones_it_lacks(tmp_path, monkeypatch):
    import importlib.machinery

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: FakeRun(**kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    Metrics(tmp_path, ["wandb"], {}, "run-7", wandb_project="drafters", log=lambda _: None).close()
    resumed = Metrics(tmp_path, ["wandb", "tensorboard"], {}, "run-7", wandb_project="drafters", log=lambda _: None,
                      resume=Metrics.records(tmp_path))
    resumed.scalars({"train/loss": 1.5}, step=7)
    resumed.close()
    assert resumed.sinks[0].run.init_kwargs["id"] == "abc123"  # the W&B run it started, continued
    assert scalars_in(tmp_path / "tb")["train/loss"] == [(7, 1.5)]  # TensorBoard, added on resume, starts
    assert set(json.loads((tmp_path / TRACKERS_FILE).read_text())) == {"wandb", "tensorboard"}
