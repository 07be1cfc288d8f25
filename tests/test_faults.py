"""The trainer under bad input and damaged run directories, as a user meets them.

Every case: exit 2 (config, data, usage, run directory) or 1 (a fault while running), one message that
names the key, file or directory and the fix, no traceback, and the output directory's earlier
contents unchanged (file hashes before and after) unless the case is one the trainer repairs.
Real torch on CPU with the tiny target; disk full and read-only on real (tmpfs) mounts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import types
import typing
from contextlib import contextmanager
from pathlib import Path

import pytest
from dflash_trainer.config import RunConfig, load_config
from dflash_trainer.infra import hub
from dflash_trainer.run import checkpoint as ckpt
from dflash_trainer.run.loading import check_target, target_config
from dflash_trainer.train import main

from tests.helpers.mounts import tmpfs

STEP3, STEP6 = "checkpoints/step-00000003", "checkpoints/step-00000006"


def sets(tiny_target, *extra: str) -> list[str]:
    values = [f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
              f"data.eval={json.dumps([tiny_target['eval']])}", "train.steps=6", "train.micro_batch=4",
              "train.num_anchors=8", "train.checkpoint_every=3", "train.keep_last=5", "train.log_every=1",
              "eval.prompts=1", "eval.max_new_tokens=4", *extra]
    return [x for v in values for x in ("--set", v)]


def trainer(capsys, out: Path | None, *args: str) -> tuple[int, str]:
    """The CLI in this process: (exit code, stderr with rich's line wrapping undone)."""
    argv = ["--config", "embedded", *(["--output-dir", str(out)] if out else []), *args]
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, " ".join(err.split())


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root: a file's sha256, a link's target, or 'dir'."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def earlier_run(tiny_target, tmp_path_factory):
    """A finished run: checkpoints at steps 3 and 6, drafter/, summary.json, config.json."""
    out = tmp_path_factory.mktemp("earlier") / "run"
    assert main(["--config", "embedded", "--output-dir", str(out), *sets(tiny_target)]) == 0
    return out


@pytest.fixture
def run_copy(earlier_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out, symlinks=True)
    return out


# ---- config values ------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "expected"), [
    ("train.steps=abc", 'train.steps = "abc": must be an integer'),
    ("train.steps=1.5", "train.steps = 1.5: must be an integer"),
    ("train.lr=abc", 'train.lr = "abc": must be a number'),
    ("train.lr=-0.001", "train.lr = -0.001: must be > 0"),
    ("train.dtype=fp16", 'train.dtype = "fp16": must be one of bfloat16, float16, float32'),
    ("train.compile_layers=no", 'train.compile_layers = "no": must be true or false'),
    ("data.context_buckets=[64, 12.5]", "data.context_buckets = [64, 12.5]: must be a list of integers"),
    ("train.stepz=3", "unknown key 'stepz' in [train] (did you mean 'steps'?)"),  # [train] survives rich
])
def test_bad_config_values_name_the_key(override, expected, run_copy, capsys):
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--resume", "--set", override)
    assert code == 2 and expected in err, err
    assert snapshot(run_copy) == before


