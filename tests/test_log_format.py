"""--log-format json: dflash-train, dflash-regenerate and dflash-eval write one JSON object a line on stderr (time,
stage, message; progress lines add their figures), for log collectors; `dflash-run status` still finds the last
progress line in such a log."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from dflash_run import status
from dflash_run.jobs import TRAIN
from dflash_trainer.infra.console import console

from tests.helpers.regenerate import chat_target as build_chat_target
from tests.helpers.regenerate import corpus_rows, write_jsonl


@pytest.fixture(autouse=True)
def text_again():
    yield
    console.use("text", "")  # the console is the process's: the next test's command starts in text


def json_lines(stderr: str, stage: str) -> list[dict]:
    """Every line of stderr as a JSON object with a time, the stage and a message (a line that is not: the test
    fails naming it)."""
    records = []
    for line in stderr.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
        assert record["stage"] == stage and isinstance(record["message"], str), record
        assert datetime.fromisoformat(record["time"]).utcoffset().total_seconds() == 0, record
        records.append(record)
    return records


def train_args(tiny_target, out: Path) -> list[str]:
    sets = [f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
            f"data.eval={json.dumps([tiny_target['eval']])}", "train.steps=4", "train.micro_batch=4",
            "train.num_anchors=8", "train.checkpoint_every=0", "train.log_every=2", "eval.prompts=1",
            "eval.max_new_tokens=4"]
    return ["--config", "embedded", "--output-dir", str(out), "--log-format", "json",
            *[x for s in sets for x in ("--set", s)]]


@pytest.fixture(scope="module")
def trained_in_json(tiny_target, tmp_path_factory):
    import contextlib
    import io

    from dflash_trainer.train import main

    out = tmp_path_factory.mktemp("json-log") / "run"
    err = io.StringIO()  # module scope has no capsys
    with contextlib.redirect_stderr(err):
        code = main(train_args(tiny_target, out))
    console.use("text", "")
    assert code == 0, err.getvalue()[-3000:]
    return out, err.getvalue()


def test_training_writes_json_lines_with_its_figures(trained_in_json):
    out, stderr = trained_in_json
    records = json_lines(stderr, "train")
    progress = [r for r in records if "loss" in r and "step" in r and r["message"].startswith("train: step")]
    assert [r["step"] for r in progress] == [1, 2, 4], records
    assert all(r["steps"] == 4 and r["tokens_per_s"] > 0 and r["lr"] > 0 for r in progress), progress
    summary = next(r for r in records if r["message"] == "DFlash training summary")
    recorded = json.loads((out / "summary.json").read_text())
    assert summary["tau_before"] == recorded["tau_before"] and summary["tau_after"] == recorded["tau_after"]
    assert summary["step"] == 4 and summary["loss"] == recorded["final_loss"]
    # the steady step time and MFU, as summary.json records them (no GPU peak on a CPU: no MFU)
    assert summary["steady_step_ms"] == recorded["steady_step_ms"] > 0 and "steady_mfu" not in summary  # None: left out
    assert all(r["step_ms"] > 0 for r in progress), progress
    assert any(r["message"].startswith("drafter: ") and "2 layers" in r["message"] for r in records)  # other lines too
    log = out / TRAIN.log
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(stderr)
    assert status.report(out, None, job=TRAIN)["last_progress"] == progress[-1]["message"]


def test_an_error_is_a_json_line_too(tiny_target, tmp_path, capsys):
    from dflash_trainer.train import main

    code = main([*train_args(tiny_target, tmp_path / "run"), "--set", "train.report_to=[\"comet\"]"])
    records = json_lines(capsys.readouterr().err, "train")
    assert code == 2 and any("must be one of none, tensorboard, wandb, mlflow" in r["message"] for r in records)


def test_evaluation_writes_json_lines_with_tau(trained_in_json, tmp_path, capsys):
    from dflash_trainer.eval.cli import main as evaluate

    run_dir, _ = trained_in_json
    code = evaluate(["--run", str(run_dir), "--out", str(tmp_path / "eval"), "--max-new-tokens", "4",
                     "--log-format", "json"])
    records = json_lines(capsys.readouterr().err, "eval")
    assert code == 0, records
    progress = [r for r in records if r["message"].startswith("eval: ")]
    assert progress and progress[-1]["set"] == "held-out" and progress[-1]["done"] == progress[-1]["total"]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert progress[-1]["tau"] == report["sets"]["held-out"]["tau"]
    assert any("spec tok/s" in r["message"] for r in records)  # the results table, as one message


@pytest.mark.slow  # loads a chat target and answers prompts
def test_regeneration_writes_json_lines(tmp_path_factory, tmp_path, capsys):
    from dflash_trainer.regenerate.cli import main as regenerate

    target = build_chat_target(tmp_path_factory)["target"]
    source = write_jsonl(tmp_path / "source.jsonl", corpus_rows(4))
    capsys.readouterr()  # what building the target printed is not the command's
    code = regenerate(["--target", target, "--data", str(source), "--out", str(tmp_path / "regen"),
                       "--max-new-tokens", "4", "--batch-size", "4", "--log-format", "json"])
    records = json_lines(capsys.readouterr().err, "regenerate")
    assert code == 0, records
    last = [r for r in records if r["message"].startswith("regenerate: ")][-1]
    assert last["done"] == last["total"] == 4 and last["tokens_per_s"] > 0, last
