"""dflash-eval on CPU with a tiny target: the training run's tau, z-lab's dflash_generate, the outputs, bad input.

The drafter is trained briefly on the target's own greedy answers to the evaluation prompts, so it
accepts some blocks and not others: the acceptance lengths compared below vary from step to step.
"""

import json
import struct
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from dflash_trainer.config import load_config
from dflash_trainer.data.prompts import prompt_messages, render_prompt, row_messages
from dflash_trainer.decoding.speculative import greedy_generate, stop_token_ids
from dflash_trainer.eval.cli import EvalError, main, run_defaults
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.optim import MasterWeightAdamW
from dflash_trainer.target.frozen import FrozenTarget
from dflash_trainer.train import run
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.mounts import tmpfs
from tests.helpers.training import sdpa_step

BLOCK, PROMPTS, NEW = 8, 4, 24


def eval_prompts(tiny_target, tokenizer) -> list[list[int]]:
    rows = [json.loads(line) for line in Path(tiny_target["eval"]).read_text().splitlines()]
    return [render_prompt(tokenizer, prompt_messages(row_messages(r))) for r in rows[:PROMPTS]]


@pytest.fixture(scope="module")
def models(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], dtype=torch.float32)
    return tokenizer, model


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, models, tmp_path_factory):
    """A drafter trained for a while on the target's greedy answers to the evaluation prompts."""
    tokenizer, model = models
    config = drafter_config(model.config, DrafterShape(num_layers=2, block_size=BLOCK,
                                                       mask_token_id=tokenizer.mask_token_id))
    target = FrozenTarget(model, config.dflash_config["target_layer_ids"])
    stop = stop_token_ids(model, tokenizer)
    samples = []
    for prompt in eval_prompts(tiny_target, tokenizer):
        full = greedy_generate(target, prompt, NEW, stop)
        ids = torch.tensor([full])
        mask = torch.zeros_like(ids, dtype=torch.uint8)
        mask[0, len(prompt):] = 1
        samples.append((ids, mask, target.features(ids)))
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    opt = MasterWeightAdamW(drafter.parameters(), lr=3e-3, max_grad_norm=1.0)
    for step in range(120):  # partly learnt: some blocks accepted whole, others not
        ids, mask, feats = samples[step % len(samples)]
        sdpa_step(drafter, opt, target, ids, mask, feats, NEW, step)
    out = tmp_path_factory.mktemp("drafter")
    drafter.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def training_run(tiny_target, drafter_dir, tmp_path_factory):
    """A training run that starts from that drafter (init_from) and reports tau at its end."""
    out = tmp_path_factory.mktemp("run")
    summary = run(load_config("embedded", [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={out}", f"drafter.init_from={drafter_dir}",
        "train.steps=2", "train.lr=1e-9", "train.micro_batch=4", "train.num_anchors=8", "train.checkpoint_every=0",
        f"eval.prompts={PROMPTS}", f"eval.max_new_tokens={NEW}",
    ]))
    return out, summary


@pytest.fixture(scope="module")
def evaluated(training_run, tmp_path_factory):
    out, _ = training_run
    where = tmp_path_factory.mktemp("eval") / "eval"
    assert main(["--run", str(out), "--out", str(where)]) == 0
    report = json.loads((where / "eval.json").read_text())
    requests = [json.loads(line) for line in (where / "requests.jsonl").read_text().splitlines()]
    return where, report, requests


