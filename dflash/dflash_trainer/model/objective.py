"""One drafter micro-batch's math: anchors -> blocks + attention (prepare_micro_batch) -> drafter ->
chunked weighted loss (drafter_loss, un-normalised sums: CE, or the objective's mix against the target; DFlash 2
adds its selector's CE, model/dflash2/objective.py). step.DrafterStep runs them (with the backward
and the optimizer) for the train loop, the compile step and the benchmark; evaluation uses them too.

Attention backends:
- "flex": the compiled flex_attention with the DFlash BlockMask (block-sparse, fused). The only
  backend for real shapes, and the only one on GPU by default.
- "sdpa": SDPA with a dense boolean mask. It materialises the [Q, S+Q] mask and, on CPU, the
  scores: it exists for CPU runs (flex_attention has no backward on CPU) and as the reference
  the flex path is tested against. The trainer refuses it when the dense scores would not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .anchors import Blocks, build_blocks, sample_anchors
from .dflash2.objective import predecessors, selector_ce
from .drafter import AttentionFn, DFlashDrafter
from .dspark.objective import dspark_loss
from .flops import visible_pairs
from .loss import LossSums, Objective, chunked_block_loss, scored_rows
from .mask import dense_mask, dflash_block_mask


def call_layer(layer, x, context, cos, sin, attention):
    return layer(x, context, cos, sin, attention)


def call_fuse(fc, hidden_norm, features):
    return hidden_norm(fc(features))


def call_norm(norm, x):
    return norm(x)


# A whole drafter layer compiled, flex_attention inlined: RMSNorms, RoPE, SwiGLU and the residual adds
# fuse around the GEMMs instead of running as separate memory-bound kernels. One compiled object per
# process, compiled in the compile step; the layers share its graph (their parameters are graph inputs).
COMPILED_LAYER = torch.compile(call_layer, dynamic=False, fullgraph=True)
# The RMSNorms outside the layers (the context's after fc, the final one over the block tokens): eager,
# each is half a dozen fp32 passes over its rows forward and backward (3.2 -> 1.3 ms of eager
# element-wise work per step at the 8B bench shape on an H200, 132.5 -> 131.1 ms per step).
# The fuse has no attention, so one graph with a symbolic context length serves every bucket: on an H200,
# 16 s less cold compile over 4 buckets at Gemma 3 270M's shape, the same step time at the 8B shape. The
# layers stay static: flex_attention with dynamic shapes compiled slower, ran 2.7% slower and, at one
# shape, did not compile (an Inductor assertion).
COMPILED_FUSE = torch.compile(call_fuse, dynamic=True, fullgraph=True)
COMPILED_NORM = torch.compile(call_norm, dynamic=False, fullgraph=True)


def sdpa_attention(mask: torch.Tensor | None) -> AttentionFn:
    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if mask is None:
            return out
        # A padding block's queries see no key: SDPA returns NaN there, flex returns 0. Match flex.
        return torch.where(mask.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))

    return attend


def flex_attention_fn(block_mask, num_kv_groups: int, repeat_kv: bool = True) -> AttentionFn:
    from .attention import attend as flex_attend

    def attend(q, k, v):
        if repeat_kv and num_kv_groups > 1:
            # Repeating K/V beats enable_gqa=True in the backward (measured on an H200: 2.8 vs 3.3 ms per layer).
            k, v = k.repeat_interleave(num_kv_groups, dim=1), v.repeat_interleave(num_kv_groups, dim=1)
            return flex_attend(q, k, v, block_mask)
        return flex_attend(q, k, v, block_mask, enable_gqa=num_kv_groups > 1)

    return attend


def block_attention(backend: str, blocks: Blocks, ctx_len: int, block_size: int, config):
    if backend == "sdpa":
        return sdpa_attention(dense_mask(blocks.anchors, blocks.keep, block_size, ctx_len))
    if backend == "flex":
        groups = config.num_attention_heads // config.num_key_value_heads
        return flex_attention_fn(dflash_block_mask(blocks.anchors, blocks.keep, block_size, ctx_len), groups)
    raise ValueError(f"unknown attention backend {backend!r}: use 'flex' (GPU) or 'sdpa' (CPU, small shapes)")


@dataclass
class MicroBatch:
    """A micro-batch's drafter inputs: its blocks, the attention over them, and the visible query-key
    pairs (a device tensor, for the FLOP count without a host sync)."""

    blocks: Blocks
    attention: AttentionFn
    visible_pairs: torch.Tensor


def prepare_micro_batch(input_ids, loss_mask, num_anchors: int, config, mask_token_id: int, gamma: float | None,
                        backend: str, generator: torch.Generator | None = None) -> MicroBatch:
    """Random anchors -> blocks -> attention for one micro-batch ([b, S] token ids and loss mask).

    Eager tensor ops, no host sync. (Compiling them cut the GPU's idle time at the start of a step
    in a profiled run but took 96 s to compile cold on an H200 and did not shorten the unprofiled
    step, so they stay eager.)
    """
    block, ctx_len = config.block_size, input_ids.shape[1]
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator)
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, block, mask_token_id, gamma)
    attention = block_attention(backend, blocks, ctx_len, block, config)
    return MicroBatch(blocks, attention, visible_pairs(anchors, keep, block))


def drafter_loss(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    features: torch.Tensor,
    blocks: Blocks,
    attention: AttentionFn,
    chunk_rows: int = 2048,
    model=None,
    compiled_layers: bool = False,
    objective: Objective | None = None,
    target_hidden: torch.Tensor | None = None,
    selector_loss_weight: float = 1.0,
    confidence_loss_weight: float = 1.0,
) -> LossSums:
    """`model` is what runs the forward (the DDP wrapper on drafter ranks); `drafter` by default.

    objective: the loss's terms (None: CE alone); target_hidden: [b, S, H], the target's final normed hidden
    states of the context, which an objective against the target's distribution needs.

    compiled_layers: run each layer through COMPILED_LAYER, and the norms around them through COMPILED_FUSE
    and COMPILED_NORM (GPU training with the flex backend); the loss's KL / TV mixture through COMPILED_MIXTURE on
    any device (on GPUs it is compiled in any case).
    selector_loss_weight: DFlash 2's selector CE weight beside the unary term (speculators' selector_loss_alpha).
    confidence_loss_weight: DSpark's confidence BCE weight (speculators' confidence_head_alpha).
    """
    b, ctx_len = features.shape[:2]
    block_embeds = F.embedding(blocks.token_ids, embed_weight)
    ctx_pos = torch.arange(ctx_len, device=features.device).expand(b, ctx_len)
    position_ids = torch.cat([ctx_pos, blocks.position_ids], dim=1)
    compiled = ({"layer_fn": COMPILED_LAYER, "fuse_fn": COMPILED_FUSE, "norm_fn": COMPILED_NORM}
                if compiled_layers else {})
    hidden = (model or drafter)(features, block_embeds, position_ids, attention, **compiled)
    target_rows = None
    if objective is not None and objective.needs_target:
        if target_hidden is None:
            raise ValueError(f"{objective} compares the drafter with the target's distribution: give "
                             "target_hidden, the target's final hidden states (FrozenTarget.features_and_final)")
        # Block position a+k predicts x[a+k]; the target predicts that token from position a+k-1.
        before = (blocks.position_ids - 1).clamp(0, ctx_len - 1)
        target_rows = target_hidden.gather(1, before.unsqueeze(-1).expand(-1, -1, target_hidden.shape[-1]))
    compiled_mixture = True if compiled_layers else None  # None: compiled on GPUs
    if drafter.markov_head is not None:
        return _dspark(drafter, hidden, head_weight, blocks, chunk_rows, objective, target_rows,
                       confidence_loss_weight, compiled_mixture)
    selector = drafter.candidate_selector
    sums = unary_objective(drafter, hidden, head_weight, blocks, chunk_rows, selector.top_k if selector else 0,
                           objective, target_rows, compiled_mixture)
    if selector is None:
        return sums
    return _with_selector(drafter, hidden, head_weight, blocks, sums, chunk_rows, selector_loss_weight)


def unary_objective(drafter: DFlashDrafter, hidden, head_weight, blocks: Blocks, chunk_rows: int, top_k: int,
                    objective: Objective | None = None, target_rows: torch.Tensor | None = None,
                    compiled_mixture: bool | None = None) -> LossSums:
    """The per-position objective over the LM head's logits, for both kinds: train.loss_*'s mixture (CE on the
    data's token, KL / TV against the target's distribution, from target_rows: the target's final hidden state
    before each block position) with the position weighting; DFlash 2's unary term (speculators' default is its
    KL). top_k > 0 also returns each scored row's top-k tokens (the selector's candidates)."""
    return chunked_block_loss(hidden, head_weight, blocks.labels, blocks.weights, drafter.block_size, chunk_rows,
                              drafter.output_multiplier, drafter.final_logit_softcapping, objective, target_rows,
                              top_k=top_k, compiled_mixture=compiled_mixture)


def _with_selector(drafter: DFlashDrafter, hidden, head_weight, blocks: Blocks, sums: LossSums, chunk_rows: int,
                   weight: float) -> LossSums:
    """DFlash 2: the selector's weighted CE added to the unary term, each position weighted as the unary term
    weighs it (the blocks' decay, or D-PACE's weights where it chose them); the slots' accuracy becomes the
    selector's (teacher-forced: the token serving would draft there, given the right tokens before it)."""
    block = drafter.block_size

    def rows(t):
        return scored_rows(t, block)

    weights = rows(blocks.weights) if sums.row_weights is None else sums.row_weights
    total, hit = selector_ce(drafter.candidate_selector, rows(hidden), head_weight, rows(blocks.labels), weights,
                             rows(predecessors(blocks.labels, block)), sums.candidates, chunk_rows,
                             drafter.output_multiplier, drafter.final_logit_softcapping)
    slots = torch.arange(1, block, device=hidden.device).repeat(weights.shape[0] // (block - 1))
    correct = torch.zeros(block, device=hidden.device).index_add_(0, slots, (hit & (weights > 0)).float())
    return LossSums(sums.weighted_loss + weight * total, correct, sums.slot_count, sums.weight, sums.candidates,
                    sums.row_weights)


def _dspark(drafter: DFlashDrafter, hidden, head_weight, blocks: Blocks, chunk_rows: int,
            objective: Objective | None, target_rows, confidence_weight: float,
            compiled_mixture: bool | None) -> LossSums:
    """DSpark: the mixture over the Markov-biased logits plus the confidence BCE (model/dspark/objective.py),
    the slots' accuracy that of the biased logits (teacher-forced, as speculators measures it)."""
    return dspark_loss(drafter, hidden, predecessors(blocks.labels, drafter.block_size), blocks.labels, blocks.weights,
                       head_weight, objective, target_rows, confidence_weight, chunk_rows, compiled_mixture)
