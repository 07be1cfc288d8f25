"""LM head + weighted cross-entropy, in chunks of rows.

The full [N*B, vocab] logits of one sample are 2.5 GB in bf16 for Qwen3-8B (8,192 queries x
151,936): never materialise them. Each chunk runs head -> CE -> weighted sum under activation
checkpointing, so only one chunk's logits exist at a time, in the forward and in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class LossSums:
    """Additive terms of one micro-batch; divide by the step's total weight at the end."""

    weighted_ce: torch.Tensor  # scalar, carries the graph
    slot_correct: torch.Tensor  # [B] argmax == label where weight > 0
    slot_count: torch.Tensor  # [B] positions with weight > 0


def _chunk_terms(hidden, head_weight, labels, weights, slots, block_size):
    logits = F.linear(hidden, head_weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    with torch.no_grad():
        scored = weights > 0
        hit = (logits.argmax(-1) == labels) & scored
        correct = torch.zeros(block_size, device=hidden.device).index_add_(0, slots, hit.float())
        count = torch.zeros(block_size, device=hidden.device).index_add_(0, slots, scored.float())
    return (ce * weights).sum(), correct, count


def chunked_block_loss(
    hidden: torch.Tensor,  # [b, N*B, H] drafter output (normalised)
    head_weight: torch.Tensor,  # [V, H] frozen target LM head
    labels: torch.Tensor,  # [b, N*B]
    weights: torch.Tensor,  # [b, N*B]
    block_size: int,
    chunk_rows: int = 2048,
) -> LossSums:
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weights.reshape(-1).to(torch.float32)
    slots = torch.arange(h.shape[0], device=h.device) % block_size
    total = h.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(block_size, device=h.device)
    count = torch.zeros(block_size, device=h.device)
    for start in range(0, h.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        args = (h[sl], head_weight, y[sl], w[sl], slots[sl], block_size)
        if torch.is_grad_enabled() and h.requires_grad:
            part, c, n = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part, c, n = _chunk_terms(*args)
        total = total + part
        correct += c
        count += n
    return LossSums(total, correct, count)
