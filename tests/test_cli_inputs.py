"""What a new user runs into first, across dflash-train, dflash-eval and dflash-run status: a target without a chat
template or tokenizer, null or empty paths, --resume of a directory without a run, --print-config of a config that
is not complete yet, the status of a job run directly, how train.epochs counts, a drafter of another target family,
a target too small for the published tap rule, and datasets' own log lines.

Bad input: exit 2 with one message naming the problem and the fix, nothing written. CPU, tiny random models.
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from dflash_run import status
from dflash_run.jobs import EVAL, REGENERATE, TRAIN, holds_run
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.data.rows import DataError, load_rows
from dflash_trainer.eval import cli as eval_cli
from dflash_trainer.run import loading, run_dir
from dflash_trainer.train import main

from tests.helpers.training import random_drafter_dir
from tests.test_faults import sets, trainer


def _target_copy(tiny_target, root: Path, name: str) -> Path:
    target = root / name
    shutil.copytree(tiny_target["target"], target)
    return target


@pytest.fixture(scope="module")
def no_template_target(tiny_target, tmp_path_factory) -> Path:
    """The tiny target with its chat template removed (a base model's tokenizer)."""
    target = _target_copy(tiny_target, tmp_path_factory.mktemp("no-template"), "target")
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def qwen2_target(tiny_target, tmp_path_factory) -> Path:
    """A Qwen2 target of the tiny Qwen3 target's shape and tokenizer: every shape check passes across the families."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    qwen3 = AutoConfig.from_pretrained(tiny_target["target"])
    root = tmp_path_factory.mktemp("qwen2") / "target"
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=qwen3.vocab_size, hidden_size=qwen3.hidden_size, intermediate_size=qwen3.intermediate_size,
        num_hidden_layers=qwen3.num_hidden_layers, num_attention_heads=qwen3.num_attention_heads,
        num_key_value_heads=qwen3.num_key_value_heads, max_position_embeddings=qwen3.max_position_embeddings,
        tie_word_embeddings=False)).save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_target["target"]).save_pretrained(root)
    assert qwen3.hidden_size // qwen3.num_attention_heads == qwen3.head_dim  # Qwen2's head_dim: hidden / heads
    return root


@pytest.fixture(scope="module")
def qwen3_drafter(tiny_target, tmp_path_factory) -> Path:
    return random_drafter_dir(tiny_target["target"], tmp_path_factory.mktemp("drafter"))


@pytest.fixture(scope="module")
def finished_run(tiny_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["--config", "embedded", "--output-dir", str(out), *sets(tiny_target, "train.steps=2",
                                                                         "drafter.num_layers=1")]) == 0
    return out


# ---- 1. the target's tokenizer: a chat template where chat rows are rendered, its files there ----------------

def test_a_target_without_a_chat_template_is_refused_before_it_loads(no_template_target, tiny_target, tmp_path,
                                                                   capsys):
    out = tmp_path / "out"
    code, err = trainer(capsys, out, *sets(tiny_target, f"target.path={no_template_target}"))
    assert code == 2, err
    assert f"the tokenizer of {no_template_target} has no chat template" in err, err  # dflash-eval's words
    assert "add a chat_template to its tokenizer_config.json" in err and "pre-tokenized rows" in err, err
    assert "target: Qwen3ForCausalLM" not in err  # refused before the target's weights were read
    assert not out.exists()


def test_pretokenized_rows_need_no_chat_template(no_template_target, tiny_target, tmp_path):
    from transformers import AutoTokenizer

    rows = tmp_path / "regenerated.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}) + "\n" for _ in range(8)))
    tokenizer = AutoTokenizer.from_pretrained(no_template_target)
    pretokenized = load_config("embedded", [f"target.path={no_template_target}", f"data.train={json.dumps([str(rows)])}",
                                            f"data.eval={json.dumps([str(rows)])}"])
    loading.check_chat_data(pretokenized, tokenizer)  # nothing to render: accepted
    chat = load_config("embedded", [f"target.path={no_template_target}", f"data.train={json.dumps([str(rows)])}",
                                    f"data.eval={json.dumps([tiny_target['eval']])}"])
    with pytest.raises(DataError, match="has no chat template.*or give data.eval as pre-tokenized rows"):
        loading.check_chat_data(chat, tokenizer)


def test_a_target_directory_without_a_tokenizer_names_the_fix(tiny_target, qwen3_drafter, tmp_path, capsys):
    """transformers builds an empty tokenizer from config.json alone; the trainer then said "the tokenizer has no
    mask token: set drafter.mask_token_id", which does not name what is missing."""
    target = tmp_path / "no-tokenizer"
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(Path(tiny_target["target"]) / name, target / name)
    out = tmp_path / "out"
    code, err = trainer(capsys, out, *sets(tiny_target, f"target.path={target}"))
    assert code == 2 and f"target.path {target}: the directory has no tokenizer" in err, err
    assert "save_pretrained(DIR)" in err and "mask token" not in err.split("Save it")[1] and not out.exists()
    code = eval_cli.main(["--drafter", str(qwen3_drafter), "--target", str(target), "--prompts", tiny_target["eval"],
                          "--out", str(out)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and f"--target {target}: the directory has no tokenizer" in err, err
    assert not out.exists()


# ---- 2. path settings: never null where one is required, never empty ------------------------------------

@pytest.mark.parametrize(("override", "expected"), [
    ("output_dir=null", "output_dir = null: cannot be unset: give a path"),
    ("output_dir=", 'output_dir = "": is empty: give a path'),
    ("target.path=null", "target.path = null: cannot be unset: give a path"),
    ('data.train=["train.jsonl", ""]', 'data.train = ["train.jsonl", ""]: holds an empty path'),
    ("drafter.init_from=", 'drafter.init_from = "": is empty: give a path, or null (leave the key out) for none'),
    ("train.dtype=null", "train.dtype = null: cannot be unset: give a string: one of bfloat16, float16, float32"),
])
def test_null_or_empty_paths_are_refused_by_key_and_nothing_is_written(override, expected, tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--config", "embedded", "--set", override]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert expected in err, err
    assert list(tmp_path.iterdir()) == []  # no ./null, nothing in the working directory


def test_an_empty_output_dir_flag_is_named_and_null_still_unsets_an_optional_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--config", "embedded", "--output-dir", ""]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "invalid config (embedded.toml with --output-dir)" in err and 'output_dir = "": is empty' in err, err
    assert list(tmp_path.iterdir()) == []
    assert load_config("embedded", ["drafter.init_from=null", "train.compile_cache_dir=null"]).drafter.init_from is None


# ---- 3. --resume needs a run; --auto-resume starts one where there is none ------------------------------

@pytest.mark.parametrize("made", [False, True])
def test_resume_of_a_directory_without_a_run_is_refused(made, tmp_path, capsys):
    out = tmp_path / "run"
    if made:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    code, err = trainer(capsys, out, "--resume")
    assert code == 2, err
    why = "it holds none of config.json, summary.json, drafter/, checkpoints/step-*" if made else "it does not exist"
    assert f"--resume: there is no run to resume in {out} ({why})" in err, err
    assert "--auto-resume continues a run where there is one and starts a new one where there is none" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] if made else not out.exists()


def test_auto_resume_starts_a_new_run_where_there_is_none(tmp_path):
    cfg = load_config("embedded", [f"output_dir={tmp_path / 'run'}"])
    start = run_dir.prepare(cfg, resume=False, overwrite=False, auto_resume=True)
    assert not start.resume and not start.finished


def test_the_supervisor_adds_resume_once_the_directory_holds_a_run(tmp_path):
    """Every deployed start passed --resume; the first start of a deployment, with no run yet, now starts one."""
    job_dir = tmp_path / "run"
    (job_dir / "logs").mkdir(parents=True)
    (job_dir / "launch.json").write_text("{}")
    assert not holds_run(job_dir) and TRAIN.start_args(job_dir) == ()
    (job_dir / "checkpoints" / "step-00000003").mkdir(parents=True)
    assert TRAIN.start_args(job_dir) == ("--resume",)
    shutil.rmtree(job_dir / "checkpoints")
    (job_dir / "config.json").write_text("{}")
    assert TRAIN.start_args(job_dir) == ("--resume",)
    assert REGENERATE.start_args(job_dir) == () == EVAL.start_args(job_dir)


# ---- 4. --print-config prints what parses; dflash-eval's includes --run's settings ------------------------

def test_print_config_of_an_incomplete_config_prints_it_and_says_what_a_run_needs(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[target]\npath = "/models/some-target"\n[train]\nlr = 1e-3\n')
    assert main(["--config", str(config), "--print-config"]) == 0
    captured = capsys.readouterr()
    printed = tomllib.loads(captured.out)
    assert printed["target"]["path"] == "/models/some-target" and printed["data"]["train"] == []
    assert "this config cannot start a run yet" in captured.err and "data.train is empty" in captured.err
    assert main(["--config", str(config), "--set", "train.steps=abc", "--print-config"]) == 2  # a type: refused
    assert 'train.steps = "abc": must be an integer' in capsys.readouterr().err


def test_eval_print_config_shows_the_settings_read_from_the_run(finished_run, tiny_target, capsys):
    assert eval_cli.main(["--run", str(finished_run), "--print-config"]) == 0
    text = capsys.readouterr().out
    printed = tomllib.loads(text)
    assert printed["target"]["path"] == tiny_target["target"], text  # the run's target
    assert printed["eval"]["max_new_tokens"] == 4, text  # the run's, not dflash-eval's default of 256
    assert printed["target"]["dtype"] == "float32" == printed["train"]["dtype"], text  # the run's (embedded.toml)
    assert f"# --drafter {finished_run / 'drafter'}" in text and "held-out=" in text
    assert f"# --out {finished_run / 'eval'}" in text
    assert eval_cli.main(["--run", str(finished_run), "--max-new-tokens", "9", "--print-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["eval"]["max_new_tokens"] == 9  # a flag over the run's


# ---- 5. dflash-run status of regeneration and evaluation: how they ended --------------------------------

def test_status_of_jobs_run_directly_says_how_they_ended(tmp_path):
    regen, ev = tmp_path / "regen", tmp_path / "eval"
    regen.mkdir()
    (regen / "part-00000.jsonl").write_text("{}\n")
    report = status.report(regen, None, job=REGENERATE)
    assert report["state"].startswith("not running: started directly") and "answers the rest" in report["state"]
    (regen / "summary.json").write_text(json.dumps({"prompts": 1, "answer_tokens": 2, "this_run": {}}))
    text = status.format_report(status.report(regen, None, job=REGENERATE))
    assert "state:       finished (started directly, not by dflash-run)" in text, text
    assert re.search(r"ended:       its result written at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", text), text
    ev.mkdir()
    assert status.report(ev, None, job=EVAL)["state"] == "never started"
    (ev / "eval.json").write_text(json.dumps({"sets": {}, "overall": {}}))
    assert status.report(ev, None, job=EVAL)["state"] == "finished (started directly, not by dflash-run)"


@pytest.mark.parametrize(("job", "state", "rc"), [(REGENERATE, "finished", 0), (EVAL, "failed", 2)])
def test_status_of_a_supervised_job_shows_its_exit_and_when(job, state, rc, tmp_path):
    job_dir = tmp_path / job.name
    (job_dir / "logs").mkdir(parents=True)
    (job_dir / job.log).write_text("a line\nthe last line\n")
    (job_dir / "supervisor.json").write_text(json.dumps({"state": state, "job": job.name, "pid": 1, "rc": rc,
                                                         "log": str(job_dir / job.log),
                                                         "updated": "2026-01-02T03:04:05Z"}))
    text = status.format_report(status.report(job_dir, None, job=job))
    assert f"state:       {state} (supervisor: " in text and "never started" not in text, text
    assert f"ended:       exit {rc} at 2026-01-02T03:04:05Z" in text and "  the last line" in text, text


@pytest.mark.parametrize(("holds", "asked", "told"), [("regenerate", TRAIN, REGENERATE), ("train", REGENERATE, TRAIN),
                                                     ("eval", TRAIN, EVAL), ("launch", TRAIN, REGENERATE)])
def test_status_with_the_wrong_job_names_the_right_one(holds, asked, told, tmp_path):
    job_dir = tmp_path / "out"
    job_dir.mkdir()
    (job_dir / "summary.json").write_text(json.dumps({"prompts": 3, "steps": 4}))  # regeneration and training write one
    files = {"regenerate": ["part-00000.jsonl", "regenerate.json"], "train": ["config.json"], "eval": ["eval.json"],
             "launch": []}[holds]
    for name in files:
        (job_dir / name).write_text("{}\n")
    if holds == "launch":  # a deployed job: its launch.json names it
        (job_dir / "launch.json").write_text(json.dumps({"job": "regenerate", "argv": ["dflash-regenerate"]}))
    report = status.report(job_dir, None, job=asked)
    text = status.format_report(report)
    assert f"holds {told.what} output, not {asked.what}: dflash-run status --job {told.name}" in text, text
    assert "None" not in text and status.exit_code(report) == 2, text
    assert "shards:" not in text and "checkpoint:" not in text and "result:" not in text  # the other job's files
    assert status.exit_code(status.report(job_dir, None, job=told)) == 0


@pytest.mark.parametrize("launch", ['{"job": ["x"], "argv": ["a"]}', "{bad", '{"job": "nope", "argv": ["a"]}'])
def test_status_of_a_directory_with_a_damaged_launch_reads_its_files(launch, tmp_path):
    (tmp_path / "launch.json").write_text(launch)
    (tmp_path / "part-00000.jsonl").write_text("{}\n")
    report = status.report(tmp_path, None, job=TRAIN)  # no traceback: the shards say whose directory it is
    assert "holds regeneration output, not training" in report["state"] and status.exit_code(report) == 2


# ---- 6. train.epochs: whole micro-batches, as the stream takes them --------------------------------------

def test_epochs_count_the_whole_micro_batches_an_epoch_takes(tiny_target, tmp_path, capsys):
    """50 rows in micro-batches of 4: 12 whole ones an epoch (the stream keeps one shape, the compile step's),
    not ceil(50 / 4) = 13; the docs' formula, the printed derivation and the stream agree."""
    from dflash_trainer.distributed.parallel import init
    from dflash_trainer.train import steps_from_epochs

    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(Path(tiny_target["train"]).read_text().splitlines(keepends=True)[:50]))
    cfg = load_config("embedded", [f"target.path={tiny_target['target']}", f"data.train={json.dumps([str(rows)])}",
                                   f"data.eval={json.dumps([tiny_target['eval']])}", "train.epochs=1",
                                   "train.micro_batch=4", "data.max_length=128", "data.context_buckets=[64, 128]"])
    tokenizer = loading.load_tokenizer(cfg)
    steps_from_epochs(cfg, init(0, 1, offline=False), tokenizer)
    said = " ".join(capsys.readouterr().err.split())
    stream, _, _ = loading.load_data(cfg, tokenizer)
    usable = len(stream.dataset)
    assert usable % 4, usable  # a partial micro-batch is there to be left out
    assert cfg.train.steps == stream.per_epoch == usable // 4 == math.floor(usable / 4) < math.ceil(usable / 4)
    assert (f"train.epochs = 1: {usable // 4} steps ({usable} usable rows: {usable // 4} micro-batches of 4, the last "
            f"{usable % 4} rows of each epoch's shuffle left out; 1 a step)") in said, said
    settings = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    assert "ceil(epochs x floor(usable rows / micro_batch) / (grad_accum x drafter ranks))" in settings


# ---- 7. long paths in the tables are printed whole -------------------------------------------------------

def test_the_training_summary_prints_a_long_path_whole_in_a_log(monkeypatch):
    from dflash_trainer.infra.console import LogConsole
    from dflash_trainer.run import summary

    log = io.StringIO()
    monkeypatch.setattr(summary, "console", LogConsole(file=log, width=80))  # a log file: 80 columns, no terminal
    path = "/srv/dflash/runs/" + "a-long-run-directory-name-" * 4 + "end/drafter"
    summary.print_summary({"steps": 2, "losses": [1.0, 0.5], "first_loss": 1.0, "final_loss": 0.5,
                           "tokens_per_s": 10.0, "mfu": None, "time_split_s": {"target": 1.0}, "drafter_dir": path,
                           "checkpoints": "/x"})
    text = log.getvalue()
    assert "…" not in text and path in "".join(re.sub(r"[│ ]", "", line) for line in text.splitlines()), text


# ---- 8. a drafter drafts for one target family --------------------------------------------------------

def test_eval_refuses_a_drafter_of_another_family_naming_both(qwen3_drafter, qwen2_target, tiny_target, tmp_path,
                                                              capsys):
    assert json.loads((qwen3_drafter / "config.json").read_text())["target_model_type"] == "qwen3"
    out = tmp_path / "out"
    argv = ["--target", str(qwen2_target), "--prompts", tiny_target["eval"], "--out", str(out)]
    assert eval_cli.main(["--drafter", str(qwen3_drafter), *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "it was trained for a qwen3 target (target_model_type in its config.json), and this target is qwen2" in err
    # A drafter that records no family (older ones, other trainers'): Gemma's scales on a Qwen2 target.
    gemma_like = tmp_path / "gemma-like"
    shutil.copytree(qwen3_drafter, gemma_like)
    raw = json.loads((gemma_like / "config.json").read_text())
    raw.pop("target_model_type")
    raw["dflash_config"].update(input_embedding_scale=8.0, final_logit_softcapping=30.0)
    (gemma_like / "config.json").write_text(json.dumps(raw))
    assert eval_cli.main(["--drafter", str(gemma_like), *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "input_embedding_scale = 8.0 (this target: 1.0), final_logit_softcapping = 30.0 (this target: None)" in err
    assert "which this qwen2 target does not apply" in err and not out.exists()


def test_init_from_a_drafter_of_another_family_is_refused(qwen3_drafter, qwen2_target, tiny_target, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = trainer(capsys, out, *sets(tiny_target, f"target.path={qwen2_target}",
                                           f"drafter.init_from={qwen3_drafter}"))
    assert code == 2 and f"drafter.init_from {qwen3_drafter} drafts for another target family" in err, err
    assert "trained for a qwen3 target" in err and "this target is qwen2" in err and not out.exists()


# ---- 9. a target too small for the published tap rule ----------------------------------------------------

def test_a_small_target_gets_a_target_layer_ids_that_works(tiny_target, tmp_path, capsys):
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    config = AutoConfig.from_pretrained(tiny_target["target"])
    config.num_hidden_layers = 3
    config.layer_types = config.layer_types[:3] if getattr(config, "layer_types", None) else None
    target = tmp_path / "small"
    Qwen3ForCausalLM(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(tiny_target["target"]).save_pretrained(target)
    out = tmp_path / "out"
    code, err = trainer(capsys, out, *sets(tiny_target, f"target.path={target}", "drafter.num_layers=2"))
    assert code == 2 and "drafter.num_layers = 2: the drafter taps 2 target layers by the published rule" in err, err
    suggested = re.search(r"--set (drafter\.target_layer_ids=\[[\d,]+\])", err)
    assert suggested and suggested.group(1) == "drafter.target_layer_ids=[1,2]", err
    assert not out.exists()
    cfg = load_config("embedded", [f"target.path={target}", "drafter.num_layers=2", suggested.group(1)],
                      whole_run=False)
    built = loading.drafter_config_for(cfg, AutoConfig.from_pretrained(target), AutoTokenizer.from_pretrained(target))
    assert built.dflash_config["target_layer_ids"] == [1, 2]
    with pytest.raises(ConfigError, match=r"\[5\] are not layers of target .* which has 3: set drafter.target_layer_ids"):
        loading.drafter_config_for(load_config("embedded", [f"target.path={target}", "drafter.target_layer_ids=[1,5]"],
                                               whole_run=False),
                                   AutoConfig.from_pretrained(target), AutoTokenizer.from_pretrained(target))


@pytest.mark.parametrize(("family", "layers", "num_layers", "repeated", "distinct"), [
    ("llama", 4, 2, [1, 1], [1, 3]), ("mistral", 6, 5, [1, 2, 2, 2, 3], [1, 2, 3, 4, 5]),
    ("gemma2", 7, 5, [1, 2, 2, 3, 4], [1, 2, 3, 5, 6]),
])
def test_a_target_the_published_rule_taps_twice_gets_a_note_with_distinct_layers(family, layers, num_layers,
                                                                                  repeated, distinct):
    """The rule spaces num_layers ids over layers 1..T-3; below num_layers + 3 layers some repeat. The run goes on
    (the rule is z-lab's), and the note names distinct layers that the drafter config then takes."""
    from transformers import AutoConfig

    target = AutoConfig.for_model(family, num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    cfg = load_config("embedded", [f"drafter.num_layers={num_layers}"], whole_run=False)
    (note,) = loading.repeated_taps_note(cfg, target)
    assert f"taps target layers {repeated} by the published rule" in note, note
    suggested = re.search(r"--set drafter\.target_layer_ids=\[([\d,]+)\]", note)
    assert suggested and [int(i) for i in suggested.group(1).split(",")] == distinct, note
    ids = load_config("embedded", [f"drafter.num_layers={num_layers}", f"drafter.target_layer_ids=[{suggested.group(1)}]"],
                      whole_run=False)
    assert loading.repeated_taps_note(ids, target) == []  # explicit ids: the user chose them
    many = AutoConfig.for_model(family, num_hidden_layers=num_layers + 3)
    assert loading.repeated_taps_note(cfg, many) == []  # enough layers: distinct by the rule


# ---- 10. a bad data file: our message alone --------------------------------------------------------------

def test_a_bad_data_file_is_said_once_without_datasets_own_log_line(tmp_path):
    from datasets.utils import logging as datasets_logging

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{bad json\n')
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("datasets").addHandler(handler)
    level = datasets_logging.get_verbosity()
    try:
        with pytest.raises(DataError, match=r"bad.jsonl, line 2: not valid JSON"):
            load_rows([str(bad)])
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    assert datasets_logging.get_verbosity() == level  # datasets' own level again afterwards


# ---- 9. the bundled demo's settings under a user's own target are said ----------------------------------

def test_the_demo_base_config_with_a_target_of_ones_own_is_said(tiny_target):
    from dflash_trainer.config import load_config
    from dflash_trainer.train import demo_settings_note

    own = load_config("embedded", [f"target.path={tiny_target['target']}"], whole_run=False)
    note = demo_settings_note("embedded", own)
    assert note.startswith("note: the base config is the bundled demo's (--config embedded, sized for its toy target; "
                           "this run has data.max_length = 128")
    assert f"target.path = {tiny_target['target']}" in note and "--config qwen3-8b" in note
    assert demo_settings_note("embedded", load_config("embedded", [], whole_run=False)) is None  # the demo itself
    assert demo_settings_note("qwen3-8b", own) is None and demo_settings_note(None, own) is None
