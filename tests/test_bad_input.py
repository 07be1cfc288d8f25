"""Bad input, second round: the trainer's flags and settings go through the config's rules (finite numbers,
ranges with upper bounds, files vs directories), explicit settings never lose silently to drafter.init_from
or a finished run's shortcut, and a refused start leaves the directory as it found it.

Every case: exit 2 with one message naming the flag, key or file and the fix, no traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.run import checkpoint as ckpt
from dflash_trainer.train import main

from tests.helpers.training import random_drafter_dir
from tests.test_faults import STEP6, _resume_sets, sets, snapshot, trainer


@pytest.fixture(scope="module")
def finished_run(tiny_target, tmp_path_factory):
    """A finished run: checkpoints at steps 3 and 6, drafter/ (2 layers, block 8), summary.json, config.json."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["--config", "embedded", "--output-dir", str(out), *sets(tiny_target)]) == 0
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, symlinks=True)
    return out


# ---- flags and keys: the config's rules -----------------------------------------------------------

@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--target-gpus", "-1", "argument --target-gpus: -1: must be >= 0"),
    ("--drafter-gpus", "0", "argument --drafter-gpus: 0: must be >= 1"),
    ("--drafter-gpus", "1e9", "argument --drafter-gpus: '1e9': give an integer"),
    ("--dump-batches", "0", "argument --dump-batches: 0: must be >= 1"),
])
def test_train_flags_take_their_settings_rules(flag, value, expected, capsys):
    code = main(["--config", "embedded", flag, value])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and expected in err, err


@pytest.mark.parametrize(("override", "expected"), [
    ("train.steps=100000000000000000000000", "train.steps = 100000000000000000000000: must be <= 100000000"),
    ("data.max_length=1099511627776", "must be <= 1048576"),
    ("train.micro_batch=1000000", "train.micro_batch = 1000000: must be <= 65536"),
    ("drafter.num_layers=100000", "drafter.num_layers = 100000: must be <= 1024"),
    ("train.seed=99999999999999999999", "train.seed = 99999999999999999999: must be <= 4294967295"),
])
def test_counts_of_work_have_upper_bounds(override, expected):
    with pytest.raises(ConfigError) as error:
        load_config("embedded", [override])
    assert expected in str(error.value)


def test_a_directory_given_as_the_config_is_called_one(tmp_path, capsys):
    code, err = trainer(capsys, tmp_path / "out", "--config", str(tmp_path))
    assert code == 2 and f"config '{tmp_path}' is a directory: give a TOML file" in err, err


