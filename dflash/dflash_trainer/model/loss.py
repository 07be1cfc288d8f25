"""LM head + weighted cross-entropy, in chunks of rows, with the gradient computed in the forward.

The full [N*B, vocab] logits of one sample are 2.5 GB in bf16 for Qwen3-8B (8,192 queries x
151,936): never materialise them. The head is the target's and frozen, so the loss needs only the
gradient with respect to the drafter's hidden states, and that gradient does not depend on anything
computed later: each chunk computes logits -> CE -> d(loss)/d(hidden) at once, keeps the [rows, H]
gradient (64 MiB for the 8B shape) and drops its logits. The backward is one multiply by the
incoming scalar. Against activation checkpointing this saves recomputing the head in the backward:
a third of the head's GEMM work, the largest GEMM of the step.

The elementwise part (log-softmax, CE, softmax - one-hot, argmax) runs as one Triton kernel on GPUs
(`ce_kernel.ce_and_grad_`, which writes the gradient over the logits) and eagerly on CPUs and in
no-grad passes (`ce_and_grad`, the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossSums:
    """Additive terms of one micro-batch; divide by the step's total weight at the end."""

    weighted_ce: torch.Tensor  # scalar, carries the graph
    slot_correct: torch.Tensor  # [B] argmax == label where weight > 0
    slot_count: torch.Tensor  # [B] positions with weight > 0
    candidates: torch.Tensor | None = None  # [rows, k] the top-k tokens of each scored row (DFlash 2's selector)


def ce_and_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, with_grad: bool):
    """sum(w * CE), d(that)/d(logits) in the logits' dtype (or None), argmax == label, for [rows, V] logits."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    ce = lse.squeeze(-1) - x.gather(1, labels.unsqueeze(1)).squeeze(1)
    hit = x.argmax(-1) == labels
    grad = None
    if with_grad:
        one_hot = torch.arange(x.shape[1], device=x.device) == labels.unsqueeze(1)
        grad = ((torch.exp(x - lse) - one_hot.float()) * weights.unsqueeze(1)).to(logits.dtype)
    return (ce * weights).sum(), grad, hit


class _HeadCrossEntropy(torch.autograd.Function):
    """sum(weights * CE(hidden @ head^T, labels)) with d/d(hidden) computed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, slots, block_size, chunk_rows, with_grad, shaping, top_k):
        if hidden.is_cuda and with_grad:
            from .ce_kernel import ce_and_grad_ as kernel
        else:  # CPUs and no-grad passes (evaluation): the reference
            def kernel(logits, labels, weights):
                return ce_and_grad(logits, labels, weights, with_grad)
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.zeros(block_size, device=hidden.device)
        count = torch.zeros(block_size, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        candidates = torch.zeros(hidden.shape[0], top_k, dtype=torch.long, device=hidden.device)
        scored = weights > 0
        for start in range(0, hidden.shape[0], chunk_rows):
            sl = slice(start, start + chunk_rows)
            logits = F.linear(hidden[sl], head_weight)
            if shaping is not None:  # the target's logit transform (Gemma 2's soft-cap): chain rule through it
                logits, slope = _shaped_with_slope(logits, *shaping)
            if top_k:  # before the kernel, which writes the gradient over the logits
                candidates[sl] = torch.topk(logits, top_k, dim=-1).indices
            part, grad_logits, hit = kernel(logits, labels[sl], weights[sl])
            del logits
            if with_grad:
                if shaping is not None:
                    grad_logits = grad_logits * slope
                torch.mm(grad_logits, head_weight, out=grad_hidden[sl])
            total += part
            correct.index_add_(0, slots[sl], (hit & scored[sl]).float())
            count.index_add_(0, slots[sl], scored[sl].float())
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct, count, candidates)
        return total, correct, count, candidates

    @staticmethod
    def backward(ctx, grad_total, _grad_correct, _grad_count, _grad_candidates):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None, None, None, None


def _shaped_with_slope(raw: torch.Tensor, multiplier: float, softcap: float | None):
    """c * tanh(m * raw / c) (or m * raw without a cap), and its derivative with respect to raw."""
    scaled = raw * multiplier
    if not softcap:
        return scaled, multiplier
    capped = torch.tanh(scaled / softcap) * softcap
    return capped, (1 - (capped.float() / softcap) ** 2).mul_(multiplier).to(raw.dtype)


def scored_rows(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, N*B, ...] -> [b*N*(B-1), ...]: every block's slots 1..B-1 (slot 0, the anchor, never carries loss)."""
    b, rows = t.shape[:2]
    return t.reshape(b, rows // block_size, block_size, *t.shape[2:])[:, :, 1:].reshape(-1, *t.shape[2:])


def chunked_block_loss(
    hidden: torch.Tensor,  # [b, N*B, H] drafter output (normalised)
    head_weight: torch.Tensor,  # [V, H] frozen target LM head
    labels: torch.Tensor,  # [b, N*B]
    weights: torch.Tensor,  # [b, N*B]; slot 0 of each block must be 0 (it is ignored)
    block_size: int,
    chunk_rows: int = 2048,
    output_multiplier: float = 1.0,  # the target's logit transform (model.shape_logits), as serving applies it
    final_logit_softcapping: float | None = None,
    top_k: int = 0,  # > 0: also the top_k tokens of each scored row (LossSums.candidates), from the same logits
) -> LossSums:
    if head_weight.requires_grad:
        raise ValueError("the LM head is the target's and must be frozen (requires_grad=False): DFlash does "
                         "not train it, and the loss computes gradients for the drafter's hidden states only")
    # Slot 0 of every block is the anchor itself: it never carries loss (anchors.build_blocks), so its
    # rows skip the head's two GEMMs and the CE kernel (1/B of the largest GEMMs of the step).
    def scored(t: torch.Tensor) -> torch.Tensor:
        return scored_rows(t, block_size)

    h = scored(hidden)
    slots = torch.arange(1, block_size, device=h.device).repeat(h.shape[0] // (block_size - 1))
    with_grad = torch.is_grad_enabled() and h.requires_grad
    shaping = (None if output_multiplier == 1.0 and not final_logit_softcapping
               else (output_multiplier, final_logit_softcapping))
    total, correct, count, candidates = _HeadCrossEntropy.apply(
        h, head_weight, scored(labels), scored(weights).to(torch.float32), slots, block_size, chunk_rows, with_grad,
        shaping, top_k)
    return LossSums(total, correct, count, candidates if top_k else None)
