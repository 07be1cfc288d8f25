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
    assert summary["steps"] == 6  # ceil(0.25 x floor(96 rows / 4) micro-batches / 1 a step)
    said = " ".join(capsys.readouterr().err.split())
    assert "train.epochs = 0.25: 6 steps (96 usable rows: 24 micro-batches of 4; 1 a step)" in said, said
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 6


def test_epochs_count_the_rows_left_after_the_held_out_prompts(tiny_target, tmp_path, capsys):
    """With data.eval empty the run holds prompts of data.train out for evaluation: an epoch is the
    micro-batches of the rows it trains on, as the run's own stream counts them."""
    import math

    from dflash_trainer.distributed.parallel import init
    from dflash_trainer.run.loading import load_data, load_tokenizer
    from dflash_trainer.train import steps_from_epochs

    cfg = load_config("embedded", [f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
                                   "data.eval=[]", "train.epochs=0.5", "train.micro_batch=4", "train.grad_accum=2"])
    tokenizer = load_tokenizer(cfg)
    steps_from_epochs(cfg, init(0, 1, offline=False), tokenizer)
    said = " ".join(capsys.readouterr().err.split())
    stream, eval_stream, _ = load_data(cfg, tokenizer)
    assert cfg.train.steps == math.ceil(0.5 * stream.per_epoch / 2)
    assert f"after {len(eval_stream.dataset)} held out for evaluation: {stream.per_epoch} micro-batches of 4" in said
    assert "; 2 a step)" in said, said


def test_steps_and_epochs_together_are_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError, match=r"train.steps = 30 and train.epochs = 2 are both given: keep one"):
        load_config("embedded", ["train.epochs=2", "train.steps=30"])
    config = tmp_path / "run.toml"
    config.write_text('[target]\npath = "embedded"\n[train]\nsteps = 30\nepochs = 2\n')
    with pytest.raises(ConfigError, match=r"train.steps = 30 and train.epochs = 2 are both given: keep one"):
        load_config(str(config))


def test_the_command_line_chooses_between_steps_and_epochs_over_the_file(tmp_path):
    """The bundled configs give train.steps: --set train.epochs=N replaces it (and --set train.steps a file's
    epochs), as any --set replaces the file's value."""
    epochs = load_config("embedded", ["train.epochs=2"])  # the embedded config has steps = 300
    assert epochs.train.epochs == 2 and epochs.train.steps != 300
    config = tmp_path / "run.toml"
    config.write_text('[target]\npath = "embedded"\n[train]\nepochs = 2\n')
    steps = load_config(str(config), ["train.steps=40"])
    assert steps.train.steps == 40 and steps.train.epochs is None


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


def test_epochs_of_dumped_features_count_their_micro_batches(tmp_path, capsys):
    import torch
    from dflash_trainer.data.features import write_meta, write_shard
    from dflash_trainer.distributed.parallel import init
    from dflash_trainer.train import steps_from_epochs

    for i in range(6):
        write_shard(tmp_path, i, {"features": torch.zeros(2, 64, 8), "input_ids": torch.zeros(2, 64, dtype=torch.long)})
    write_meta(tmp_path, "t", [1], 6, 2)
    cfg = load_config("embedded", [f"data.features_dir={tmp_path}", "train.epochs=2.5", "train.grad_accum=2"])
    steps_from_epochs(cfg, init(0, 1, offline=False), None)
    assert cfg.train.steps == 8  # ceil(2.5 x 6 / 2)
    assert "train.epochs = 2.5: 8 steps (6 dumped micro-batches, 2 a step)" in " ".join(capsys.readouterr().err.split())
