"""One tau on every device and loop: a drafter trained on a GPU serves on the CPU as it scored in its run.

A tiny Gemma 3 target (sliding-window and full layers, per-layer-type RoPE, scaled and tied embeddings),
its own greedy answers as data, trained on the GPU the way real runs train (bf16, flex attention with
compiled layers, micro-batch 8, several context buckets, padded rows). The published drafter is then
judged by the trainer's own evaluation on the GPU, `dflash-eval` on the GPU, `dflash-eval` on the CPU in
float32, and z-lab's loop on the CPU (where its package is installed). The same device and dtype give the
same tau; the CPU's float32 target decodes slightly different text than the GPU's bf16 one, so its tau
is held to a tolerance (measured at the Gemma 3 270M shape on an H200: 2.79 on the GPU, 2.84 on the CPU).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from dflash_trainer.decoding.speculative import stop_token_ids
from dflash_trainer.eval.cli import main as eval_main
from dflash_trainer.train import run

from tests.helpers.families import build_family, tokenizer_for_tests
from tests.test_families import load, regenerated_rows, run_config, zlab_generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# |tau(CPU, fp32 target) - tau(GPU, bf16 target)|: the two targets' greedy answers part at near ties.
CROSS_DEVICE_TAU_TOL = 0.3


def test_a_gpu_trained_drafter_serves_on_the_cpu_with_the_tau_of_its_run(tmp_path):
    from dflash_trainer.embedded import read_corpus

    tokenizer = tokenizer_for_tests()
    target_dir = build_family("gemma3", tokenizer, tmp_path / "target")
    rows = regenerated_rows(target_dir, tokenizer, read_corpus()[:80])
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    for name, part in (("eval", rows[:8]), ("train", rows[8:])):
        data[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    out = tmp_path / "run"
    summary = run(run_config(target_dir, data, out, "train.dtype=bfloat16", "target.dtype=bfloat16",
                             "train.attention=flex", "train.compile_layers=true", "train.steps=200",
                             "train.micro_batch=8", "train.num_anchors=16", "eval.prompts=8",
                             "data.context_buckets=[32, 64, 96]", "train.lr=3e-3"))
    assert not summary["serving_check"]["flagged"], summary["serving_check"]
    assert summary["tau_after"] > 1.2  # the drafter learned something: the comparison means something
    taus = {}
    for device, extra in (("cuda", []), ("cpu", ["--dtype", "float32"])):
        where = tmp_path / f"eval-{device}"
        assert eval_main(["--run", str(out), "--out", str(where), "--device", device, *extra]) == 0
        taus[device] = json.loads((where / "eval.json").read_text())["sets"]["held-out"]["tau"]
    assert taus["cuda"] == pytest.approx(summary["tau_after"], abs=0.05)
    assert abs(taus["cpu"] - taus["cuda"]) <= CROSS_DEVICE_TAU_TOL, taus
    # z-lab's loop on the CPU, on the same prompts: the same tokens and acceptance lengths as dflash-eval's
    requests = [json.loads(line) for line in (tmp_path / "eval-cpu" / "requests.jsonl").read_text().splitlines()]
    prompts = [json.loads(line)["prompt_ids"] for line in (out / "eval_prompts.jsonl").open()]
    if importlib.util.find_spec("dflash") is None:  # z-lab's package: a test dependency, absent on some GPU hosts
        return
    model = load(target_dir).model
    theirs = zlab_generate(out / "drafter", model, prompts, sorted(stop_token_ids(model, tokenizer)))
    for prompt, request, (tokens, lengths) in zip(prompts, requests, theirs, strict=True):
        assert request["output_ids"] == tokens[len(prompt):]
        assert request["accept_lengths"] == lengths
