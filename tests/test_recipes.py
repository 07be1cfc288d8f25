"""The bundled per-model recipes: each loads, and its drafter fits its target family's real shape (transformers'
config class with the published dimensions; no weights, no hub)."""

from __future__ import annotations

import pytest
import transformers as hf
from dflash_trainer.config import load_config
from dflash_trainer.model.drafter import DrafterShape, build_target_layer_ids, drafter_config, text_config

ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def qwen3_8b():
    return hf.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)


def llama_3_1_8b():
    return hf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                          rope_parameters=ROPE_LLAMA3)


def gpt_oss_20b():
    return hf.GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                           num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                           num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072)


def gemma_3_12b_it():
    """The multimodal checkpoint's config: the trainer drives its text tower."""
    text = hf.Gemma3TextConfig(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
                               max_position_embeddings=131072)
    return hf.Gemma3Config(text_config=text.to_dict())


RECIPES = {
    "qwen3-8b": (qwen3_8b, [1, 9, 17, 25, 33]),  # z-lab/Qwen3-8B-DFlash-b16's target_layer_ids
    "llama-3.1-8b-instruct": (llama_3_1_8b, [1, 8, 15, 22, 29]),  # the rule: not published
    "gpt-oss-20b": (gpt_oss_20b, [1, 6, 11, 16, 21]),  # z-lab/gpt-oss-20b-DFlash's target_layer_ids
    "gemma-3-12b-it": (gemma_3_12b_it, [1, 12, 23, 34, 45]),  # the rule: no Gemma 3 drafter published
}


def recipe_shape(name: str) -> DrafterShape:
    drafter = load_config(name, []).drafter
    ids = tuple(drafter.target_layer_ids) if drafter.target_layer_ids else None
    return DrafterShape(num_layers=drafter.num_layers, block_size=drafter.block_size,
                        mask_token_id=drafter.mask_token_id, target_layer_ids=ids,
                        intermediate_size=drafter.intermediate_size)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_drafter_fits_its_target(name):
    build_target, expected_ids = RECIPES[name]
    target = text_config(build_target())
    shape = recipe_shape(name)
    layer_ids = list(shape.target_layer_ids or build_target_layer_ids(target.num_hidden_layers, shape.num_layers))
    assert layer_ids == expected_ids
    assert all(0 <= i < target.num_hidden_layers for i in layer_ids)
    assert 0 <= shape.mask_token_id < target.vocab_size

    drafter = drafter_config(build_target(), shape)  # borrowed scales read from the target's model class
    assert drafter.num_hidden_layers == shape.num_layers
    assert drafter.hidden_size == target.hidden_size
    assert drafter.vocab_size == target.vocab_size
    assert drafter.dflash_config["target_layer_ids"] == expected_ids
    assert drafter.dflash_config["mask_token_id"] == shape.mask_token_id
    assert drafter.block_size == shape.block_size
    assert drafter.intermediate_size == (shape.intermediate_size or target.intermediate_size)


def test_recipe_data_fits_its_context():
    for name in RECIPES:
        config = load_config(name, [])
        assert max(config.data.context_buckets) <= config.data.max_length, name
        assert config.target.path.startswith("/models/"), f"{name}: target.path is a placeholder the user edits"
