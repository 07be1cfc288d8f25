"""The train loop end to end on CPU: summary, checkpoints, HF export, resume, config errors."""

import contextlib
import io
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.run import checkpoint as ckpt
from dflash_trainer.train import main, run

from tests.helpers.regenerate import free_port


def tiny_config(tiny_target, out, *extra):
    return load_config("embedded", [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={out}",
        "train.steps=6", "train.micro_batch=4", "train.num_anchors=8", "train.checkpoint_every=3",
        "train.keep_last=5", "train.log_every=1", "eval.prompts=2", "eval.max_new_tokens=8", *extra,
    ])


@pytest.fixture(scope="module")
def printed_run(tiny_target, tmp_path_factory):
    """The 6-step run, and what it printed on stderr (its log lines and the summary table, as in a log file)."""
    out = tmp_path_factory.mktemp("run")
    err = io.StringIO()  # module scope has no capsys
    with contextlib.redirect_stderr(err):
        summary = run(tiny_config(tiny_target, out))
    return out, summary, err.getvalue()


@pytest.fixture(scope="module")
def full_run(printed_run):
    return printed_run[:2]


def test_run_reports_and_exports(full_run):
    out, summary = full_run
    assert len(summary["losses"]) == 6 and summary["tokens_per_s"] > 0
    assert summary["steady_step_ms"] > 0 and summary["steady_mfu"] is None  # a CPU: no known peak
    assert summary["final_loss"] < summary["first_loss"]
    assert 1.0 <= summary["tau_before"] <= 8 and 1.0 <= summary["tau_after"] <= 8
    check = summary["serving_check"]  # the published drafter on the target's own forward scores the same
    assert not check["flagged"] and abs(check["mean_gap"]) < 0.02 and len(check["slot_accuracy_as_served"]) == 7
    assert json.loads((out / "summary.json").read_text())["drafter_dir"] == str(out / "drafter")
    drafter = DFlashDrafter.from_pretrained(out / "drafter")
    assert drafter.block_size == 8
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [3, 6]
    from tests.helpers.trackers import scalars_in

    logged = scalars_in(out / "tb")  # the default train.report_to: TensorBoard, read back with its own reader
    assert [step for step, _ in logged["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert logged["eval/tau_before"] == [(6, pytest.approx(summary["tau_before"]))]
    assert logged["eval/tau_after"] == [(6, pytest.approx(summary["tau_after"]))]
    assert len([t for t in logged if t.startswith("eval/slot_acceptance_after/")]) == 7  # block 8: slots 1-7
    assert json.loads((out / "trackers.json").read_text()) == {"tensorboard": {"dir": str(out / "tb")}}


def summary_rows(printed: str) -> dict[str, str]:
    """The printed summary table's rows, label -> value (a value folded over several lines joined)."""
    rows: dict[str, str] = {}
    label = None
    for line in printed[printed.index("DFlash training summary"):].splitlines():
        cells = line.split("│")
        if len(cells) != 4:  # a border or the title
            continue
        if cells[1].strip():
            label = cells[1].strip()
            rows[label] = cells[2].strip()
        elif label is not None:
            rows[label] += " " + cells[2].strip()
    return rows


def test_the_printed_summary_shows_the_steady_step_time_summary_json_records(printed_run):
    out, summary, printed = printed_run
    recorded = json.loads((out / "summary.json").read_text())
    assert recorded["steady_step_ms"] == summary["steady_step_ms"] > 0
    rows = summary_rows(printed)
    # 6 steps: the first 3 (compiles, warm-up) left out
    assert rows["step time (steady)"] == f"{recorded['steady_step_ms']:,.1f} ms/step (median of this run's steps 4-6)"
    assert rows["MFU (steady)"] == "n/a (no known GPU peak)"  # a CPU
    assert rows["steps"] == "6 (6 in this run)", rows  # the rows around them as before
    progress = [line for line in printed.splitlines() if line.startswith("train: step ")]
    assert len(progress) == 6 and all(re.search(r"\| [\d,.]+ ms/step \|", line) for line in progress), progress


def test_the_steady_step_figures_leave_the_first_steps_out():
    from dflash_trainer.run.summary import steady_mfu, steady_step_ms

    step_s = [9.0, 2.0, 1.0, 0.2, 0.4, 0.3]  # a compile, then warm-up, then steady steps
    assert steady_step_ms(step_s) == pytest.approx(300.0)  # the median of the last three
    assert steady_mfu(step_s, [5e12, 1e12, 1e12, 1e12, 2e12, 1e12], 1e14) == pytest.approx(4e12 / 0.9 / 1e14)
    assert steady_mfu(step_s, [1e12] * 6, None) is None  # no known peak (a CPU)
    assert steady_step_ms([5.0, 0.5]) == pytest.approx(500.0)  # a shorter run: its last step
    assert steady_step_ms([]) is None and steady_mfu([], [], 1e14) is None


def test_eval_of_a_run_logs_to_the_runs_trackers(full_run, tmp_path, capsys):
    from dflash_trainer.eval.cli import main as evaluate

    from tests.helpers.trackers import scalars_in

    out, _ = full_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy, symlinks=True)
    (copy / "trackers.json").write_text(json.dumps({"tensorboard": {"dir": str(copy / "tb")}}))
    code = evaluate(["--run", str(copy), "--out", str(tmp_path / "eval"), "--device", "cpu", "--limit", "1",
                     "--max-new-tokens", "4"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    logged = scalars_in(copy / "tb")
    assert logged["dflash_eval/all/tau"] == [(6, pytest.approx(report["overall"]["tau"]))]
    assert "eval/tau_after" in logged and len(logged["train/loss"]) == 6  # the training run's own, beside them


def test_the_published_drafter_is_complete_and_readable_by_other_users(full_run):
    """model card with the run's tau and the serve commands, the modelling file, dtype, open()'s file modes."""
    import os

    from transformers import AutoModel

    out, summary = full_run
    drafter = out / "drafter"
    card = (drafter / "README.md").read_text()
    assert "library_name: transformers" in card and "- dflash" in card  # the hub's front matter
    assert f"| held-out | 2 | {summary['tau_after']:.2f} |" in card
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 7' in card  # block 8
    assert "--speculative-algorithm DFLASH" in card and "--speculative-num-draft-tokens 8" in card
    assert json.loads((drafter / "config.json").read_text())["dtype"] == "float32"
    model, info = AutoModel.from_pretrained(drafter, trust_remote_code=True, output_loading_info=True)
    assert type(model).__name__ == "DFlashDraftModel" and not (info["missing_keys"] or info["unexpected_keys"])
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in drafter.iterdir()} == \
        {name: oct(0o666 & ~umask) for name in ("README.md", "config.json", "model.safetensors", "modeling_dflash.py")}


def test_resume_continues_with_the_same_losses(full_run, tiny_target, tmp_path):
    out, summary = full_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    shutil.copytree(out / "embedded", resumed / "embedded") if (out / "embedded").exists() else None
    again = run(tiny_config(tiny_target, resumed), resume=True)
    assert again["losses"] == summary["losses"][3:]  # bit-identical on CPU: same data, anchors, state


def as_old_checkpoint(step_dir: Path) -> None:
    """Rewrite a step directory as earlier versions wrote it: the state pickled into training_state.pt."""
    import torch

    state = ckpt.load_train_state(step_dir)
    for name in ("training_state.json", "training_state.safetensors", "checkpoint.json"):
        (step_dir / name).unlink()
    torch.save(state, step_dir / "training_state.pt")
    ckpt._write_manifest(step_dir, ckpt.step_of(step_dir))


def test_an_old_checkpoint_resumes_exactly(full_run, tiny_target, tmp_path):
    """training_state.pt of an earlier version loads through the weights-only unpickler, bit for bit."""
    out, summary = full_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    as_old_checkpoint(resumed / "checkpoints" / "step-00000003")
    again = run(tiny_config(tiny_target, resumed), resume=True)
    assert again["losses"] == summary["losses"][3:]
    assert (resumed / "checkpoints" / "step-00000006" / "training_state.json").is_file()  # saved anew as data


def test_a_run_killed_after_its_last_checkpoint_resumes_to_a_summary_with_its_losses(full_run, tiny_target, tmp_path):
    """Killed between the final checkpoint and summary.json: the resume trains nothing, publishes the drafter,
    and its summary has the losses that checkpoint recorded (it said loss n/a)."""
    out, summary = full_run
    resumed = tmp_path / "killed"
    shutil.copytree(out / "checkpoints" / "step-00000006", resumed / "checkpoints" / "step-00000006")
    shutil.copytree(out / "embedded", resumed / "embedded") if (out / "embedded").exists() else None
    again = run(tiny_config(tiny_target, resumed), resume=True)
    assert again["losses"] == summary["losses"]
    assert (again["first_loss"], again["final_loss"]) == (summary["first_loss"], summary["final_loss"])


def counted(monkeypatch, module, name: str) -> list[tuple]:
    """Wrap the real module.name in every dflash_trainer module that holds it (`from .x import name` copies
    it); the list gets one entry per call, and the real function does the work."""
    real, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    holders = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("dflash_trainer") and vars(m).get(name) is real]
    for holder in holders:
        monkeypatch.setattr(holder, name, wrapper)
    return calls


def test_a_resumed_start_reads_the_target_config_and_tokenizer_once(full_run, tiny_target, tmp_path, monkeypatch):
    """The resume check (the drafter the config builds against the checkpoint's) and the drafter's setup
    share one read of each: they were read twice on every rank."""
    from dflash_trainer.run import loading

    out, summary = full_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    configs = counted(monkeypatch, loading, "target_config")
    tokenizers = counted(monkeypatch, loading, "load_tokenizer")
    again = run(tiny_config(tiny_target, resumed), resume=True)
    assert again["losses"] == summary["losses"][3:]  # resumed from step 3, checked against it
    assert (len(configs), len(tokenizers)) == (1, 1)


def spied(monkeypatch, cls, name: str, events: list, kind: str) -> None:
    """Wrap the real classmethod cls.name: events gets (kind, the directory it reads) per call, and the real
    method does the work."""
    real = getattr(cls, name).__func__

    def wrapper(klass, directory, *args, **kwargs):
        events.append((kind, Path(directory).resolve()))
        return real(klass, directory, *args, **kwargs)

    monkeypatch.setattr(cls, name, classmethod(wrapper))


def test_a_resumed_start_with_init_from_reads_its_config_once_and_not_its_weights(full_run, tiny_target, tmp_path,
                                                                                   monkeypatch):
    """The checkpoint's weights are what a resumed run trains: drafter.init_from's were loaded only to be
    overwritten, and its config.json read twice (the resume check, then the drafter's setup). They are read
    once, at the end, for tau before training (the initial drafter, rebuilt)."""
    from dflash_trainer import train
    from transformers import Qwen3Config

    out, summary = full_run
    init_from = out / "drafter"  # the drafter's shape, with step 6's weights rather than step 3's
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    events: list[tuple] = []
    spied(monkeypatch, DFlashDrafter, "from_pretrained", events, "weights")
    spied(monkeypatch, Qwen3Config, "from_pretrained", events, "config")
    real_restore = train.restore

    def restore(run_state):
        events.append(("restore", run_state.latest))
        return real_restore(run_state)

    monkeypatch.setattr(train, "restore", restore)
    again = run(tiny_config(tiny_target, resumed, f"drafter.init_from={init_from}"), resume=True)
    assert again["losses"] == summary["losses"][3:]  # trained on from step 3's weights, bit for bit
    restored = events.index(("restore", resumed / "checkpoints" / "step-00000003"))
    assert events[:restored] == [("config", init_from)]  # the start: the resume check's read, nothing else
    assert events[restored + 1:].count(("weights", init_from)) == 1  # tau before training, at the end


def test_config_errors_are_clear(tiny_target, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"unknown key 'stepz' in \[train\] \(did you mean 'steps'\?\)"):
        load_config("embedded", ["train.stepz=3"])
    with pytest.raises(ConfigError, match='train.attention = "dense": must be one of auto, flex, sdpa'):
        load_config("embedded", ["train.attention=dense"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.toml"))
    assert main(["--config", "embedded", "--set", "data.context_buckets=[128, 64]"]) == 2
    assert "ascending" in capsys.readouterr().err


def test_bf16_moments_need_the_one_pass_update(tiny_target, tmp_path, capsys):
    """train.moments_dtype = bfloat16 where torch's AdamW would step (fp32 parameters, FSDP across ranks)
    is refused when the config loads, with the fix, before the run directory exists."""
    with pytest.raises(ConfigError, match='train.moments_dtype = "float16": must be one of float32, bfloat16'):
        load_config("embedded", ["train.moments_dtype=float16"])
    with pytest.raises(ConfigError, match="needs low-precision parameters, and train.dtype is float32.*set "
                                          "train.dtype = bfloat16, or train.moments_dtype = float32"):
        load_config("embedded", ["train.moments_dtype=bfloat16"])  # the embedded default trains in fp32
    with pytest.raises(ConfigError, match="cannot go with parallel.drafter_sharding = fsdp.*use drafter_sharding = "
                                          "ddp, or train.moments_dtype = float32"):
        load_config("embedded", ["train.moments_dtype=bfloat16", "train.dtype=bfloat16",
                                 "parallel.drafter_sharding=fsdp", "parallel.drafter_ranks=2"])
    # one drafter rank under fsdp is replicated (nothing to shard): the one-pass update steps it
    assert load_config("embedded", ["train.moments_dtype=bfloat16", "train.dtype=bfloat16",
                                    "parallel.drafter_sharding=fsdp"]).train.moments_dtype == "bfloat16"
    out = tmp_path / "refused"
    assert main(["--config", "embedded", "--output-dir", str(out), "--set", "train.moments_dtype=bfloat16"]) == 2
    assert "train.moments_dtype = bfloat16 needs low-precision parameters" in capsys.readouterr().err
    assert not out.exists()


def _checkpoint_moments(step_dir) -> set:
    adamw = ckpt.load_train_state(step_dir)["optimizer"]["adamw"]["state"]
    return {str(s[k].dtype) for s in adamw.values() for k in ("exp_avg", "exp_avg_sq")}


def test_bf16_moments_train_checkpoint_and_resume(tiny_target, tmp_path, capsys):
    """A bf16 run with bf16 moments: its checkpoints hold them in bf16, a resume continues with the same
    losses (the loaded moments are cast back to bf16), and a resume with fp32 moments continues in fp32 and
    lists the change."""
    bf16 = ["target.dtype=bfloat16", "train.dtype=bfloat16", "train.moments_dtype=bfloat16"]
    out = tmp_path / "run"
    summary = run(tiny_config(tiny_target, out, *bf16))
    assert len(summary["losses"]) == 6 and summary["final_loss"] < summary["first_loss"]
    assert _checkpoint_moments(out / "checkpoints" / "step-00000003") == {"torch.bfloat16"}

    for name, moments in (("same", "bfloat16"), ("widened", "float32")):
        resumed = tmp_path / name
        shutil.copytree(out / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
        (resumed / "config.json").write_text((out / "config.json").read_text())
        capsys.readouterr()
        again = run(tiny_config(tiny_target, resumed, *bf16[:2], f"train.moments_dtype={moments}"),
                    resume=True)
        said = capsys.readouterr().err
        assert _checkpoint_moments(resumed / "checkpoints" / "step-00000006") == {f"torch.{moments}"}
        if moments == "bfloat16":
            assert again["losses"] == summary["losses"][3:]  # bit-identical on CPU, as with fp32 moments
            assert "train.moments_dtype" not in said
        else:
            assert len(again["losses"]) == 3
            assert "--resume with changed settings: " in said and "train.moments_dtype: bfloat16 -> float32" in said


@pytest.mark.slow  # two trainer processes
def test_sigterm_finishes_the_step_writes_a_checkpoint_and_resume_continues(tiny_target, tmp_path):
    """What `make train-stop` / `systemctl stop` do: SIGTERM -> checkpoint at the current step -> exit 0."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "stopped"
    sets = [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", "train.steps=100000", "train.micro_batch=4",
        "train.num_anchors=8", "train.checkpoint_every=100000", "eval.prompts=1", "eval.max_new_tokens=4",
    ]  # far more steps than run before the signal: on a fast host 400 steps were over within the 3 s below
    cmd = [sys.executable, "-m", "dflash_trainer.train", "--config", "embedded", "--output-dir", str(out)]
    cmd += [x for s in sets for x in ("--set", s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out / "tb").exists() and time.monotonic() < deadline:  # the loop has started
        time.sleep(0.5)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM: stopping after this step's checkpoint" in stderr
    done = ckpt.list_checkpoints(out / "checkpoints")
    assert len(done) == 1 and 0 < done[0][0] < 100000, (done, stderr[-2000:])
    assert f"stopped at step {done[0][0]}" in stderr
    assert not (out / "summary.json").exists()  # an interrupted run writes no final summary
    resumed = run(load_config("embedded", sets + [f"output_dir={out}", "train.steps=" + str(done[0][0] + 2)]),
                  resume=True)
    assert len(resumed["losses"]) == 2  # continued from the stop, not from step 0
    assert os.path.isdir(out / "drafter")


def test_a_bf16_drafter_beside_an_fp32_target_trains_colocated_and_offline(tiny_target, tmp_path, monkeypatch):
    """train.dtype = bfloat16 on the embedded default, whose target stays fp32: the borrowed embedding and
    head come in the drafter's dtype (the step and the evaluation multiplied fp32 embeddings into bf16
    layers and stopped with 'expected m1 and m2 to have the same dtype')."""
    from dflash_trainer.run.target_rank import dump_features

    bf16 = ["train.dtype=bfloat16", "train.steps=2", "train.checkpoint_every=0"]
    assert tiny_config(tiny_target, tmp_path / "x", *bf16).target.dtype == "float32"  # the premise
    colocated = run(tiny_config(tiny_target, tmp_path / "colocated", *bf16))
    assert len(colocated["losses"]) == 2 and 1.0 <= colocated["tau_after"] <= 8
    feats = tmp_path / "feats"
    dump_features(tiny_config(tiny_target, tmp_path / "dump"), feats, 2)
    # a drafter rank reading dumped features: one process, as torchrun starts it
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    offline = run(tiny_config(tiny_target, tmp_path / "offline", *bf16, f"data.features_dir={feats}",
                              "parallel.target_ranks=0"))
    assert len(offline["losses"]) == 2 and all(math.isfinite(x) for x in offline["losses"])
