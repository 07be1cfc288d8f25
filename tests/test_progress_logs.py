"""Progress in a log: train, regenerate and eval write plain progress lines when stderr is a pipe (as under
systemd or `make train-logs`), and `dflash-run status` shows the last one of a running job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dflash_run import status
from dflash_run.jobs import EVAL, REGENERATE, TRAIN

from tests.helpers.regenerate import chat_target as build_chat_target
from tests.helpers.regenerate import corpus_rows, regenerate_cli, write_jsonl

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def train_args(tiny_target, out: Path, *extra: str) -> list[str]:
    sets = [f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
            f"data.eval={json.dumps([tiny_target['eval']])}", "train.steps=6", "train.micro_batch=4",
            "train.num_anchors=8", "train.checkpoint_every=0", "train.log_every=2", "eval.prompts=1",
            "eval.max_new_tokens=4", *extra]
    return ["--config", "embedded", "--output-dir", str(out)] + [x for s in sets for x in ("--set", s)]


def into_job_log(run_dir: Path, job, stderr: str) -> None:
    """What the supervisor does with a detached job's output: its log file in the job's directory."""
    log = run_dir / job.log
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(stderr)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("progress") / "run"
    proc = subprocess.run([sys.executable, "-m", "dflash_trainer.train", *train_args(tiny_target, out)],
                          capture_output=True, text=True, timeout=600, env=ENV, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_training_writes_a_plain_line_every_log_every_steps(trained):
    _, stderr = trained
    lines = [x for x in stderr.splitlines() if x.startswith("train: step ")]
    # the first step's line (a slow run shows its pace at once), then every log_every steps
    assert [re.match(r"train: step (\d+)/6", x).group(1) for x in lines] == ["1", "2", "4", "6"]
    last = lines[-1]
    for part in ("loss ", "acc ", "(mean ", " tok/s", "lr ", "elapsed ", "ETA ", "target wait "):
        assert part in last, (part, last)
    assert "\r" not in stderr  # no progress bar redrawn into the log


def test_a_line_is_due_once_a_minute_passed_since_the_last_whatever_log_every_says():
    import time

    from dflash_trainer.train import MAX_SILENCE_S, LogWindow

    window = LogWindow(0)
    assert not window.overdue()
    window.said = time.perf_counter() - MAX_SILENCE_S
    assert window.overdue()


def test_a_slow_run_gets_a_line_each_time_the_silence_runs_out(tiny_target, tmp_path, monkeypatch, capsys):
    from dflash_trainer import train

    monkeypatch.setattr(train, "MAX_SILENCE_S", 0.0)  # every step is "a minute" later than the last line
    assert train.main(train_args(tiny_target, tmp_path / "run", "train.log_every=100")) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: step ")]
    assert [re.match(r"train: step (\d+)/6", x).group(1) for x in lines] == ["1", "2", "3", "4", "5", "6"]


def test_the_progress_line_shows_the_learning_rate_its_step_used(trained, tiny_target):
    """Step k trains at the schedule's value after k - 1 scheduler steps (the loop reads a step's figures
    after the scheduler has moved on: the line must not show the next step's)."""
    import torch
    from dflash_trainer.config import load_config
    from dflash_trainer.model.optim import warmup_cosine

    out, stderr = trained
    cfg = load_config("embedded", [x for x in train_args(tiny_target, out)[4:] if x != "--set"])
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.lr)
    schedule = warmup_cosine(opt, cfg.train.steps, int(cfg.train.warmup_ratio * cfg.train.steps), cfg.train.min_lr_ratio)
    used = []
    for _ in range(cfg.train.steps):
        used.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    shown = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"train: step (\d+)/6 .*?\| lr ([\d.e+-]+) ", stderr)}
    assert set(shown) == {1, 2, 4, 6}
    for step, lr in shown.items():
        assert lr == pytest.approx(used[step - 1], rel=1e-2), (step, lr, used)


def test_status_shows_the_last_progress_line_of_a_training_log(trained):
    out, stderr = trained
    into_job_log(out, TRAIN, stderr + "after training: something else\n")
    report = status.report(out, None, job=TRAIN)
    assert report["last_progress"].startswith("train: step 6/6")
    assert "progress:    train: step 6/6" in status.format_report(report)


def test_status_of_a_run_started_directly_reads_its_directory(trained, tmp_path):
    """dflash-train run by hand (no dflash-run, so no state and no log file in the run directory): status says
    how it ended and shows the trainer's own latest progress line (OUTPUT/progress.txt)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained[0], out, ignore=shutil.ignore_patterns("logs"))
    report = status.report(out, None, job=TRAIN)
    text = status.format_report(report)
    assert report["state"] == "finished (started directly, not by dflash-run)", text
    assert report["last_progress"].startswith("train: step 6/6") and "loss " in report["last_progress"], text
    assert "log:         none here (a run started directly" in text
    assert re.search(r"summary:     6 steps, final loss \d+\.\d{4}, tau \d+\.\d\d -> \d+\.\d\d, drafter", text), text
    (out / "summary.json").unlink()  # stopped before its end
    report = status.report(out, None, job=TRAIN)
    assert report["state"].startswith("not running: started directly") and "--resume" in report["state"]


@pytest.mark.slow  # loads the target and answers 12 prompts in a process of its own
def test_regeneration_writes_plain_lines_and_status_shows_the_last(tmp_path_factory, tmp_path):
    target = build_chat_target(tmp_path_factory)["target"]
    source = write_jsonl(tmp_path / "source.jsonl", corpus_rows(12))
    out = tmp_path / "regen"
    proc = regenerate_cli(["--target", target, "--data", str(source), "--out", str(out), "--max-new-tokens", "8",
                           "--batch-size", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("regenerate: ")]
    assert lines and lines[-1].startswith("regenerate: 12/12 prompts"), proc.stderr[-2000:]
    assert " tok/s" in lines[-1] and "ETA " in lines[-1]
    into_job_log(out, REGENERATE, proc.stderr)
    assert status.report(out, None, job=REGENERATE)["last_progress"] == lines[-1]


def test_evaluation_writes_a_line_per_prompt_set_and_status_shows_the_last(trained, tiny_target, tmp_path):
    run_dir, _ = trained
    out = tmp_path / "eval"
    second = tmp_path / "more.jsonl"
    second.write_text("".join(Path(tiny_target["eval"]).read_text().splitlines(keepends=True)[:2]))
    proc = subprocess.run([sys.executable, "-m", "dflash_trainer.eval", "--run", str(run_dir), "--prompts",
                           str(run_dir / "eval_prompts.jsonl"), str(second), "--out", str(out), "--max-new-tokens", "4"],
                          capture_output=True, text=True, timeout=600, env=ENV, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("eval: ")]
    assert any(x.startswith("eval: more 2/2 prompts") for x in lines), proc.stderr[-2000:]
    assert any(x.startswith("eval: eval_prompts 1/1 prompts") for x in lines), lines
    into_job_log(out, EVAL, proc.stderr)
    assert status.report(out, None, job=EVAL)["last_progress"] == lines[-1]
    # the results table whole in the log: no cell cut to "tau/…" at rich's 80 columns off a terminal
    header = next(x for x in proc.stderr.splitlines() if "spec tok/s" in x)
    assert "…" not in proc.stderr and all(c in header for c in ("prompts", "tau/req", "target tok/s", "speedup")), \
        proc.stderr[-3000:]