def _wrong_value(hint) -> str:
    """A TOML value of another type than hint (the inner type of X | None, the item of a list)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    inner = args[0] if typing.get_origin(hint) is types.UnionType else hint
    if typing.get_origin(inner) is list:
        return '["x"]' if typing.get_args(inner)[0] is int else "[1, 2]"
    return {int: "1.5", float: '"abc"', str: "5", bool: '"yes"'}[inner]


def _leaf_fields(cls, section: str = ""):
    hints = typing.get_type_hints(cls)  # Annotated[...] stripped: the declared types
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], f.name)
        else:
            yield section, f.name, hints[f.name]


def test_every_field_of_every_section_is_type_checked(tmp_path):
    fields = list(_leaf_fields(RunConfig))
    assert len(fields) > 40
    for section, name, hint in fields:
        key = f"{section}.{name}" if section else name
        path = tmp_path / f"{key}.toml"
        path.write_text((f"[{section}]\n" if section else "") + f"{name} = {_wrong_value(hint)}\n")
        with pytest.raises(ValueError, match=rf"- {re.escape(key)} = .*: must be "):
            load_config(str(path))


# ---- the target --------------------------------------------------------------------------------

@contextmanager
def hub_at(url: str):
    """The hub endpoint for this process (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    saved = constants.ENDPOINT
    constants.ENDPOINT = url
    hub.reachable.cache_clear()
    try:
        yield
    finally:
        constants.ENDPOINT = saved
        hub.reachable.cache_clear()


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_missing_target_directory_is_named(tiny_target, tmp_path, capsys):
    out = tmp_path / "new"
    code, err = trainer(capsys, out, *sets(tiny_target, f"target.path={tmp_path / 'models' / 'qwen'}"))
    assert code == 2 and f"target.path {str(tmp_path / 'models' / 'qwen')!r}: no such directory" in err, err
    assert not out.exists() or not any(out.iterdir())


def test_relative_name_is_tried_on_the_hub_only_when_it_answers(tiny_target, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with hub_at(f"http://127.0.0.1:{closed_port()}"):
        code, err = trainer(capsys, tmp_path / "new", *sets(tiny_target, "target.path=models/qwen3"))
    assert code == 2, err
    assert f"no such directory ({tmp_path / 'models' / 'qwen3'}), and the hub (http://127.0.0.1:" in err
    assert "is not reachable for a hub id" in err
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    code, err = trainer(capsys, tmp_path / "new", *sets(tiny_target, "target.path=org/model"))
    assert code == 2 and "the hub is switched off (HF_HUB_OFFLINE)" in err, err


def test_target_directory_without_a_model(tiny_target, tmp_path, capsys):
    (tmp_path / "empty-model").mkdir()
    code, err = trainer(capsys, tmp_path / "new", *sets(tiny_target, f"target.path={tmp_path / 'empty-model'}"))
    assert code == 2 and "the directory has no config.json" in err, err


def test_paths_under_home_are_expanded_once_for_every_reader(tiny_target, tmp_path, monkeypatch):
    """target.path=~/... passed the directory check but reached transformers unexpanded ("Repo id must use
    alphanumeric chars"): load_config expands ~ in every path field; hub ids are left as they are."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "target").symlink_to(tiny_target["target"])
    cfg = load_config("embedded", ["target.path=~/models/target", 'data.train=["~/chats.jsonl", "org/ds"]',
                                   "output_dir=~/runs/a", "train.compile_cache_dir=~/cache"])
    assert cfg.target.path == str(tmp_path / "models" / "target")
    assert cfg.data.train == [str(tmp_path / "chats.jsonl"), "org/ds"]
    assert (cfg.output_dir, cfg.train.compile_cache_dir) == (str(tmp_path / "runs" / "a"), str(tmp_path / "cache"))
    check_target(cfg.target.path)
    assert target_config(cfg).hidden_size == 64  # the tiny target's own config, read from the expanded path


# ---- data --------------------------------------------------------------------------------------

def test_missing_data_with_the_embedded_target_is_an_error_not_the_embedded_data(tmp_path, capsys, earlier_run):
    """It used to train on the embedded data instead, and replace the earlier run."""
    fresh = tmp_path / "fresh"
    code, err = trainer(capsys, fresh, "--set", f'data.train=["{tmp_path / "mine.jsonl"}"]')
    assert code == 2 and "data files not found" in err and "mine.jsonl" in err, err
    assert not (fresh / "embedded").exists()  # refused before the embedded target was built
    before = snapshot(earlier_run)
    code, err = trainer(capsys, earlier_run, "--resume", *_resume_sets(earlier_run),
                        "--set", f'data.train=["{tmp_path / "mine.jsonl"}"]')
    assert code == 2 and "mine.jsonl" in err, err
    assert snapshot(earlier_run) == before


def test_malformed_jsonl_line_names_file_and_line(tiny_target, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = Path(tiny_target["train"]).read_text().splitlines()
    bad.write_text("\n".join(lines[:4] + ['{"messages": [{"role": "user", "content": "hi"}'] + lines[4:]) + "\n")
    code, err = trainer(capsys, tmp_path / "new", *sets(tiny_target, f'data.train=["{bad}"]'))
    assert code == 2 and f"{bad}, line 5: not valid JSON" in err, err
    assert not (tmp_path / "new" / "config.json").exists()  # a failed start writes no config


def test_empty_data_file(tiny_target, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    code, err = trainer(capsys, tmp_path / "a", *sets(tiny_target, f'data.train=["{tmp_path / "empty.jsonl"}"]'))
    assert code == 2 and "empty.jsonl'] are empty" in err, err
    code, err = trainer(capsys, tmp_path / "b", *sets(tiny_target, f'data.train=["{tmp_path / "blank.jsonl"}"]'))
    assert code == 2 and "hold no rows (only blank lines)" in err, err


def test_no_usable_rows(tiny_target, tmp_path, capsys):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain text {i}"}) + "\n" for i in range(8)))
    code, err = trainer(capsys, tmp_path / "a", *sets(tiny_target, f'data.train=["{text}"]'))
    assert code == 2 and "rows have keys ['text']; each row needs 'messages'" in err, err
    users = tmp_path / "users.jsonl"
    users.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
                             for i in range(8)))
    code, err = trainer(capsys, tmp_path / "b", *sets(tiny_target, f'data.train=["{users}"]'))
    assert code == 2 and f"no usable rows in {users}: none of its 8 rows has two consecutive assistant" in err, err
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    code, err = trainer(capsys, tmp_path / "c", *sets(tiny_target, f'data.train=["{odd}"]'))
    assert code == 2 and f"no usable rows in {odd}" in err and "role/content" in err and "(row 1)" in err, err


# ---- resume with another config ----------------------------------------------------------------

@pytest.mark.parametrize(("override", "expected"), [
    ("drafter.block_size=4", "block_size: 8 -> 4 (drafter.block_size)"),
    ("drafter.num_layers=3", "num_hidden_layers: 2 -> 3 (drafter.num_layers)"),
    ("drafter.target_layer_ids=[0, 5]", "dflash_config.target_layer_ids: [1, 3] -> [0, 5]"),
    ("drafter.mask_token_id=7", "dflash_config.mask_token_id: 3 -> 7 (drafter.mask_token_id)"),
    ("parallel.drafter_sharding=fsdp", "parallel.drafter_sharding: ddp -> fsdp"),
])
def test_resume_refuses_a_config_that_changes_the_model(override, expected, run_copy, capsys):
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_further(run_copy), "--set", override)
    assert code == 2 and expected in err and "A resumed run must" in err, err
    assert "--overwrite" in err and "--output-dir" in err
    assert snapshot(run_copy) == before


def _resume_sets(out: Path) -> list[str]:
    """The earlier run's own settings, read back from its config.json."""
    stored = json.loads((out / "config.json").read_text())
    return sets({"target": stored["target"]["path"], "train": stored["data"]["train"][0],
                 "eval": stored["data"]["eval"][0]})


def _resume_further(out: Path) -> list[str]:
    """_resume_sets and two steps more than the finished run trained: a resume that has work to do (one
    with nothing left is reported and changes nothing, before the checks that loading would make)."""
    return [*_resume_sets(out), "--set", "train.steps=8"]


def test_resume_refuses_another_target(run_copy, tmp_path, capsys):
    other = tmp_path / "other-target"
    shutil.copytree(json.loads((run_copy / "config.json").read_text())["target"]["path"], other)
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy), "--set", f"target.path={other}")
    assert code == 2 and "target.path:" in err and "the drafter learns this target's features" in err, err
    assert snapshot(run_copy) == before


