"""train.epochs derives train.steps from the data; --print-config prints the merged config as TOML."""

from __future__ import annotations

import json
import tomllib

import pytest
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.train import main, run


def test_epochs_derive_the_steps_from_the_usable_rows(tiny_target, tmp_path, capsys):
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f'[target]\npath = "{tiny_target["target"]}"\ndtype = "float32"\n'
                      f'[data]\ntrain = ["{tiny_target["train"]}"]\neval = ["{tiny_target["eval"]}"]\n'
                      "max_length = 128\ncontext_buckets = [64, 128]\n"
                      "[drafter]\nnum_layers = 1\nblock_size = 8\n"
                      "[train]\nepochs = 0.25\nmicro_batch = 4\nnum_anchors = 8\ndtype = \"float32\"\n"
                      "checkpoint_every = 0\n[eval]\nprompts = 1\nmax_new_tokens = 4\n")
    summary = run(load_config(str(config), [f"output_dir={out}"]))
    assert summary["steps"] == 6  # ceil(0.25 x 96 rows / 4 a step)
    assert "train.epochs = 0.25: 6 steps (96 usable rows, 4 a step)" in " ".join(capsys.readouterr().err.split())
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 6


def test_steps_and_epochs_together_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"train.steps = 300 and train.epochs = 2 are both given: keep one"):
        load_config("embedded", ["train.epochs=2"])


def test_print_config_prints_the_merged_toml_and_exits_0(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[target]\npath = "embedded"\n[train]\nlr = 1e-3\n')
    assert main(["--config", str(config), "--set", "train.micro_batch=3", "--output-dir", str(tmp_path / "o"),
                 "--print-config"]) == 0
    text = capsys.readouterr().out
    printed = tomllib.loads(text)
    assert printed["train"]["lr"] == 1e-3 and printed["train"]["micro_batch"] == 3  # the file, --set
    assert printed["train"]["grad_accum"] == 1 and printed["data"]["max_length"] == 3072  # the defaults
    assert printed["output_dir"] == str(tmp_path / "o")
    again = tmp_path / "printed.toml"
    again.write_text(text)  # a config file of its own, that loads as the same config
    merged = load_config(str(config), ["train.micro_batch=3", f"output_dir={tmp_path / 'o'}"])
    assert load_config(str(again)).to_dict() == merged.to_dict()
    assert not (tmp_path / "o").exists()  # nothing ran
