"""Each drafter kind (DFlash, DFlash 2, DSpark) on a CUDA GPU (skipped without one), in a few minutes:

- the compile step with flex_attention and the compiled layers: no graph break, every bucket compiled before
  step 1, the steps after it compile nothing and train the losses of the eager SDPA step, a missed shape raises
  (DFlash's CE through the Triton kernel, DFlash 2's convolutions, top-k and selector with its KL, DSpark's heads
  with its TV);
- the trainer on the tiny target: the compile step (the colocated target's too), training steps with
  flex_attention, on the FP8 target where the GPU has FP8 tensor cores (compute capability 8.9 or newer; DFlash 2
  with its CE default, through the Triton kernel), then dflash-eval --run at batch 1 and 4, greedy and sampled,
  its fast loop replayed as CUDA graphs;
- the fast loops against the reference loops in float32: greedy at batch 1 and 4, sampled at batch 1.

    .venv/bin/python -m pytest -p no:cacheprovider -n0 tests/test_kinds_gpu.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.test_kinds_compile import KINDS, compile_and_train, kind_step, train_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# the trainer's settings of each kind, with the loss its authors train it with (DFlash 2: the CE default)
RUN_SETTINGS = {
    "dflash": [],
    "dflash2": ["drafter.kind=dflash2", "drafter.selector_rank=16", "drafter.selector_top_k=8"],
    "dspark": ["drafter.kind=dspark", "drafter.markov_rank=16", "train.loss_ce=0.1", "train.loss_tv=0.9"],
}


@pytest.fixture(autouse=True)
def _run_phase_left():
    """A compile step leaves its process in the run phase (a recompile raises): the next test starts outside it."""
    from dflash_trainer.compile.guard import leave_run_phase

    leave_run_phase()
    yield
    leave_run_phase()


def fp8_tensor_cores() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_compile_step_covers_each_kinds_flex_step(kind):
    from dflash_trainer.run.compile_step import compile_cache_dir

    # bf16 at the tiny target's shape and the trainer's own cache (per user): the trainer runs below load these
    # graphs, DSpark's layers are DFlash's, and a second session loads them all
    got = compile_and_train(kind, "cuda", "flex", True, [64, 128], compile_cache_dir(None), torch.bfloat16)
    report = got["report"]
    assert report.counters["graph_breaks"] == 0 and report.graph_break_reasons == [], report.graph_break_reasons
    assert got["graphs_after"] == 0 and got["untouched"], (report.counters, got["graphs_after"])
    assert all(math.isfinite(x) for x in got["losses"])
    eager = train_steps(kind_step(kind, "cuda", "sdpa", False, torch.bfloat16), [64, 128])  # dense, uncompiled
    assert got["losses"] == pytest.approx(eager, rel=2e-2)  # bf16: the kernels round differently
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        train_steps(got["step"], [96])


@pytest.mark.parametrize("kind", sorted(RUN_SETTINGS))
def test_each_kind_trains_with_flex_and_dflash_eval_replays_cuda_graphs(kind, tiny_target, tmp_path, capsys):
    from dflash_trainer.config import load_config
    from dflash_trainer.eval.cli import main as eval_main
    from dflash_trainer.train import run

    out = tmp_path / "run"
    fp8 = ["target.quantization=fp8"] if fp8_tensor_cores() else []
    summary = run(load_config("embedded", [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={out}", "train.steps=6", "train.lr=3e-3",
        "train.micro_batch=4", "train.num_anchors=8", "train.checkpoint_every=0", "train.log_every=1",
        "train.dtype=bfloat16", "target.dtype=bfloat16", "data.max_length=64", "data.context_buckets=[64]",
        "eval.prompts=4", "eval.max_new_tokens=16", *fp8, *RUN_SETTINGS[kind]]))
    said = " ".join(capsys.readouterr().err.split())
    assert f"drafter: {kind}," in said and "attention flex on cuda" in said
    assert "0 graph breaks" in said and summary["compile_s"] > 0
    assert not fp8 or "as FP8-dynamic GEMMs" in said
    assert len(summary["losses"]) == 6 and all(math.isfinite(x) for x in summary["losses"])
    for batch in (1, 4):
        where = tmp_path / f"eval-{batch}"
        assert eval_main(["--run", str(out), "--out", str(where), "--batch-size", str(batch), "--temperature", "0",
                          "0.8", "--max-new-tokens", "24"]) == 0
        report = json.loads((where / "eval.json").read_text())
        assert report["decoding"] == f"static cache, CUDA graphs, batch {batch}", report["decoding"]
        assert report["target_quantization"] == ("fp8" if fp8 else "none")
        greedy = report["sets"]["held-out"]
        assert greedy["outputs_equal"] + len(greedy["near_tie_divergences"]) == greedy["prompts"] == 4
        sampled = report["by_temperature"]["0.8"]["sets"]["held-out"]
        assert sampled["outputs_equal"] is None and 1.0 <= sampled["tau"] <= 8
        if kind == "dspark":
            assert greedy["confidence_calibration"]["reached"][0] == greedy["verify_steps"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kinds_fast_loops_replayed_as_cuda_graphs_equal_the_reference_loops(kind, tmp_path):
    """float32: greedy at batch 1 and 4 gives the reference loop's tokens and acceptance lengths (the target's own
    tokens); sampled at batch 1 consumes the reference loop's draws; sampled at batch 4 is seeded."""
    from dflash_trainer.decoding.speculative import Sampling, speculative_generate
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config

    from tests.helpers.families import tokenizer_for_tests
    from tests.helpers.fast_loops import random_prompts, replayed_greedy_equals_the_reference
    from tests.test_speculative_fast import target_and_drafter

    tokenizer = tokenizer_for_tests()
    target, plain = target_and_drafter("qwen3", tokenizer, tmp_path)
    extra = KINDS[kind][0]
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_config(target.config, DrafterShape(
        num_layers=1, block_size=4, mask_token_id=tokenizer.mask_token_id, target_layer_ids=plain.target_layer_ids,
        kind=kind, **extra))).eval()
    with torch.no_grad():  # the kind's own head large enough that the token before moves each draft
        if drafter.candidate_selector is not None:
            drafter.candidate_selector.reset_parameters(1.0)
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
            drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
    target.model.cuda()
    drafter.cuda()
    prompts = random_prompts(len(tokenizer), (30, 11, 5, 17, 8))
    for batch, loops in replayed_greedy_equals_the_reference(target, drafter, prompts, (1, 4))[0].items():
        sampled = [loops.speculative(prompts, 40, sampling=Sampling(0.8, 7, "cuda")) for _ in range(2)]
        assert loops._decoders[True, True][1].spec_step.graph is not None
        assert [r.tokens for r in sampled[0]] == [r.tokens for r in sampled[1]]  # seeded
        assert all(r.tokens[: len(p)] == p and len(r.tokens) >= len(p) + 40 for r, p in zip(sampled[0], prompts))
        if batch == 1:
            sampling = Sampling(0.8, 7, "cuda")
            expected = [speculative_generate(drafter, target, p, 40, sampling=sampling) for p in prompts]
            assert [r.tokens for r in sampled[0]] == [r.tokens for r in expected]
            assert [r.accept_lengths for r in sampled[0]] == [r.accept_lengths for r in expected]