def test_resume_allows_and_lists_lr_steps_and_logging(run_copy, capsys):
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy), "--set", "train.steps=7",
                        "--set", "train.lr=0.001", "--set", "train.log_every=2")
    assert code == 0, err
    assert "--resume with changed settings:" in err
    for change in ("train.steps: 6 -> 7", "train.lr: 0.003 -> 0.001", "train.log_every: 1 -> 2"):
        assert change in err
    assert json.loads((run_copy / "config.json").read_text())["train"]["steps"] == 7
    assert json.loads((run_copy / "summary.json").read_text())["steps"] == 7
    # tau before training is measured after the resumed steps, on the initial drafter rebuilt: said so
    assert "before training (the run's initial drafter, rebuilt from its seed after training): tau" in err
    assert err.index("train: step 7/7") < err.index("evaluation before training (the run's initial drafter")


# ---- damaged run directories -------------------------------------------------------------------

@pytest.mark.parametrize("recorded", ["[1]", "{bad"])
def test_resume_with_a_damaged_run_config_says_so_and_writes_it_anew(recorded, earlier_run, run_copy, capsys):
    """config.json valid JSON but no object, or no JSON: the start goes on from the checkpoint, and says
    that it could not compare the settings (not an AttributeError from the comparison)."""
    (run_copy / "config.json").write_text(recorded)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_further(earlier_run))
    assert code == 0, err
    assert f"{run_copy / 'config.json'} is damaged (not a readable JSON object)" in err
    assert json.loads((run_copy / "config.json").read_text())["train"]["steps"] == 8


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damaged_file", ["training_state.safetensors", "training_state.json", "model.safetensors"])
def test_corrupt_latest_checkpoint_resumes_from_the_newest_intact_one(damaged_file, run_copy, capsys):
    truncate(run_copy / STEP6 / damaged_file)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert f"checkpoint {run_copy / STEP6} is damaged ({damaged_file} is" in err
    assert "resuming from the newest intact one, step-00000003" in err
    assert "moved aside to damaged-step-00000006" in err
    summary = json.loads((run_copy / "summary.json").read_text())
    assert len(summary["losses"]) == 3  # steps 4-6 again
    assert ckpt.latest_checkpoint(run_copy / "checkpoints").name == "step-00000006"
    assert ckpt.verify(run_copy / STEP6) is None  # written anew
    assert (run_copy / "checkpoints" / "damaged-step-00000006" / damaged_file).is_file()  # kept for a look


