"""Tiny random targets of each architecture family the trainer supports, built from transformers' own
config classes (no model hub): 4 layers, hidden 32, the project's 320-token tokenizer.

Sliding windows are 8 tokens, far shorter than a prompt of the bundled corpus plus its answer, so the
speculative loop's cache rollback is exercised past the window. Each entry says what the family adds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as hf

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512}
WINDOW = 8
ALTERNATING = ["sliding_attention", "full_attention"] * 2
# Larger than the usual 0.02: a random target then prefers some tokens clearly over others, so greedy
# decoding is not decided by rounding.
INIT_STD = 0.2


def _gemma3_text(**extra) -> hf.Gemma3TextConfig:
    return hf.Gemma3TextConfig(**SHAPE, head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING, **extra)


def _llava_style_gemma3(**extra) -> hf.Gemma3Config:
    vision = hf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    vocab = extra.pop("vocab_size")
    return hf.Gemma3Config(text_config=_gemma3_text(vocab_size=vocab, **extra), vision_config=vision,
                           mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 3,
                           eoi_token_index=vocab - 2, **extra)


# family -> (builder(**common) -> config, what it adds to the matrix)
FAMILIES = {
    "llama": (lambda **c: hf.LlamaConfig(**SHAPE, **c, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "Llama 3.x RoPE scaling"),
    "mistral": (lambda **c: hf.MistralConfig(**SHAPE, **c, sliding_window=WINDOW), "a sliding window on every layer"),
    "qwen2": (lambda **c: hf.Qwen2Config(**SHAPE, **c), "QKV biases"),
    "qwen3": (lambda **c: hf.Qwen3Config(**SHAPE, **c, head_dim=16), "QK norms, head_dim beside hidden"),
    "qwen3_moe": (lambda **c: hf.Qwen3MoeConfig(**SHAPE, **c, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32), "mixture of experts"),
    "gemma2": (lambda **c: hf.Gemma2Config(**SHAPE, **c, head_dim=16, sliding_window=WINDOW),
               "logit soft-capping, scaled embeddings, sliding + full layers, eager attention"),
    "gemma3": (lambda **c: _gemma3_text(**c),
               "per-layer-type RoPE, sliding + full layers, scaled embeddings, tied head"),
    "phi3": (lambda **c: hf.Phi3Config(**SHAPE, **c), "fused QKV and gate-up projections"),
    "olmo2": (lambda **c: hf.Olmo2Config(**SHAPE, **c), "norms after attention and MLP"),
    "gpt_oss": (lambda **c: hf.GptOssConfig(**SHAPE, **c, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                            sliding_window=WINDOW, layer_types=ALTERNATING),
                "attention sinks, mixture of experts, YaRN RoPE, eager attention"),
    "gemma3_multimodal": (_llava_style_gemma3, "a vision-language wrapper whose text tower is the target"),
    # Granite 3's multipliers: embeddings scaled up, logits divided, residual and attention scaled.
    "granite": (lambda **c: hf.GraniteConfig(**SHAPE, **c, embedding_multiplier=12.0, logits_scaling=8.0,
                                             residual_multiplier=0.22, attention_multiplier=0.0078125),
                "multiplied embeddings, divided logits, scaled residuals and attention"),
    "cohere": (lambda **c: hf.CohereConfig(**SHAPE, **c, logit_scale=0.0625),
               "scaled logits, LayerNorm, attention and MLP in parallel"),
    "mixtral": (lambda **c: hf.MixtralConfig(**SHAPE, **c, sliding_window=WINDOW, num_local_experts=4,
                                             num_experts_per_tok=2), "mixture of experts under a sliding window"),
    "starcoder2": (lambda **c: hf.Starcoder2Config(**SHAPE, **c, sliding_window=WINDOW),
                   "LayerNorm with biases, a GELU MLP without a gate, a sliding window"),
    "gpt_neox": (lambda **c: hf.GPTNeoXConfig(**SHAPE, **c, rotary_pct=0.25),
                 "rotary on a quarter of each head, attention and MLP in parallel, LayerNorm"),
    "falcon": (lambda **c: hf.FalconConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                           max_position_embeddings=512, **c),
               "one KV head (multi-query), fused QKV, GELU, no intermediate_size (ffn_hidden_size)"),
    # MLA needs as many KV heads as heads (its keys and values are expanded per head).
    "deepseek_v3": (lambda **c: hf.DeepseekV3Config(**{**SHAPE, "num_key_value_heads": 4}, **c, n_routed_experts=4,
                                                    num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16,
                                                    q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                    v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1),
                    "multi-head latent attention, a dense first layer, routed experts"),
    "granitemoe": (lambda **c: hf.GraniteMoeConfig(**SHAPE, **c, num_local_experts=4, num_experts_per_tok=2,
                                                   embedding_multiplier=12.0, logits_scaling=8.0),
                   "Granite's multipliers with experts"),
}
if not hasattr(hf, "GptOssConfig"):  # an older transformers
    del FAMILIES["gpt_oss"]


def tokenizer_for_tests():
    """The project's BPE tokenizer over the bundled corpus (what the embedded target uses)."""
    from dflash_trainer.embedded import build_tokenizer, read_corpus

    return build_tokenizer([m["content"] for c in read_corpus() for m in c])


def family_config(family: str, tokenizer):
    build, _ = FAMILIES[family]
    config = build(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   bos_token_id=None)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        c.initializer_range = INIT_STD
    return config


def build_family(family: str, tokenizer, out: Path, seed: int = 0) -> Path:
    """A tiny random `family` target saved as a Hugging Face directory (weights and tokenizer)."""
    torch.manual_seed(seed)
    model = hf.AutoModelForCausalLM.from_config(family_config(family, tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_chat_rows(out: Path, first: int, count: int) -> Path:
    from dflash_trainer.embedded import read_corpus

    rows = read_corpus()[first:first + count]
    out.write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    return out