def test_tau_equals_the_training_runs_tau(training_run, evaluated, tiny_target, tmp_path):
    out, summary = training_run
    _, report, _ = evaluated
    held_out = report["sets"]["held-out"]
    assert held_out["prompts"] == PROMPTS and report["max_new_tokens"] == NEW
    assert held_out["tau"] == summary["tau_after"]
    assert 1.2 < held_out["tau"] < BLOCK  # some blocks accepted, not all: the comparison means something
    card = (out / "drafter" / "README.md").read_text()  # the drafter's model card carries the last evaluation's tau
    assert f"| held-out | {PROMPTS} | {held_out['tau']:.2f} |" in card and "measured by dflash-eval" in card
    # The same prompts from the chat file itself (rendered by the chat template) give the same figure.
    again = tmp_path / "again"
    assert main(["--drafter", str(out / "drafter"), "--target", tiny_target["target"], "--prompts",
                 tiny_target["eval"], "--limit", str(PROMPTS), "--max-new-tokens", str(NEW), "--dtype", "float32",
                 "--out", str(again)]) == 0
    assert json.loads((again / "eval.json").read_text())["sets"]["eval"]["tau"] == summary["tau_after"]
    card = (out / "drafter" / "README.md").read_text()
    assert f"| eval | {PROMPTS} | {summary['tau_after']:.2f} |" in card and "| held-out |" not in card


def zlab_generate(drafter_path, model, tokenizer, prompts):
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is installed by `make venv`")
    theirs = zlab.DFlashDraftModel.from_pretrained(drafter_path, dtype=torch.float32).eval()
    stop = sorted(stop_token_ids(model, tokenizer))
    # return_stats (the acceptance lengths) also times the decode with torch.cuda.synchronize: on CPU, a plain clock.
    with mock.patch.object(zlab, "_cuda_time", time.perf_counter):
        runs = [zlab.dflash_generate(theirs, model, torch.tensor([p]), NEW, stop, return_stats=True) for p in prompts]
    return [(r.output_ids[0].tolist(), r.acceptance_lengths) for r in runs]


