"""The DFlash drafter as a Hugging Face model class, for `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

A published drafter directory carries a copy of this file beside its weights, and config.json's
`auto_map` names its class (as z-lab's published drafters do), so a hub user gets the drafter, not a
plain Qwen3Model. Self-contained on purpose: it imports only torch and transformers, never the trainer.

    draft = AutoModel.from_pretrained(dir, trust_remote_code=True, dtype="auto")
    hidden = draft(target_hidden=features, noise_embedding=embeds, position_ids=positions)
    logits = draft.compute_logits(hidden, target.lm_head)

`target_hidden`: [b, S, K*H] hidden states of the target's tapped layers (`target_layer_ids`, taken after
each layer: `output_hidden_states[i + 1]`) for the context; `noise_embedding`: [b, Q, H] the target's
input embedding of the block (the last verified token, then `mask_token_id`s); `position_ids`: [b, S + Q].
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def _draft_value(config, name, default=None):
    """dflash_config first, then the config's top level (z-lab's reading)."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [context ; block], all visible (no causal mask)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin):
        b, q_len, _ = hidden.shape
        kv_len = context.shape[1] + q_len
        q = self.q_norm(self.q_proj(hidden).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(hidden)], dim=1)
        v = torch.cat([self.v_proj(context), self.v_proj(hidden)], dim=1)
        k = self.k_norm(k.view(b, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[:, :, -q_len:] + rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """fc + hidden_norm fuse the K target features; the layers draft the block; norm. No embedding, no head:
    the target's are borrowed."""

    config_class = Qwen3Config
    _no_split_modules: ClassVar[list[str]] = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.target_layer_ids = list(_draft_value(config, "target_layer_ids"))
        self.block_size = int(_draft_value(config, "block_size", 16))
        self.mask_token_id = _draft_value(config, "mask_token_id")
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor, position_ids: torch.Tensor,
                **kwargs) -> torch.Tensor:
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        # The target's own embedding scale (Gemma's sqrt(hidden)), which the drafter was trained with.
        hidden = noise_embedding * float(_draft_value(self.config, "input_embedding_scale", 1.0))
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, output_head) -> torch.Tensor:
        """Logits through the target's LM head (a module or its weight) and the target's logit transform."""
        logits = output_head(hidden) if callable(output_head) else F.linear(hidden, output_head)
        logits = logits * float(_draft_value(self.config, "output_multiplier", 1.0))
        softcap = _draft_value(self.config, "final_logit_softcapping")
        if softcap:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits
