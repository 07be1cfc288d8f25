"""The fast decoding loops (fast_decode.py) on every kind of attention layer the trainer's targets have.

A verify step writes a whole block to the static cache and the rejected drafts are rolled back by their
slots' positions: on full, sliding-window (a window of 8 tokens, shorter than the prompts) and attention-sink
layers alike the outputs and acceptance lengths must be speculative.py's reference loops', at batch 1 and
with two prompts per verify step.
"""

import pytest
import torch
from dflash_trainer.decoding.fast import FastDecoding, layer_kinds
from dflash_trainer.decoding.speculative import greedy_generate, speculative_generate
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.target.frozen import FrozenTarget, attention_implementation, meta_skeleton
from transformers import AutoModelForCausalLM

from tests.helpers.families import WINDOW, build_family, tokenizer_for_tests

NEW = 20
FAMILIES = ["gemma3", "gpt_oss", "mistral", "gemma2"]  # sliding + full, sinks + MoE, all sliding, soft-capping


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_for_tests()


def target_and_drafter(family: str, tokenizer, root):
    path = build_family(family, tokenizer, root / family)
    config = AutoModelForCausalLM.from_pretrained(path).config
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(meta_skeleton(config)))
    shape = DrafterShape(num_layers=1, block_size=4, mask_token_id=tokenizer.mask_token_id)
    drafter_cfg = drafter_config(model.config, shape)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_cfg).eval()
    return FrozenTarget(model, drafter.target_layer_ids), drafter


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_loops_equal_the_reference_loops_on_every_layer_kind(family, tokenizer, tmp_path):
    target, drafter = target_and_drafter(family, tokenizer, tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(len(tokenizer), (n,), generator=g).tolist() for n in (3 * WINDOW, WINDOW + 3, 5)]
    reference = [speculative_generate(drafter, target, p, NEW) for p in prompts]
    greedy = [greedy_generate(target, p, NEW) for p in prompts]
    for batch in (1, 2):
        loops = FastDecoding(target, drafter, batch)
        fast = loops.speculative(prompts, NEW)
        assert [r.tokens for r in fast] == [r.tokens for r in reference] == greedy
        assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in reference]
        assert loops.greedy(prompts, NEW) == greedy


def test_the_masks_know_each_familys_layer_kinds(tokenizer):
    from tests.helpers.families import family_config

    assert layer_kinds(family_config("gemma3", tokenizer)) == ["full_attention", "sliding_attention"]
    assert layer_kinds(family_config("mistral", tokenizer)) == ["sliding_attention"]
    assert layer_kinds(family_config("qwen3", tokenizer)) == ["full_attention"]
