"""dflash-eval on a GPU at the Qwen3-8B shape: speculative vs target-only wall time per token at batch 1.

The target is make bench's random-weight Qwen3-8B (bench --make-assets) and the drafter a random one of
the bench preset's shape, so tau is about 1: the figure is the cost of the loop (a drafter forward and a
16-token verify per token), not a speedup a trained drafter gives. Set DFLASH_EVAL_OUT to keep eval.json,
requests.jsonl and eval.png, and DFLASH_BENCH_ASSETS to reuse assets made before.
"""

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_speculative_vs_target_only_wall_time_at_the_8b_shape(tmp_path):
    from dflash_trainer.bench.step import PRESETS, make_assets
    from dflash_trainer.data.held_out import distinct_prompts
    from dflash_trainer.embedded import read_corpus
    from dflash_trainer.eval.cli import main
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from transformers import AutoConfig

    assets = Path(os.environ.get("DFLASH_BENCH_ASSETS") or tmp_path / "assets")
    if not (assets / "target" / "config.json").is_file():
        make_assets(assets, "qwen3-8b", seq=64, rows=1)
    drafter_dir = assets / "drafter"
    if not (drafter_dir / "config.json").is_file():
        config = drafter_config(AutoConfig.from_pretrained(assets / "target"),
                                DrafterShape(**PRESETS["qwen3-8b"]["drafter"]))
        torch.manual_seed(0)
        with torch.device("cuda"):
            DFlashDrafter(config).to(torch.bfloat16).save_pretrained(drafter_dir)
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c}) + "\n" for c in distinct_prompts(read_corpus())[:8]))
    out = Path(os.environ.get("DFLASH_EVAL_OUT") or tmp_path / "eval")
    assert main(["--drafter", str(drafter_dir), "--target", str(assets / "target"), "--prompts", str(prompts),
                 "--max-new-tokens", "256", "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    s = report["sets"]["chat"]
    print(json.dumps({"device": report["device"], "dtype": report["dtype"],
                      **{k: s[k] for k in ("prompts", "tau", "verify_steps", "tokens", "speculative_s", "target_only_s",
                                           "speculative_tokens_per_s", "target_only_tokens_per_s", "speedup",
                                           "outputs_equal", "near_tie_divergences")},
                      "ms_per_token_speculative": 1e3 / s["speculative_tokens_per_s"],
                      "ms_per_token_target_only": 1e3 / s["target_only_tokens_per_s"]}, indent=2))
    assert report["device"].startswith("NVIDIA") and report["dtype"] == "bfloat16"
    assert s["outputs_equal"] + len(s["near_tie_divergences"]) == s["prompts"] == 8
    assert s["speedup"] > 0 and 1.0 <= s["tau"] <= 16


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_fast_loops_replayed_as_cuda_graphs_equal_the_reference_loops(family, tmp_path):
    """On a GPU the fast loops' steps are recorded as CUDA graphs; in float32 their tokens and acceptance
    lengths are the eager reference loops', at batch 1 and 2 (gemma3: sliding-window layers rolled back)."""
    from tests.helpers.families import tokenizer_for_tests
    from tests.helpers.fast_loops import random_prompts, replayed_greedy_equals_the_reference
    from tests.test_speculative_fast import target_and_drafter

    tokenizer = tokenizer_for_tests()
    target, drafter = target_and_drafter(family, tokenizer, tmp_path)
    target.model.cuda()
    drafter.cuda()
    prompts = random_prompts(len(tokenizer), (30, 11, 5))
    loops_by_batch, greedy = replayed_greedy_equals_the_reference(target, drafter, prompts, (1, 2))
    for loops in loops_by_batch.values():
        assert loops.greedy(prompts, 40) == greedy
        assert loops._decoders[False, False][1].greedy_step.graph is not None


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_sampled_loops_replayed_as_cuda_graphs_equal_the_reference_loops(family, tmp_path):
    """Speculative sampling on a GPU: the recorded steps read their noise and temperature from buffers the seeded
    generator fills outside them; in float32 at batch 1 they consume the reference loop's draws and give its
    tokens, at two temperatures from one recording."""
    from dflash_trainer.decoding.fast import FastDecoding
    from dflash_trainer.decoding.speculative import Sampling, greedy_generate, speculative_generate

    from tests.helpers.families import tokenizer_for_tests
    from tests.test_speculative_fast import target_and_drafter

    tokenizer = tokenizer_for_tests()
    target, drafter = target_and_drafter(family, tokenizer, tmp_path)
    target.model.cuda()
    drafter.cuda()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(len(tokenizer), (n,), generator=g).tolist() for n in (30, 11, 5)]
    loops = FastDecoding(target, drafter, 1)
    for temperature in (1.0, 0.6):
        fast = loops.speculative(prompts, 40, sampling=Sampling(temperature, 7, "cuda"))
        assert loops._decoders[True, True][1].spec_step.graph is not None
        sampling = Sampling(temperature, 7, "cuda")
        reference = [speculative_generate(drafter, target, p, 40, sampling=sampling) for p in prompts]
        assert [r.tokens for r in fast] == [r.tokens for r in reference]
        assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in reference]
        own = loops.greedy(prompts, 40, sampling=Sampling(temperature, 7, "cuda"))
        assert loops._decoders[False, True][1].greedy_step.graph is not None
        sampling = Sampling(temperature, 7, "cuda")
        assert own == [greedy_generate(target, p, 40, sampling=sampling) for p in prompts]