def test_same_tokens_and_acceptance_lengths_as_zlab_dflash_generate(evaluated, training_run, models):
    out, _ = training_run
    _, report, requests = evaluated
    tokenizer, model = models
    prompts = [json.loads(line)["prompt_ids"] for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    theirs = zlab_generate(out / "drafter", model, tokenizer, prompts)
    for prompt, request, (tokens, lengths) in zip(prompts, requests, theirs, strict=True):
        assert request["output_ids"] == tokens[len(prompt):]
        assert request["accept_lengths"] == lengths
        assert request["new_tokens"] == len(tokens) - len(prompt)
    flat = [n for _, lengths in theirs for n in lengths]
    assert report["sets"]["held-out"]["tau"] == pytest.approx(sum(flat) / len(flat), abs=1e-12)
    assert len(set(flat)) > 1  # acceptance lengths vary step to step


def test_outputs_equal_target_only_decoding_token_for_token(evaluated, training_run, models):
    out, _ = training_run
    _, report, requests = evaluated
    tokenizer, model = models
    target = FrozenTarget(model, [0])
    prompts = [json.loads(line)["prompt_ids"] for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    stop = stop_token_ids(model, tokenizer)
    theirs = zlab_generate(out / "drafter", model, tokenizer, prompts)
    for prompt, request, (tokens, _) in zip(prompts, requests, theirs, strict=True):
        assert greedy_generate(target, prompt, NEW, stop) == tokens  # z-lab's output is the target's greedy one
        assert request["equal_to_target_only"]
    assert report["sets"]["held-out"]["outputs_equal"] == PROMPTS
    assert report["sets"]["held-out"]["near_tie_divergences"] == []


def test_a_drafter_directory_written_by_zlabs_package_loads(drafter_dir, models, tiny_target, tmp_path):
    """z-lab's DFlashDraftModel (a transformers PreTrainedModel) saves the directory; dflash-eval reads it and
    decodes exactly as z-lab's dflash_generate does."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is installed by `make venv`")
    from transformers import Qwen3Config

    tokenizer, model = models
    ours = json.loads((drafter_dir / "config.json").read_text())
    config = Qwen3Config(  # the published drafters' config.json fields, shrunk
        architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        block_size=BLOCK, num_target_layers=ours["num_target_layers"], dflash_config=ours["dflash_config"],
        hidden_size=ours["hidden_size"], intermediate_size=ours["intermediate_size"], num_hidden_layers=2,
        num_attention_heads=ours["num_attention_heads"], num_key_value_heads=ours["num_key_value_heads"],
        head_dim=ours["head_dim"], vocab_size=ours["vocab_size"], max_position_embeddings=512,
        rms_norm_eps=ours["rms_norm_eps"], tie_word_embeddings=False)
    theirs = zlab.DFlashDraftModel(config)
    from safetensors.torch import load_file

    theirs.load_state_dict(load_file(drafter_dir / "model.safetensors"))  # strict: every key carries over
    written = tmp_path / "zlab-drafter"
    theirs.save_pretrained(written)
    assert main(["--drafter", str(written), "--target", tiny_target["target"], "--prompts", tiny_target["eval"],
                 "--limit", str(PROMPTS), "--max-new-tokens", str(NEW), "--out", str(tmp_path / "e")]) == 0
    requests = [json.loads(line) for line in (tmp_path / "e" / "requests.jsonl").read_text().splitlines()]
    expected = zlab_generate(written, model, tokenizer, eval_prompts(tiny_target, tokenizer))
    assert [r["accept_lengths"] for r in requests] == [lengths for _, lengths in expected]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_eval_json_has_every_field_and_eval_png_is_a_readable_figure(evaluated):
    where, report, requests = evaluated
    for key in ("drafter", "target", "device", "dtype", "block_size", "max_new_tokens", "temperature",
                "stop_token_ids", "sets", "overall", "definitions"):
        assert key in report, key
    s = report["sets"]["held-out"]
    for key in ("tau", "tau_per_request_mean", "verify_steps", "tokens", "slot_acceptance",
                "acceptance_length_histogram", "acceptance_length_counts", "speedup", "speculative_tokens_per_s",
                "target_only_tokens_per_s", "outputs_equal", "near_tie_divergences"):
        assert key in s, key
    assert {"tau", "tau_per_request_mean", "slot_acceptance", "speedup"} <= set(report["definitions"])
    assert len(s["slot_acceptance"]) == BLOCK - 1 and len(s["acceptance_length_histogram"]) == BLOCK + 1
    assert sum(s["acceptance_length_counts"]) == s["verify_steps"] == sum(len(r["accept_lengths"]) for r in requests)
    assert sum(n * c for n, c in enumerate(s["acceptance_length_counts"])) == s["tokens"] - PROMPTS  # + prefill token
    assert s["slot_acceptance"] == sorted(s["slot_acceptance"], reverse=True)  # a later slot needs the earlier ones
    per_request = [sum(r["accept_lengths"]) / len(r["accept_lengths"]) for r in requests]
    assert s["tau_per_request_mean"] == pytest.approx(sum(per_request) / len(per_request))
    assert s["speedup"] > 0 and s["speculative_tokens_per_s"] > 0 and s["target_only_tokens_per_s"] > 0
    width, height = png_size(where / "eval.png")
    assert 800 <= width <= 3000 and 300 <= height <= 2000
    from PIL import Image

    with Image.open(where / "eval.png") as im:
        im.verify()


def test_sampled_temperatures_report_tau_each_seeded(drafter_dir, tiny_target, tmp_path):
    """--temperature 0 0.8: greedy (outputs checked) then speculative sampling (not compared), tau for each; a
    temperature's outputs depend on the seed alone, not on the temperatures evaluated before it."""
    argv = ["--drafter", str(drafter_dir), "--target", tiny_target["target"], "--prompts", tiny_target["eval"],
            "--limit", str(PROMPTS), "--max-new-tokens", str(NEW), "--dtype", "float32", "--seed", "3"]
    assert main([*argv, "--temperature", "0", "0.8", "--out", str(tmp_path / "both")]) == 0
    report = json.loads((tmp_path / "both" / "eval.json").read_text())
    assert report["temperatures"] == [0.0, 0.8] and report["temperature"] == 0.0 and report["seed"] == 3
    greedy, sampled = report["by_temperature"]["0"], report["by_temperature"]["0.8"]
    assert greedy["sets"] == report["sets"] and greedy["sets"]["eval"]["outputs_equal"] == PROMPTS
    assert sampled["sets"]["eval"]["outputs_equal"] is None and sampled["overall"]["outputs_equal"] is None
    assert 1.0 <= sampled["sets"]["eval"]["tau"] <= BLOCK and sampled["sets"]["eval"]["speedup"] > 0
    rows = [json.loads(line) for line in (tmp_path / "both" / "requests.jsonl").read_text().splitlines()]
    assert [r["temperature"] for r in rows] == [0.0] * PROMPTS + [0.8] * PROMPTS
    assert all(r["equal_to_target_only"] is None for r in rows[PROMPTS:])
    assert png_size(tmp_path / "both" / "eval.png")[0] > 0
    assert main([*argv, "--temperature", "0.8", "--out", str(tmp_path / "alone")]) == 0
    alone = [json.loads(line) for line in (tmp_path / "alone" / "requests.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in alone] == [r["output_ids"] for r in rows[PROMPTS:]]
    assert main([*argv[:-1], "4", "--temperature", "0.8", "--out", str(tmp_path / "other")]) == 0
    other = [json.loads(line) for line in (tmp_path / "other" / "requests.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in other] != [r["output_ids"] for r in alone]  # the seed matters


# ---- bad input: a clear error naming the fix, nothing written ------------------------------------

@pytest.fixture(scope="module")
def bad_inputs(tiny_target, drafter_dir, tmp_path_factory):
    """Drafter directories that do not fit the tiny target, and prompt files without a usable prompt."""
    root = tmp_path_factory.mktemp("bad")
    raw = json.loads((drafter_dir / "config.json").read_text())

    def variant(name, **changes):
        d = root / name
        d.mkdir()
        cfg = {**raw, **changes}
        (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
        (d / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
        return d

    layers = raw["num_target_layers"]
    (root / "no-prompt.jsonl").write_text(json.dumps({"text": "no prompt here"}) + "\n"
                                          + json.dumps({"messages": [{"role": "system", "content": "s"}]}) + "\n")
    return {
        "no_dflash_config": variant("no-dflash", dflash_config=None),
        "layer_ids": variant("layer-ids", dflash_config={**raw["dflash_config"], "target_layer_ids": [1, layers + 2]}),
        "hidden": variant("hidden", hidden_size=raw["hidden_size"] * 2),
        "block": variant("block", block_size=1000),  # within drafter.block_size's bound (1024), past the context
        "no_prompt": root / "no-prompt.jsonl",
    }


@pytest.mark.parametrize("case, extra, message", [
    ("no_dflash_config", [], "has no dflash_config"),
    ("layer_ids", [], "target_layer_ids .* are not all layers of the target"),
    ("hidden", [], "hidden size is 128, the target's 64.*trained for"),
    ("block", [], "block size 1000 is above target .* context of 512"),
    ("missing_prompts", [], "does not exist: fix the path"),
    ("no_prompt", [], r"holds no usable prompt \(1 x no prompt field \(row \d\); 1 x no user turn \(row \d\)\)"),
    ("max_new_tokens", ["--max-new-tokens", "0"], "argument --max-new-tokens: 0: must be >= 1"),
    ("temperature", ["--temperature", "0.7", "0.7"], "a temperature is given twice; give each once"),
    ("negative_temperature", ["--temperature", "-1"], "argument --temperature: -1: must be >= 0"),
    ("fp8_fp32", ["--target-quantization", "fp8", "--dtype", "float32"], "fp8 needs a bf16 target.*add --dtype bfloat16"),
])
def test_bad_input_is_a_clear_error_and_writes_nothing(case, extra, message, bad_inputs, drafter_dir, tiny_target,
                                                       tmp_path, capsys):
    import re

    drafter = bad_inputs.get(case, drafter_dir) if case != "no_prompt" else drafter_dir
    prompts = {"missing_prompts": str(tmp_path / "nope.jsonl"), "no_prompt": str(bad_inputs["no_prompt"])}
    out = tmp_path / "out"
    argv = ["--drafter", str(drafter), "--target", tiny_target["target"], "--out", str(out),
            "--prompts", prompts.get(case, tiny_target["eval"]), *extra]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(message, err), err
    assert not out.exists()


def test_an_unwritable_out_is_refused_before_the_evaluation_runs(drafter_dir, tiny_target, tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mnt:
        argv = ["--drafter", str(drafter_dir), "--target", tiny_target["target"], "--out", str(mnt / "a" / "out"),
                "--prompts", tiny_target["eval"]]
        with mock.patch("dflash_trainer.eval.cli.evaluate") as evaluate:
            assert main(argv) == 1
        evaluate.assert_not_called()
        err = " ".join(capsys.readouterr().err.split())
        assert f"cannot write to --out {mnt / 'a' / 'out'} (in {mnt}): read-only file system" in err, err
        assert not (mnt / "a").exists()


def test_a_full_disk_after_the_evaluation_keeps_the_numbers_on_the_terminal(drafter_dir, tiny_target, tmp_path,
                                                                             capsys):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        with open(mnt / "filler", "wb", buffering=0) as f:  # every byte taken; the writability probe needs none
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        argv = ["--drafter", str(drafter_dir), "--target", tiny_target["target"], "--out", str(mnt / "out"),
                "--prompts", tiny_target["eval"], "--limit", "1", "--max-new-tokens", "4"]
        assert main(argv) == 1
        err = " ".join(capsys.readouterr().err.split())
        assert f"writing the results to --out {mnt / 'out'}: disk full (no space left on device), " in err, err
        assert "MiB free there. Free space" in err and "DFlash drafter evaluation" in err  # the table came first
        assert not [p.name for p in (mnt / "out").iterdir() if ".tmp" in p.name]


def test_a_disk_that_fills_at_the_figure_keeps_the_earlier_figure_whole(evaluated, drafter_dir, tiny_target,
                                                                         tmp_path, capsys):
    """eval.json and requests.jsonl fit, eval.png does not: the error says so in words, the earlier run's
    eval.png is still there whole (replaced in one step or not at all) and no temporary is left."""
    earlier = (evaluated[0] / "eval.png").read_bytes()
    assert len(earlier) > 32 * 1024  # too large for the room left below
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        out = mnt / "out"
        out.mkdir()
        (out / "eval.png").write_bytes(earlier)
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
            f.truncate(f.tell() - 32 * 1024)  # room for the two small files, not for a figure
        argv = ["--drafter", str(drafter_dir), "--target", tiny_target["target"], "--out", str(out),
                "--prompts", tiny_target["eval"], "--limit", "1", "--max-new-tokens", "4"]
        assert main(argv) == 1
        err = " ".join(capsys.readouterr().err.split())
        assert f"writing the results to --out {out}: disk full (no space left on device), " in err, err
        assert json.loads((out / "eval.json").read_text())["sets"]["eval"]["prompts"] == 1  # written before it
        assert len((out / "requests.jsonl").read_text().splitlines()) == 1
        assert (out / "eval.png").read_bytes() == earlier
        assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.png", "requests.jsonl"]


def test_a_missing_target_is_refused_without_waiting_on_the_hub(drafter_dir, tmp_path, monkeypatch, capsys):
    from dflash_trainer.infra import hub

    monkeypatch.setattr(hub, "offline", lambda: True)
    monkeypatch.chdir(tmp_path)
    argv = ["--drafter", str(drafter_dir), "--target", "models/Qwen3-8B", "--out", str(tmp_path / "out"),
            "--prompts", str(tmp_path / "p.jsonl")]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--target 'models/Qwen3-8B': no such directory ({tmp_path / 'models/Qwen3-8B'})" in err, err
    assert not (tmp_path / "out").exists()


def test_prompt_sets_are_named_by_file_or_by_name(drafter_dir, tiny_target, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(Path(tiny_target["eval"]).read_text())
    questions = tmp_path / "math_questions.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "id": f"q{i}"}) + "\n"
                                 for i, q in enumerate(["What is 2 plus 3?", "Count from 3 to 9."])))
    out = tmp_path / "out"
    assert main(["--drafter", str(drafter_dir), "--target", tiny_target["target"], "--prompts", str(chat),
                 "--name", f"math={questions}", "--limit", "2", "--max-new-tokens", "8", "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert list(report["sets"]) == ["chat", "math"]
    assert report["sets"]["math"]["prompts"] == 2 and report["overall"]["prompts"] == 4
    ids = [json.loads(line)["id"] for line in (out / "requests.jsonl").read_text().splitlines()]
    assert ids[2:] == ["q0", "q1"]


def test_a_divergence_is_an_error_unless_the_targets_two_tokens_tie_within_rounding(models, tiny_target):
    from dflash_trainer.eval.cli import OutputMismatch, compare

    tokenizer, model = models
    target = FrozenTarget(model, [0])
    prompt = eval_prompts(tiny_target, tokenizer)[0]
    ref = greedy_generate(target, prompt, 6)
    with torch.no_grad():
        logits = model(torch.tensor([ref[:-1]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    gap = float(logits[ref[-1]] - logits[runner_up])
    spec = ref[:-1] + [runner_up]
    assert compare(target, len(prompt), ref, list(ref), 1e-4) is None
    with pytest.raises(OutputMismatch, match=f"generated token 5: speculative decoding gave {runner_up}"):
        compare(target, len(prompt), spec, ref, 1e-4)  # a real disagreement: the target prefers its token
    scale = float(logits.abs().max())
    tie = compare(target, len(prompt), spec, ref, 2 * gap / scale)  # a tolerance above the gap: a near tie
    assert tie["position"] == 5 and tie["logit_gap"] == pytest.approx(gap, rel=1e-4)
    with pytest.raises(OutputMismatch, match="stopped after 5 tokens, target-only decoding after 6"):
        compare(target, len(prompt), ref[:-1], ref, 1.0)


def test_a_runs_stored_paths_resolve_from_any_directory(tmp_path, monkeypatch):
    """A run stores paths inside it relative to it (the embedded default's target is OUT/embedded/target):
    --run reads them back against the run directory, wherever the evaluation starts."""
    from dflash_trainer.run import run_dir

    out = tmp_path / "run"
    for sub in ("embedded/target", "embedded/data", "drafter"):
        (out / sub).mkdir(parents=True)
    for name in ("train", "eval"):
        (out / f"embedded/data/{name}.jsonl").write_text("")
    (out / "drafter/config.json").write_text("{}")
    cfg = load_config("embedded", [f"output_dir={out}", f"target.path={out / 'embedded/target'}",
                                   f"data.train={json.dumps([str(out / 'embedded/data/train.jsonl')])}",
                                   f"data.eval={json.dumps([str(out / 'embedded/data/eval.jsonl')])}"])
    stored = run_dir.stored_config(cfg)
    assert stored["target"]["path"] == "embedded/target"  # what makes the run movable
    (out / "config.json").write_text(json.dumps(stored))
    monkeypatch.chdir(tmp_path)
    defaults = run_defaults(out)
    assert defaults["target"] == str((out / "embedded/target").resolve())
    assert defaults["names"] == [f"held-out={(out / 'embedded/data/eval.jsonl').resolve()}"]
    (out / "config.json").write_text('{"target": ')  # damaged
    with pytest.raises(EvalError, match=r"config.json cannot be read .* it is damaged"):
        run_defaults(out)
    (out / "config.json").write_text('{"target": {}}')  # another layout
    with pytest.raises(EvalError, match="lacks 'path'"):
        run_defaults(out)


def test_fast_loops_give_the_reference_loops_tokens_and_acceptance_lengths(models, drafter_dir, tiny_target,
                                                                            monkeypatch):
    """fast_decode (static slot cache; eager on a CPU) against speculative.py's loops, at batch 1 and 3: rows
    of a batch accept different lengths, and a cache too short for their holes is packed on the way."""
    from dflash_trainer.decoding import fast as fast_decode
    from dflash_trainer.decoding.speculative import speculative_generate

    tokenizer, model = models
    drafter = DFlashDrafter.from_pretrained(drafter_dir).eval()
    target = FrozenTarget(model, drafter.target_layer_ids)
    prompts = eval_prompts(tiny_target, tokenizer)
    stop = stop_token_ids(model, tokenizer)
    reference = [speculative_generate(drafter, target, p, NEW, stop) for p in prompts]
    assert len({n for r in reference for n in r.accept_lengths}) >= 3  # the rows' acceptance lengths differ
    greedy = [greedy_generate(target, p, NEW, stop) for p in prompts]
    for batch in (1, 3):
        loops = fast_decode.FastDecoding(target, drafter, batch)
        fast = loops.speculative(prompts, NEW, stop)
        assert [r.tokens for r in fast] == [r.tokens for r in reference]
        assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in reference]
        assert loops.greedy(prompts, NEW, stop) == greedy
    # Room for the answer and one block only: the holes of rows that accepted less fill it, and are packed away.
    monkeypatch.setattr(fast_decode, "cache_length", lambda width, new, block, batch: width + new + block + 2)
    packs, make_room = [], fast_decode.StaticDecoder._make_room

    def counted(decoder):
        before = decoder.packs
        make_room(decoder)
        packs.append(decoder.packs - before)

    monkeypatch.setattr(fast_decode.StaticDecoder, "_make_room", counted)
    fast = fast_decode.FastDecoding(target, drafter, 3).speculative(prompts, NEW, stop)
    assert [r.tokens for r in fast] == [r.tokens for r in reference]
    assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in reference]
    assert sum(packs) > 0


def test_a_row_that_stops_keeps_no_more_cache_slots_while_the_batch_goes_on(models, drafter_dir, tiny_target):
    """A row stopped by a stop token drafts and keeps nothing more: before, it kept a slot or more per step
    until the batch's slowest row finished, and a long prompt then overflowed the static cache."""
    from dflash_trainer.decoding import fast as fast_decode
    from dflash_trainer.decoding.speculative import speculative_generate

    tokenizer, model = models
    drafter = DFlashDrafter.from_pretrained(drafter_dir).eval()
    target = FrozenTarget(model, drafter.target_layer_ids)
    prompts = eval_prompts(tiny_target, tokenizer)
    first = greedy_generate(target, prompts[0], NEW)
    stop = {first[len(prompts[0]) + 1]}  # the first prompt's second answer token ends it early
    reference = [speculative_generate(drafter, target, p, NEW, stop) for p in prompts]
    assert len(reference[0].tokens) == len(prompts[0]) + 2
    assert max(len(r.accept_lengths) for r in reference) > 3  # another row goes on for more steps
    loops = fast_decode.FastDecoding(target, drafter, len(prompts))
    fast = loops.speculative(prompts, NEW, stop)
    assert [r.tokens for r in fast] == [r.tokens for r in reference]
    slot_pos = loops._decoders[(True, False)][1].slot_pos
    kept = [int((slot_pos[i] >= 0).sum()) for i in range(len(prompts))]
    assert all(k <= len(r.tokens) for k, r in zip(kept, fast, strict=True)), (kept, [len(r.tokens) for r in fast])


def test_bench_prints_the_step_times_and_refuses_a_large_shape_on_a_cpu(capsys):
    assert main(["--bench", "--preset", "tiny", "--batch-size", "2", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["outputs_equal"] == r["prompts"]  # speculative decoding reproduced target-only decoding
        assert r["target_only_tokens_per_s"] > 0 and r["verify_step_ms"] > 0 and 1 <= r["tau"] <= 8
    assert "verify step ms" in out and "reference loops" in out
    assert main(["--bench", "--device", "cpu"]) == 2
    assert "--preset qwen3-8b needs a CUDA GPU" in capsys.readouterr().err
