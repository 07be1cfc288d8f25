"""A drafter given by its hub id (drafter.init_from, dflash-eval --drafter) is read as a target's is: its
snapshot downloaded when the hub answers, read from the local hub cache when it does not, and a clear error
when neither works. Against a local stand-in of the hub (tests/helpers/hub_standin.py), never the network."""

from __future__ import annotations

import json

import pytest
from dflash_trainer.eval.cli import main as evaluate
from dflash_trainer.train import main as train

from tests.helpers.hub_standin import hub_standin

DRAFTER = "dflash-test/tiny-drafter"


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    """A random drafter of the embedded config's shape (2 layers, blocks of 8) for the tiny target."""
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from transformers import AutoConfig, AutoTokenizer

    target = tiny_target["target"]
    mask = AutoTokenizer.from_pretrained(target).mask_token_id
    config = drafter_config(AutoConfig.from_pretrained(target), DrafterShape(num_layers=2, block_size=8,
                                                                             mask_token_id=mask))
    out = tmp_path_factory.mktemp("hub-drafter")
    DFlashDrafter(config).save_pretrained(out)
    (out / "README.md").write_text("# a drafter\n")
    return out


@pytest.fixture
def hub(drafter_dir, tmp_path, monkeypatch):
    with hub_standin(monkeypatch, tmp_path / "hub-cache") as standin:
        standin.add_dir(DRAFTER, drafter_dir)
        yield standin


def run_eval(capsys, drafter: str, tiny_target, out) -> tuple[int, str]:
    code = evaluate(["--drafter", drafter, "--target", tiny_target["target"], "--prompts", tiny_target["eval"],
                     "--out", str(out), "--device", "cpu", "--max-new-tokens", "2", "--limit", "1"])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, " ".join(err.split())


def test_eval_reads_a_drafter_by_its_hub_id_then_from_the_cache(hub, tiny_target, tmp_path, capsys, monkeypatch):
    code, err = run_eval(capsys, DRAFTER, tiny_target, tmp_path / "eval")
    assert code == 0, err
    served = [path for _, path in hub.requests if path.startswith(f"/{DRAFTER}/resolve/")]
    assert {p.rsplit("/", 1)[1] for p in served} == {"config.json", "model.safetensors"}  # never README or code
    results = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert "hub-cache" in results["drafter"]  # the snapshot in the cache the environment names
    asked = len(hub.requests)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # offline: the cached snapshot serves
    code, err = run_eval(capsys, DRAFTER, tiny_target, tmp_path / "eval-offline")
    assert code == 0 and len(hub.requests) == asked, err


