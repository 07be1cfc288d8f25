"""The evaluation before training: a teacher-forced estimate of tau by default (seconds), speculative decoding
when eval.before_training = "decode"; its cost is said either way."""

from __future__ import annotations

import json

import pytest
from dflash_trainer.config import load_config
from dflash_trainer.run.evaluate import slot_tau
from dflash_trainer.train import run


def test_slot_tau_adds_the_slots_up_to_the_first_miss():
    assert slot_tau([0.0, 0.0]) == 1.0  # an untrained drafter: every verify step adds the target's token only
    assert slot_tau([1.0, 1.0, 1.0]) == 4.0  # a block accepted whole
    assert slot_tau([0.5, 0.5]) == pytest.approx(1.75)


@pytest.mark.parametrize("setting, method", [
    ("teacher-forced", "teacher-forced estimate"),
    pytest.param("decode", "speculative decoding", marks=pytest.mark.slow),  # the evaluation as it was
])
def test_before_training_tau_as_set_and_its_cost_said(setting, method, tiny_target, tmp_path, capsys):
    summary = run(load_config("embedded", [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={tmp_path / 'run'}", "train.steps=2",
        "train.micro_batch=4", "train.num_anchors=8", "train.checkpoint_every=0", "eval.prompts=2",
        "eval.max_new_tokens=4", f"eval.before_training={setting}"]))
    said = " ".join(capsys.readouterr().err.split())
    assert summary["tau_before_method"] == method and 1.0 <= summary["tau_before"] <= 8
    assert "evaluation before training: " in said and "s: start-up and imports" in said
    assert ("(teacher-forced estimate;" in said) == (setting == "teacher-forced")
    assert "evaluation before training" in summary["startup_s"]
