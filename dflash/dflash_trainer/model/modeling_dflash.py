"""The DFlash and DFlash 2 drafters as Hugging Face model classes, for `AutoModel.from_pretrained(dir,
trust_remote_code=True)`.

A published drafter directory carries a copy of this file beside its weights, and config.json's
`auto_map` names its class (as z-lab's published drafters do), so a hub user gets the drafter, not a
plain Qwen3Model. Self-contained on purpose: it imports only torch and transformers, never the trainer.

    draft = AutoModel.from_pretrained(dir, trust_remote_code=True, dtype="auto")
    hidden = draft(target_hidden=features, noise_embedding=embeds, position_ids=positions)
    logits = draft.compute_logits(hidden, target.lm_head)

`target_hidden`: [b, S, K*H] hidden states of the target's tapped layers (`target_layer_ids`, taken after
each layer: `output_hidden_states[i + 1]`) for the context; `noise_embedding`: [b, Q, H] the target's
input embedding of the block (the last verified token, then `mask_token_id`s); `position_ids`: [b, S + Q].

DFlash 2 (`DFlash2DraftModel`, z-lab's): every layer convolves its attention and MLP sublayers (grouped dynamic
causal convolutions within the block), and its candidate selector drafts the block's tokens:

    tokens, candidates, q = draft.propose(hidden[:, 1:], block_ids[:, 0], target.lm_head, temperature)
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


def _grouped_dynamic_convolve(hidden, dynamic, base, group_size):
    """A causal convolution over the block's positions (zeros before its first): a base kernel per offset plus
    a per-token kernel shared by each group of group_size channels (z-lab's)."""
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    blocks = hidden.view(batch, length, groups, group_size)
    dynamic = dynamic.view(batch, length, base.shape[0], groups, 1)
    output = torch.zeros_like(blocks)
    for offset in range(min(base.shape[0], length)):
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        output = output + base[offset].view(1, 1, groups, group_size).to(hidden.dtype) * values
        output = torch.addcmul(output, dynamic[:, :, offset], values)
    return output.view_as(hidden)


class GroupedDynamicCausalConv(nn.Module):
    """base_kernel [2, K, H] (the sublayer's input side, its output side); kernel_projection H -> 2*K*groups."""

    def __init__(self, hidden_size, kernel_size, group_size):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, hidden):
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, -1)
        return (_grouped_dynamic_convolve(hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size),
                dynamic[..., 1, :, :])

    def finish(self, hidden, dynamic):
        return _grouped_dynamic_convolve(hidden, dynamic, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):
    """Re-ranks each position's top-k tokens by predecessor_codebook[prev] * hidden_projection(h) .
    successor_codebook[candidate], added to the candidate's logit."""

    def __init__(self, config):
        super().__init__()
        rank = int(_draft_value(config, "selector_rank"))
        self.top_k = int(_draft_value(config, "selector_top_k"))
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def select(self, hidden, logits, anchor_ids, temperature=0.0):
        """(tokens [b, n], candidates [b, n, k], q [b, n, k] or None): the path through the block, each
        position's candidate the best (temperature 0) or sampled from softmax(scores / T) (z-lab's select)."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        predecessor, path, q_rows = anchor_ids, [], []
        for position in range(hidden.shape[1]):
            scores = unary[:, position] + torch.einsum(
                "br,bkr->bk", F.embedding(predecessor, self.predecessor_codebook) * projected[:, position],
                F.embedding(candidates[:, position], self.successor_codebook))
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                index = torch.multinomial(q, 1)[:, 0]
                q_rows.append(q)
            else:
                index = scores.argmax(-1)
            predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1), candidates, torch.stack(q_rows, dim=1) if q_rows else None


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None  # DFlash 2's (DFlash2DraftModel sets them)

    def forward(self, hidden, context, cos, sin):
        h = self.input_layernorm(hidden)
        if self.attention_conv is None:
            h = self.self_attn(h, context, cos, sin)
        else:
            h, kernel = self.attention_conv.prepare(h)
            h = self.attention_conv.finish(self.self_attn(h, context, cos, sin), kernel)
        hidden = hidden + h
        h = self.post_attention_layernorm(hidden)
        if self.mlp_conv is None:
            return hidden + self.mlp(h)
        h, kernel = self.mlp_conv.prepare(h)
        return hidden + self.mlp_conv.finish(self.mlp(h), kernel)


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


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2: each layer's attention and MLP convolved within the block, and a candidate selector."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        kernel_size, group_size = int(_draft_value(config, "conv_kernel_size")), int(_draft_value(config, "conv_group_size"))
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(config.hidden_size, kernel_size, group_size)
            layer.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, kernel_size, group_size)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head, temperature: float = 0.0):
        """The block's drafts after its first token: (tokens, candidates, q), as z-lab's propose."""
        return self.candidate_selector.select(hidden, self.compute_logits(hidden, output_head), anchor_ids,
                                              temperature)