def test_a_config_file_error_names_the_flags_given_not_set(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[target]\npath = "embedded"\n[train]\nsteps = 0\n')
    code = main(["--config", str(bad), "--output-dir", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "invalid config (bad.toml with --output-dir)" in err and "--set" not in err, err
    assert not (tmp_path / "out").exists()


def test_an_output_dir_that_is_a_file_is_refused_by_its_flag(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["--config", "embedded", "--output-dir", str(tmp_path / "f")]) == 2
    assert f"argument --output-dir: {tmp_path / 'f'} is a file: give a directory" in capsys.readouterr().err


# ---- drafter.init_from: its shape wins only where nothing says otherwise ----------------------------

def test_init_from_with_another_explicit_shape_is_refused_and_listed(finished_run, tiny_target, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = trainer(capsys, out, *sets(tiny_target, f"drafter.init_from={finished_run / 'drafter'}",
                                           "drafter.num_layers=3", "drafter.block_size=4"))
    assert code == 2, err
    assert "drafter.num_layers = 3, the drafter in it has 2 (num_hidden_layers)" in err, err
    assert "drafter.block_size = 4, the drafter in it has 8 (block_size)" in err, err
    assert "Remove these settings" in err and not out.exists()


def test_init_from_a_target_model_is_refused(tiny_target, tmp_path, capsys):
    code, err = trainer(capsys, tmp_path / "out", *sets(tiny_target, f"drafter.init_from={tiny_target['target']}"))
    assert code == 2 and "has no dflash_config, so it is not a DFlash drafter (a target model's directory?)" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_init_from_with_an_impossible_block_size_is_refused(finished_run, tiny_target, tmp_path, capsys):
    drafter = tmp_path / "drafter"
    shutil.copytree(finished_run / "drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "block_size": 0}))
    code, err = trainer(capsys, tmp_path / "out", *sets(tiny_target, f"drafter.init_from={drafter}"))
    assert code == 2 and "block_size = 0 (must be an integer, >= 2 and <= 1024, as drafter.block_size)" in err, err


# ---- a finished run: the settings checks come before the shortcut -----------------------------------

@pytest.mark.parametrize("flag", ["--resume", "--auto-resume"])
@pytest.mark.parametrize(("override", "expected"), [
    ("drafter.num_layers=3", "drafter.num_layers: 2 -> 3"),
    ("drafter.target_layer_ids=[0]", "drafter.target_layer_ids: None -> [0]"),
])
def test_a_finished_run_with_another_drafter_is_refused_not_nothing_changed(flag, override, expected, run_copy,
                                                                            capsys):
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, flag, *_resume_sets(run_copy), "--set", override)
    assert code == 2 and expected in err and "nothing changed" not in err, err
    assert snapshot(run_copy) == before


def test_auto_resume_names_a_damaged_latest_checkpoint(run_copy, capsys):
    for name in ("summary.json", "eval_prompts.jsonl"):
        (run_copy / name).unlink()
    shutil.rmtree(run_copy / "drafter")
    state = run_copy / STEP6 / ckpt.TRAIN_STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    code, err = trainer(capsys, run_copy, "--auto-resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert (f"{run_copy} holds an unfinished run: continuing it (--resume) (step-00000006 is damaged "
            f"(training_state.json is") in err, err
    assert "continuing from the newest intact one, step-00000003" in err, err


def test_a_refused_new_start_leaves_no_empty_directory(tiny_target, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "no conversation here"}\n' * 4)
    out = tmp_path / "new" / "run"
    code, err = trainer(capsys, out, *sets({**tiny_target, "train": str(rows)}))
    assert code == 2, err
    assert not out.exists()


def test_status_of_a_mistyped_run_dir_exits_2(tmp_path, capsys):
    from dflash_run.cli import main as run_main

    code = run_main(["status", "--run-dir", str(tmp_path / "no-such-run")])
    out = capsys.readouterr().out
    assert code == 2 and "no such directory" in out, out
    assert run_main(["status", "--run-dir", str(tmp_path)]) == 0


def test_the_exit_code_contract_is_one_table():
    from dflash_trainer import cli_args
    from dflash_trainer.data.rows import DataError
    from dflash_trainer.infra.storage import StorageError
    from dflash_trainer.run.run_dir import RunDirError

    assert [cli_args.exit_code(e) for e in (ConfigError("x"), DataError("x"), RunDirError("x"))] == [2, 2, 2]
    assert [cli_args.exit_code(e) for e in (StorageError("x"), ckpt.DamagedCheckpoint("x"), KeyError("x"))] == \
        [1, 1, 1]


# ---- dflash-regenerate and dflash-eval: the same rules, the drafter's files, the console -------------

def test_regenerate_refuses_a_temperature_of_nan(tmp_path, capsys):
    from dflash_trainer.regenerate.cli import main as regenerate

    code = regenerate(["--target", "t", "--data", "d.jsonl", "--out", str(tmp_path / "out"), "--temperature", "nan"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "argument --temperature: nan: must be a number (finite)" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5", "2"])
def test_eval_refuses_a_tie_tolerance_outside_0_to_1(value, tmp_path, capsys):
    from dflash_trainer.eval.cli import main as evaluate

    code = evaluate(["--drafter", str(tmp_path), "--target", "t", "--out", str(tmp_path / "out"),
                     f"--tie-tolerance={value}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and f"argument --tie-tolerance: {value}: must be" in err, err


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory) -> Path:
    """A drafter with random weights, built for the tiny target (1 layer, block 4)."""
    return random_drafter_dir(tiny_target["target"], tmp_path_factory.mktemp("drafter"))


def _eval(capsys, drafter: Path, tiny_target, out: Path, *extra: str) -> tuple[int, str]:
    from dflash_trainer.eval.cli import main as evaluate

    code = evaluate(["--drafter", str(drafter), "--target", tiny_target["target"], "--out", str(out),
                     "--device", "cpu", "--max-new-tokens", "2", "--limit", "1", *extra])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, " ".join(err.split())


def test_eval_refuses_a_drafter_config_with_block_size_0(drafter_dir, tiny_target, tmp_path, capsys):
    edited = tmp_path / "drafter"
    shutil.copytree(drafter_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "block_size": 0}))
    code, err = _eval(capsys, edited, tiny_target, tmp_path / "out", "--prompts", tiny_target["eval"])
    assert code == 2 and f"{edited / 'config.json'} holds values no drafter can have: block_size = 0" in err, err
    assert not (tmp_path / "out").exists()


def test_eval_refuses_a_cut_short_weights_file_naming_it(drafter_dir, tiny_target, tmp_path, capsys):
    cut = tmp_path / "drafter"
    shutil.copytree(drafter_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, err = _eval(capsys, cut, tiny_target, tmp_path / "out", "--prompts", tiny_target["eval"])
    assert code == 2 and f"cannot load its weights from {weights}" in err and "copy the drafter directory again" \
        in err, err


def test_eval_keeps_brackets_in_its_messages(drafter_dir, tiny_target, tmp_path, capsys):
    missing = tmp_path / "mt[bench].jsonl"
    code, err = _eval(capsys, drafter_dir, tiny_target, tmp_path / "out", "--prompts", str(missing))
    assert code == 2 and "mt[bench].jsonl" in err, err


def test_eval_calls_a_directory_given_as_prompts_a_directory(drafter_dir, tiny_target, tmp_path, capsys):
    code, err = _eval(capsys, drafter_dir, tiny_target, tmp_path / "out", "--prompts", str(tmp_path))
    assert code == 2 and f"argument --prompts: {tmp_path} is a directory" in err and "not found" not in err, err


def test_eval_of_a_run_says_which_checkpoint_it_falls_back_to(run_copy, tmp_path, capsys):
    shutil.rmtree(run_copy / "drafter")
    state = run_copy / STEP6 / ckpt.TRAIN_STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    from dflash_trainer.eval.cli import main as evaluate

    code = evaluate(["--run", str(run_copy), "--out", str(tmp_path / "eval"), "--device", "cpu", "--limit", "1",
                     "--max-new-tokens", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0, err
    assert (f"--run {run_copy}: no published drafter (drafter/) yet: evaluating the checkpoint step-00000003, the "
            "newest intact one (step-00000006 is damaged") in err, err


def test_eval_keeps_brackets_in_its_table(drafter_dir, tiny_target, tmp_path, capsys):
    code, err = _eval(capsys, drafter_dir, tiny_target, tmp_path / "out", "--name", f"mt[bench]={tiny_target['eval']}")
    assert code == 0 and "mt[bench]" in err, err
    assert list(json.loads((tmp_path / "out" / "eval.json").read_text())["sets"]) == ["mt[bench]"]


def test_eval_of_a_run_says_when_the_drafter_config_has_another_block_size(run_copy, tmp_path, capsys):
    from dflash_trainer.eval.cli import main as evaluate

    config_file = run_copy / "drafter" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "block_size": 4}))
    code = evaluate(["--run", str(run_copy), "--out", str(tmp_path / "eval"), "--device", "cpu", "--limit", "1",
                     "--max-new-tokens", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0, err
    assert (f"note: {config_file} says block_size 4, and the run trained with 8 (drafter.block_size): evaluating "
            "at 4") in err, err


def test_eval_of_a_run_without_held_out_prompts_says_to_give_prompts(run_copy, tmp_path, capsys):
    """A run that recorded no held-out prompts (offline, or still training) and has no data.eval: --run alone
    names what is missing and the flag to give, rather than suggesting --run again."""
    from dflash_trainer.eval.cli import main as evaluate
    from dflash_trainer.run.run_dir import RUN_CONFIG

    (run_copy / "eval_prompts.jsonl").unlink(missing_ok=True)
    config_file = run_copy / RUN_CONFIG
    recorded = json.loads(config_file.read_text())
    recorded["data"]["eval"] = []
    config_file.write_text(json.dumps(recorded))
    code = evaluate(["--run", str(run_copy), "--out", str(tmp_path / "eval"), "--device", "cpu"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert f"--run {run_copy} holds no held-out prompts" in err and "give --prompts FILE_OR_DATASET" in err, err
    assert not (tmp_path / "eval").exists()


# ---- third round: nothing written is lost ---------------------------------------------------------------------

def _beyond_vocabulary_rows(path: Path, n: int = 8) -> Path:
    """Pre-tokenized rows whose ids the target's vocabulary does not have (tokenized for another model)."""
    row = {"input_ids": [5, 6, 7, 100_000, 8, 9, 10, 11], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1]}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(n)))
    return path


def test_overwrite_with_rows_refused_on_loading_keeps_the_finished_run(run_copy, tiny_target, tmp_path, capsys):
    before = snapshot(run_copy)
    data = _beyond_vocabulary_rows(tmp_path / "other-model.jsonl")
    code, err = trainer(capsys, run_copy, "--overwrite", *sets(tiny_target, f"data.train={json.dumps([str(data)])}"))
    assert code == 2 and f"no usable rows in {data}: all 8 refused: 8 x input_ids beyond the target tokenizer's " \
        "vocabulary" in err and "tokenize it again with this target's tokenizer" in err and "(rows 1, 2, 3, 4, 5, ...)" \
        in err, err
    assert snapshot(run_copy) == before  # drafter, checkpoints and summary as they were


def test_an_output_directory_of_another_job_is_refused_by_every_job(run_copy, drafter_dir, tiny_target, tmp_path,
                                                                    capsys):
    from dflash_trainer.regenerate.cli import main as regenerate

    before = snapshot(run_copy)
    code = regenerate(["--target", tiny_target["target"], "--data", tiny_target["eval"], "--out", str(run_copy),
                       "--max-new-tokens", "4"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and f"{run_copy} holds the output of a training job (config.json, checkpoints, progress.txt), " \
        "not of a regeneration job: give --out a directory of its own" in err, err
    code, err = _eval(capsys, drafter_dir, tiny_target, run_copy, "--prompts", tiny_target["eval"])
    assert code == 2 and "holds the output of a training job" in err and "give --out a directory of its own" in err
    assert snapshot(run_copy) == before  # its summary.json is the training run's still

    regenerated = tmp_path / "regenerated"
    regenerated.mkdir()
    (regenerated / "regenerate.json").write_text("{}\n")
    (regenerated / "summary.json").write_text('{"prompts": 6}\n')
    code, err = trainer(capsys, regenerated, "--overwrite", *sets(tiny_target))
    assert code == 2 and f"{regenerated} holds the output of a regeneration job (regenerate.json), not of a " \
        "training job: give --output-dir a directory of its own" in err, err
    assert (regenerated / "summary.json").read_text() == '{"prompts": 6}\n'


def test_overwrite_of_a_model_directory_is_refused_and_keeps_its_config(tiny_target, tmp_path, capsys):
    model = tmp_path / "target"
    shutil.copytree(tiny_target["target"], model)
    before = snapshot(model)
    code, err = trainer(capsys, model, "--overwrite", *sets(tiny_target))
    assert code == 2 and f"{model} holds a model ({model / 'config.json'} has model_type 'qwen3'), not a training " \
        "run: give --output-dir a directory of its own" in err, err
    assert snapshot(model) == before


# ---- round three: every problem at once, messages that name the key and the fix --------------------------------

def test_a_config_with_several_problems_says_them_all_at_once(tmp_path, capsys):
    """The keys' own rules, what a run needs of them and whether the inputs are there: one message, exit 2."""
    out = tmp_path / "run"
    missing = tmp_path / "no-such-target"
    code, err = trainer(capsys, out, "--set", f"target.path={missing}")
    assert code == 2 and "data.train is empty" in err and f"target.path '{missing}': no such directory" in err, err
    code, err = trainer(capsys, out, "--set", f"target.path={missing}", "--set", "train.lr=-1", "--set",
                        f"data.train={json.dumps([str(tmp_path / 'rows.jsonl')])}", "--set",
                        f"drafter.init_from={tmp_path}")
    assert code == 2, err
    for problem in ("train.lr = -1: must be > 0", f"target.path '{missing}'",
                    f"drafter.init_from {tmp_path}: not a drafter directory", "data files not found"):
        assert problem in err, (problem, err)
    assert not out.exists()


def test_a_check_on_a_key_already_refused_is_left_out():
    """data.max_length's own value is refused: the bucket check, which would judge its default, says nothing."""
    with pytest.raises(ConfigError) as error:
        load_config("embedded", ['data.max_length="long"', "data.context_buckets=[64]", "train.lr=0"])
    text = str(error.value)
    assert "data.max_length = \"long\": must be an integer" in text and "train.lr = 0: must be > 0" in text, text
    assert "exceeds the largest context bucket" not in text


def test_a_micro_batch_larger_than_the_rows_names_the_setting_and_the_fix(tiny_target, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = trainer(capsys, out, *sets(tiny_target, "train.micro_batch=5000"))
    assert code == 2, err
    assert "train.micro_batch = 5000 rows, and the data has" in err and "set train.micro_batch = " in err, err
    assert "or give more rows in data.train" in err and not out.exists()  # refused before anything was written


def test_a_run_without_checkpoints_names_no_checkpoints_directory(tiny_target, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = trainer(capsys, out, *sets(tiny_target, "train.steps=2", "train.checkpoint_every=0"))
    assert code == 0, err
    assert not (out / "checkpoints").exists()
    assert json.loads((out / "summary.json").read_text())["checkpoints"] is None
    assert str(out / "checkpoints") not in err and "none written (train.checkpoint_every" in err, err


def test_status_of_a_copied_run_names_its_own_drafter_and_log(finished_run, tmp_path):
    from dflash_run import status, supervise
    from dflash_run.jobs import TRAIN

    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy, symlinks=True)
    (copy / "logs").mkdir(exist_ok=True)
    (copy / "logs" / "train.log").write_text("train: step 6/6 (100%) | loss 1.0\n")
    (copy / supervise.STATE).write_text(json.dumps({"state": "finished", "rc": 0,
                                                    "log": str(finished_run / TRAIN.log)}))  # as it was recorded there
    text = status.format_report(status.report(copy, None, job=TRAIN))
    assert f"drafter {copy / 'drafter'}" in text and f"log:         {copy / TRAIN.log}" in text, text
    assert str(finished_run) not in text, text