def test_a_resumed_start_verifies_each_checkpoint_once(run_copy, capsys, monkeypatch):
    """prepare's inspection is the start's one look at the checkpoints: what to resume from and the step
    the ranks start at come from its verdicts (each directory here was verified three times). What a save
    checks later, to name the previous checkpoint intact in its error, is the loop's, not the start's."""
    from dflash_trainer import train

    truncate(run_copy / STEP6 / "model.safetensors")  # `latest` points at it: the start falls back to step 3
    real_verify, verified = ckpt.verify, []
    monkeypatch.setattr(ckpt, "verify", lambda step_dir: verified.append(Path(step_dir).resolve())
                        or real_verify(step_dir))
    real_loop, at_loop = train.train_loop, []
    monkeypatch.setattr(train, "train_loop", lambda *args: at_loop.extend(verified) or real_loop(*args))
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert f"checkpoint {run_copy / STEP6} is damaged (model.safetensors is" in err  # found, reported
    assert "resuming from the newest intact one, step-00000003" in err and "resumed from" in err
    assert sorted(at_loop) == [(run_copy / STEP3).resolve(), (run_copy / STEP6).resolve()]


def test_no_intact_checkpoint_refuses_with_the_fix(run_copy, capsys):
    truncate(run_copy / STEP3 / "training_state.safetensors")
    truncate(run_copy / STEP6 / "model.safetensors")
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy))
    assert code == 2 and "--resume: no intact checkpoint under" in err, err
    assert "step-00000006: model.safetensors is" in err and "--overwrite" in err
    assert snapshot(run_copy) == before


def test_checkpoint_whose_bytes_do_not_load(run_copy, capsys):
    """Sizes right, contents not: the load fails, and the message names the directory and the fix."""
    state = run_copy / STEP6 / "training_state.safetensors"
    data = state.read_bytes()
    assert data.count(b'"dtype":"F32"') > 0
    state.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"Q32"', 1))  # a header that parses, a dtype none has
    code, err = trainer(capsys, run_copy, "--resume", *_resume_further(run_copy))
    assert code == 1 and f"checkpoint {run_copy / STEP6} cannot be loaded" in err, err
    assert f"mv {run_copy / STEP6} {run_copy / 'checkpoints' / 'damaged-step-00000006'}" in err


def test_a_checkpoint_that_would_run_code_is_refused(run_copy, tmp_path, capsys):
    """A training_state.pt crafted to run a command when unpickled: exit 2, the command never runs, the message
    names the file and what to do, and nothing in the run changes."""
    import torch

    marker = tmp_path / "code-ran"
    step6 = run_copy / STEP6
    for name in ("training_state.json", "training_state.safetensors", "checkpoint.json"):
        (step6 / name).unlink()
    torch.save({"step": 6, "optimizer": _RunsCode(f"touch {marker}")},
               step6 / "training_state.pt")
    ckpt._write_manifest(step6, 6)
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_further(run_copy))
    assert code == 2 and f"{step6 / 'training_state.pt'} is a pickle that names Python objects" in err, err
    assert "loading it would run code it carries, so it was not loaded" in err, err
    assert f"mv {step6} {run_copy / 'checkpoints' / 'damaged-step-00000006'}" in err, err
    assert not marker.exists()
    assert snapshot(run_copy) == before


class _RunsCode(str):
    """Unpickling it calls os.system with its text."""

    def __reduce__(self):
        return os.system, (str(self),)


def test_latest_copied_as_a_directory(earlier_run, tmp_path, capsys):
    copy = tmp_path / "copied"
    subprocess.run(["cp", "-rL", str(earlier_run), str(copy)], check=True)
    assert (copy / "checkpoints" / "latest").is_dir() and not (copy / "checkpoints" / "latest").is_symlink()
    code, err = trainer(capsys, copy, "--resume", *_resume_sets(copy), "--set", "train.steps=7")
    assert code == 0, err
    assert "`latest` was a directory (a copy made with cp -rL or scp -r)" in err
    assert os.readlink(copy / "checkpoints" / "latest") == "step-00000007"
    assert json.loads((copy / "summary.json").read_text())["losses"] and "resumed from" in err