@pytest.mark.slow  # dflash-eval in a process of its own: the hub endpoint from HF_ENDPOINT alone
def test_hf_endpoint_alone_points_a_command_at_the_hub(hub, tiny_target, tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "own-cache"), OMP_NUM_THREADS="1")
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run([sys.executable, "-m", "dflash_trainer.eval", "--drafter", DRAFTER, "--target",
                           tiny_target["target"], "--prompts", tiny_target["eval"], "--out", str(tmp_path / "eval"),
                           "--device", "cpu", "--max-new-tokens", "2", "--limit", "1"],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(f"/{DRAFTER}/resolve/" in path for _, path in hub.requests)
    assert list((tmp_path / "own-cache").glob("models--dflash-test--tiny-drafter/snapshots/*/model.safetensors"))


def test_an_uncached_hub_id_offline_is_refused_with_the_fix(hub, tiny_target, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    code, err = run_eval(capsys, DRAFTER, tiny_target, tmp_path / "eval")
    assert code == 2, err
    assert f"--drafter '{DRAFTER}': no such drafter directory" in err, err
    assert "the hub is switched off (HF_HUB_OFFLINE)" in err and "not in the local hub cache" in err, err
    assert f"hf download {DRAFTER}" in err, err
    assert hub.requests == [] and not (tmp_path / "eval").exists()


def test_an_id_the_hub_does_not_have_is_named(hub, tiny_target, tmp_path, capsys):
    code, err = run_eval(capsys, "dflash-test/no-such-drafter", tiny_target, tmp_path / "eval")
    assert code == 2, err
    assert "--drafter 'dflash-test/no-such-drafter': no such drafter directory" in err, err
    assert "the hub has no such repository" in err, err


def test_training_starts_from_a_drafter_on_the_hub(hub, tiny_target, tmp_path, capsys):
    from safetensors.torch import load, load_file

    out = tmp_path / "run"
    settings = [f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
                f"data.eval={json.dumps([tiny_target['eval']])}", "train.steps=2", "train.micro_batch=4",
                "train.num_anchors=8", "train.checkpoint_every=0", "eval.prompts=1", "eval.max_new_tokens=2",
                f"drafter.init_from={DRAFTER}"]
    code = train(["--config", "embedded", "--output-dir", str(out), *[x for s in settings for x in ("--set", s)]])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0, err
    assert f"drafter.init_from {DRAFTER}: the hub's drafter, from" in err, err
    assert any(path == f"/api/models/{DRAFTER}/revision/main" for _, path in hub.requests)
    trained, start = load_file(out / "drafter" / "model.safetensors"), load(hub.repos[DRAFTER]["model.safetensors"])
    assert trained.keys() == start.keys() and any(not (trained[k] == start[k]).all() for k in trained)



# ---- publish.push_to / --push-to: the drafter directory uploaded after training ----------------------

def push_settings(tiny_target, *extra: str) -> list[str]:
    settings = [f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
                f"data.eval={json.dumps([tiny_target['eval']])}", "train.steps=2", "train.micro_batch=4",
                "train.num_anchors=8", "train.checkpoint_every=0", "eval.prompts=1", "eval.max_new_tokens=2", *extra]
    return [x for s in settings for x in ("--set", s)]


def test_push_to_uploads_every_file_of_the_drafter_directory(hub, tiny_target, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_standin")  # the stand-in takes any login
    out = tmp_path / "run"
    code = train(["--config", "embedded", "--output-dir", str(out), "--push-to", "dflash-test/pushed",
                  *push_settings(tiny_target)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0, err
    pushed = hub.repos["dflash-test/pushed"]
    local = {p.name: p.read_bytes() for p in (out / "drafter").iterdir()}
    assert pushed == local and {"config.json", "model.safetensors", "README.md"} <= set(pushed)  # the card too
    assert "held-out" in pushed["README.md"].decode()  # with the run's tau, written before the push
    recorded = json.loads((out / "summary.json").read_text())["pushed_to"]
    assert recorded["repo"] == "dflash-test/pushed" and hub.commit("dflash-test/pushed") in recorded["commit"]
    assert f"pushed to dflash-test/pushed: {recorded['commit']}" in err


def test_push_to_is_refused_before_training_when_the_hub_is_off(hub, tiny_target, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    out = tmp_path / "run"
    code = train(["--config", "embedded", "--output-dir", str(out), *push_settings(tiny_target,
                                                                                  "publish.push_to=dflash-test/x")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "publish.push_to dflash-test/x: the hub is switched off (HF_HUB_OFFLINE)" in err, err
    assert "hf upload dflash-test/x OUTPUT/drafter" in err and not (out / "checkpoints").exists()
    code = train(["--config", "embedded", "--output-dir", str(out), "--push-to", "no-org", *push_settings(tiny_target)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and 'publish.push_to = "no-org" is no hub repository: give one as org/name' in err, err


def test_a_failed_push_names_the_fix_and_keeps_the_drafter(hub, tiny_target, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    hub.refuse_writes = True  # the hub answers 403, as to a token without write access
    out = tmp_path / "run"
    code = train(["--config", "embedded", "--output-dir", str(out), "--push-to", "dflash-test/pushed",
                  *push_settings(tiny_target)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1, err
    assert ("pushing " + str(out / "drafter") + " to the hub repository dflash-test/pushed failed (no login that may "
            "write there") in err, err
    assert f"hf upload dflash-test/pushed {out / 'drafter'}" in err and (out / "drafter" / "model.safetensors").is_file()