def test_only_latest_was_copied(earlier_run, tmp_path, capsys):
    """scp -r of a run whose step directories were pruned away: `latest` is the only copy of step 6."""
    copy = tmp_path / "copied"
    subprocess.run(["cp", "-rL", str(earlier_run), str(copy)], check=True)
    shutil.rmtree(copy / STEP6)
    code, err = trainer(capsys, copy, "--resume", *_resume_sets(copy), "--set", "train.steps=7")
    assert code == 0, err
    assert "renamed to step-00000006" in err and "resumed from" in err and "step 6" in err


def test_leftovers_of_killed_saves_and_prunes_are_cleaned(run_copy, capsys):
    root = run_copy / "checkpoints"
    (root / ".latest.tmp-4242").symlink_to("step-00000003")  # killed between symlink and rename
    (root / ".tmp-step-00000007-x1y2").mkdir()  # killed inside a save
    (root / "step-00000009").mkdir()  # empty
    shutil.copytree(root / "step-00000003", root / "step-00000001")
    (root / "step-00000001" / "training_state.json").unlink()  # half-pruned: the state went first
    shutil.copytree(root / "step-00000003", root / "step-00000002")
    (root / "step-00000002" / "model.safetensors").unlink()  # half-pruned: the weights went first
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy), "--set", "train.steps=7")
    assert code == 0, err
    for note in ("removed .latest.tmp-4242", "removed .tmp-step-00000007-x1y2", "removed the empty step-00000009",
                 "removed step-00000001", "removed step-00000002"):
        assert note in err
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003", "step-00000006", "step-00000007"]


# ---- a new run where a run is ------------------------------------------------------------------

def test_new_run_in_a_directory_that_holds_a_run(run_copy, capsys):
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, *_resume_sets(run_copy))
    assert code == 2 and f"{run_copy} already holds a run" in err, err
    assert "--resume" in err and "another --output-dir" in err and "--overwrite" in err
    assert snapshot(run_copy) == before
    code, err = trainer(capsys, run_copy, "--resume", "--overwrite", *_resume_sets(run_copy))
    assert code == 2 and "give one of them" in err
    code, err = trainer(capsys, run_copy, "--overwrite", *_resume_sets(run_copy), "--set", "train.steps=2",
                        "--set", "train.checkpoint_every=1")
    assert code == 0, err
    assert [s for s, _ in ckpt.list_checkpoints(run_copy / "checkpoints")] == [1, 2]  # the old ones are gone
    assert json.loads((run_copy / "summary.json").read_text())["steps"] == 2


def test_resume_of_a_finished_run_without_checkpoints(run_copy, capsys):
    """train.checkpoint_every = 0 keeps none: --resume would start at step 0 and replace drafter/."""
    shutil.rmtree(run_copy / "checkpoints")
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy))
    assert code == 2 and "finished (drafter, summary.json) and kept no checkpoint" in err, err
    assert "--overwrite" in err
    assert snapshot(run_copy) == before


# ---- --auto-resume: what `make train` runs --------------------------------------------------------

def stopped_at_step_3(run: Path) -> Path:
    """The finished run as a stop at step 3 leaves it: checkpoint 3 (latest), config.json, tb/; no drafter."""
    for name in ("summary.json", "eval_prompts.jsonl"):
        (run / name).unlink()
    shutil.rmtree(run / "drafter")
    shutil.rmtree(run / STEP6)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").symlink_to("step-00000003")
    return run


def test_auto_resume_reports_a_finished_run_and_changes_nothing(run_copy, capsys):
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--auto-resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert (f"{run_copy} holds a finished run (drafter: {run_copy / 'drafter'}, figures: "
            f"{run_copy / 'summary.json'})") in err, err
    assert "--overwrite" in err and "another --output-dir" in err and "step 0" not in err
    assert snapshot(run_copy) == before
    # a larger train.steps does not make it unfinished: --resume trains it further, on purpose
    code, err = trainer(capsys, run_copy, "--auto-resume", *_resume_sets(run_copy), "--set", "train.steps=8")
    assert code == 0 and "holds a finished run" in err, err
    assert snapshot(run_copy) == before


def test_auto_resume_of_a_finished_run_without_its_drafter_publishes_it_again(run_copy, capsys):
    """As --resume decides: a finished run whose drafter/ was removed is continued from its last checkpoint,
    which publishes the drafter (it used to be reported as finished, the drafter left missing)."""
    summary = json.loads((run_copy / "summary.json").read_text())
    shutil.rmtree(run_copy / "drafter")
    code, err = trainer(capsys, run_copy, "--auto-resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert f"{run_copy} holds a finished run whose drafter/ is missing: continuing it (--resume)" in err, err
    assert (run_copy / "drafter" / "model.safetensors").is_file()
    again = json.loads((run_copy / "summary.json").read_text())  # the run's figures are kept
    assert [again[k] for k in ("losses", "first_loss", "final_loss", "tokens_per_s")] == \
        [summary[k] for k in ("losses", "first_loss", "final_loss", "tokens_per_s")] and len(summary["losses"]) == 6
    # without a checkpoint to publish it from there is nothing to continue: reported, nothing changed
    shutil.rmtree(run_copy / "drafter")
    shutil.rmtree(run_copy / "checkpoints")
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--auto-resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert "holds a finished run (its drafter/ is missing and no checkpoint is left to publish it from;" in \
        " ".join(err.split()), err
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("damage", ['{"steps": 6, "loss', "[]", '{"steps": "6"}'])  # cut short, not a summary
@pytest.mark.parametrize("flag", ["--auto-resume", "--resume"])
def test_a_finished_run_with_a_damaged_summary_is_reported_saying_so(damage, flag, run_copy, capsys):
    (run_copy / "summary.json").write_text(damage)
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, flag, *_resume_sets(run_copy))
    assert code == 0, err
    said = " ".join(err.split())
    assert "holds a finished run (" in said and f"its {run_copy / 'summary.json'} is damaged (not a readable summary" \
        in said, err
    assert snapshot(run_copy) == before


def test_resume_of_a_finished_run_with_nothing_left_keeps_its_figures(run_copy, capsys):
    """What every `make train INVENTORY=...` after the end does (the supervisor always resumes): it used to
    publish the drafter again and write a summary with no losses, first/final loss or tokens/s."""
    before = snapshot(run_copy)
    summary = json.loads((run_copy / "summary.json").read_text())
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert (f"{run_copy} holds a finished run (its last checkpoint is step 6, train.steps is 6; drafter: "
            f"{run_copy / 'drafter'}") in err, err
    assert "nothing changed" in err and "larger train.steps" in err and "--overwrite" in err
    assert snapshot(run_copy) == before
    assert json.loads((run_copy / "summary.json").read_text()) == summary and len(summary["losses"]) == 6
    # without its drafter (removed by hand) the resume publishes it again from the last checkpoint
    shutil.rmtree(run_copy / "drafter")
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy))
    assert code == 0 and "holds a finished run" not in err, err
    assert (run_copy / "drafter" / "model.safetensors").is_file()


def test_auto_resume_continues_an_unfinished_run_where_it_stopped(earlier_run, run_copy, capsys):
    stopped_at_step_3(run_copy)
    code, err = trainer(capsys, run_copy, "--auto-resume", *_resume_sets(run_copy))
    assert code == 0, err
    assert f"{run_copy} holds an unfinished run: continuing it (--resume)" in err
    assert "resumed from" in err and "at step 3" in err and "no checkpoint under" not in err
    finished = json.loads((earlier_run / "summary.json").read_text())
    summary = json.loads((run_copy / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["losses"] == finished["losses"][3:]  # as if never stopped
    assert (run_copy / "drafter" / "config.json").is_file()
    code, err = trainer(capsys, run_copy, "--auto-resume", *_resume_sets(run_copy))  # what a third make train does
    assert code == 0 and "holds a finished run" in err, err


def test_auto_resume_continues_a_finished_run_that_was_resumed_further_and_stopped(earlier_run, run_copy, capsys):
    """Finished at 6, resumed for 8 steps and stopped at 7: the summary (and drafter) of the first finish are
    still there, but the run did not finish; --auto-resume continues it from step 7."""
    further = [*_resume_sets(run_copy), "--set", "train.steps=8", "--set", "train.checkpoint_every=1"]
    code, err = trainer(capsys, run_copy, "--resume", *further)
    assert code == 0, err
    to_8 = json.loads((run_copy / "summary.json").read_text())
    shutil.rmtree(run_copy / "checkpoints" / "step-00000008")  # as the stop at 7 leaves it
    (run_copy / "checkpoints" / "latest").unlink()
    (run_copy / "checkpoints" / "latest").symlink_to("step-00000007")
    shutil.rmtree(run_copy / "drafter")
    shutil.copytree(earlier_run / "drafter", run_copy / "drafter")
    shutil.copy(earlier_run / "summary.json", run_copy / "summary.json")
    code, err = trainer(capsys, run_copy, "--auto-resume", *further)
    assert code == 0, err
    assert "holds an unfinished run: continuing it (--resume)" in err and "at step 7" in err, err
    assert json.loads((run_copy / "summary.json").read_text())["losses"] == to_8["losses"][1:]


def test_auto_resume_starts_a_new_run_where_there_is_none(tiny_target, tmp_path, capsys):
    out = tmp_path / "new"
    code, err = trainer(capsys, out, "--auto-resume", *sets(tiny_target, "train.steps=3"))
    assert code == 0, err
    assert "holds" not in err and "--resume" not in err and "resumed from" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["losses"]) == 3


@pytest.mark.parametrize("flags", [["--resume"], ["--overwrite"], ["--resume", "--overwrite"]])
def test_auto_resume_with_resume_or_overwrite_is_refused(flags, run_copy, capsys):
    stopped_at_step_3(run_copy)
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--auto-resume", *flags, *_resume_sets(run_copy))
    given = " and ".join(flags)
    assert code == 2, err
    assert (f"--auto-resume decides by itself whether to continue the run in {run_copy}, so {given} cannot go "
            f"with it: give --auto-resume alone, or {' or '.join(flags)} without it") in err
    assert snapshot(run_copy) == before


@pytest.mark.slow  # make, the venv check and a trainer process
def test_make_train_on_a_finished_run_dir_reports_it(run_copy):
    """The Makefile's local `make train`: no TRAIN_ARGS means --auto-resume (the embedded config's own steps
    do not matter, the run's summary does)."""
    before = snapshot(run_copy)
    env = {k: v for k, v in os.environ.items() if k not in ("INVENTORY", "MAKEFLAGS", "TRAIN_ARGS")}
    proc = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "train", f"RUN_DIR={run_copy}"],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--auto-resume" in proc.stdout and "holds a finished run" in " ".join(proc.stderr.split()), proc.stderr
    assert snapshot(run_copy) == before


# ---- storage faults on real mounts -------------------------------------------------------------

def test_read_only_output_directory(earlier_run, tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", "64m") as mnt:
        out = mnt / "run"
        shutil.copytree(earlier_run, out, symlinks=True)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        before = snapshot(out)
        code, err = trainer(capsys, out, "--resume", *_resume_sets(out))
        assert code == 1 and f"cannot write to the output directory {out}: read-only file system" in err, err
        assert snapshot(out) == before
        code, err = trainer(capsys, mnt / "new", *_resume_sets(out))
        assert code == 1 and "read-only file system" in err, err


def test_disk_full_during_a_save(earlier_run, tmp_path, capsys):
    """A real full file system (tmpfs): the save of step 7 fails, steps 3 and 6 stay as they were."""
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        out = mnt / "run"
        shutil.copytree(earlier_run, out, symlinks=True)
        checkpoint_bytes = sum(p.stat().st_size for p in (out / STEP6).iterdir())
        free = shutil.disk_usage(mnt).free
        with open(mnt / "filler", "wb") as f:  # leave half a checkpoint free
            f.write(b"\0" * (free - checkpoint_bytes // 2))
        before = {k: v for k, v in snapshot(out).items() if k.startswith(("checkpoints", "drafter", "summary"))}
        code, err = trainer(capsys, out, "--resume", *_resume_sets(out), "--set", "train.steps=8",
                            "--set", "train.checkpoint_every=1")
        assert code == 1, err
        assert f"saving checkpoint step 7 in {out / 'checkpoints'}: disk full (no space left on device" in err
        assert f"the previous checkpoint {out / STEP6} is intact" in err and "--resume" in err
        after = {k: v for k, v in snapshot(out).items() if k.startswith(("checkpoints", "drafter", "summary"))}
        assert after == before  # nothing half-written, no temporary directory left
        (mnt / "filler").unlink()
        code, err = trainer(capsys, out, "--resume", *_resume_sets(out), "--set", "train.steps=8",
                            "--set", "train.checkpoint_every=1")
        assert code == 0, err  # space freed: it continues from step 6


def test_disk_full_when_publishing_a_run_that_keeps_no_checkpoints(earlier_run, tmp_path, capsys):
    """train.checkpoint_every = 0: nothing for --resume to publish from, so the message says to train again."""
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        drafter_bytes = sum(p.stat().st_size for p in (earlier_run / "drafter").iterdir())
        with open(mnt / "filler", "wb") as f:  # room for the run's small files, not for the drafter
            f.write(b"\0" * (shutil.disk_usage(mnt).free - drafter_bytes // 2))
        code, err = trainer(capsys, mnt / "run", *_resume_sets(earlier_run), "--set", "train.checkpoint_every=0")
        assert code == 1 and f"publishing the drafter to {mnt / 'run' / 'drafter'}: disk full" in err, err
        assert "train.checkpoint_every = 0 kept no checkpoint" in err and "--overwrite" in err
        assert "--resume publishes" not in err


# ---- paths the run stores ----------------------------------------------------------------------

def test_resume_from_another_working_directory(tiny_target, tmp_path, capsys, monkeypatch):
    """An embedded run started with a relative --output-dir (and an assets.json of the older format, whose
    paths were relative to that working directory) resumes from anywhere."""
    run = tmp_path / "work" / "runs" / "emb"
    emb = run / "embedded"
    shutil.copytree(tiny_target["target"], emb / "target")
    (emb / "data").mkdir()
    shutil.copy(tiny_target["train"], emb / "data" / "train.jsonl")
    shutil.copy(tiny_target["eval"], emb / "data" / "eval.jsonl")
    (emb / "assets.json").write_text(json.dumps({"target": "runs/emb/embedded/target", "mask_token_id": 3,
                                                 "train": "runs/emb/embedded/data/train.jsonl",
                                                 "eval": "runs/emb/embedded/data/eval.jsonl"}))
    small = ["train.steps=3", "train.micro_batch=4", "train.num_anchors=8", "train.checkpoint_every=3",
             "eval.prompts=1", "eval.max_new_tokens=4"]
    monkeypatch.chdir(tmp_path / "work")
    code, err = trainer(capsys, Path("runs/emb"), *[x for s in small for x in ("--set", s)])
    assert code == 0, err
    stored = json.loads((run / "config.json").read_text())
    assert stored["target"]["path"] == "embedded/target"  # relative to the run directory
    assert stored["data"]["train"] == ["embedded/data/train.jsonl"]
    assert stored["output_dir"] == str(run)
    monkeypatch.chdir(tmp_path)
    code, err = trainer(capsys, run, "--resume", *[x for s in small + ["train.steps=5"] for x in ("--set", s)])
    assert code == 0, err
    assert "resumed from" in err and len(json.loads((run / "summary.json").read_text())["losses"]) == 2


# ---- the CLI itself ----------------------------------------------------------------------------

@pytest.mark.slow  # three processes that import torch and transformers: about 25 s on 2 idle cores
def test_exit_codes_and_tracebacks_of_the_real_command(tiny_target, tmp_path):
    cmd = [sys.executable, "-m", "dflash_trainer.train", "--config", "embedded"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd + ["--set", "train.lr=-1"], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 2 and "train.lr = -1: must be > 0" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(cmd + ["--set", "train.lr=-1"], capture_output=True, text=True, check=False,
                          env=dict(env, DFLASH_DEBUG="1"))
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr
    assert "train.lr = -1: must be > 0" in proc.stderr  # the message still ends it
    nan = cmd + ["--output-dir", str(tmp_path / "nan"), *sets(tiny_target, "train.lr=1e30", "train.warmup_ratio=0")]
    proc = subprocess.run(nan, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 1 and "lower train.lr or check the data" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "--debug" in proc.stderr


def test_resume_with_fewer_steps_than_the_last_checkpoint_is_refused(earlier_run, run_copy, capsys):
    """Stopped at step 3 (no drafter published), resumed with train.steps = 2: nothing could train, and the
    schedule would end before it started. Refused, naming the checkpoint's step, and nothing changes."""
    stopped_at_step_3(run_copy)
    before = snapshot(run_copy)
    code, err = trainer(capsys, run_copy, "--resume", *_resume_sets(run_copy), "--set", "train.steps=2")
    assert code == 2, err
    assert (f"the last checkpoint in {run_copy} is step 3, past train.steps = 2: give train.steps = 3 to publish "
            "the drafter of that checkpoint, or more to train further") in err, err
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("held", ["meta.json", "config.json"])
def test_a_dump_into_a_directory_holding_a_dump_or_a_run_is_refused(held, tiny_target, tmp_path, capsys):
    feats = tmp_path / "feats"
    feats.mkdir()
    (feats / held).write_text("{}")
    before = snapshot(feats)
    code, err = trainer(capsys, None, *sets(tiny_target), "--dump-features", str(feats))
    assert code == 2 and f"--dump-features {feats} already holds" in err and "give a new directory" in err, err
    assert snapshot(feats) == before
