"""The DFlash training attention mask.

Queries are the N blocks of B slots laid end to end (Q = N*B); keys are [context (S) | blocks (N*B)].
A query in block j sees context positions t < a_j (strictly before its anchor: at inference the
anchor's own target feature does not exist yet) and every slot of its own block; padding blocks
see nothing. The same predicate builds the flex_attention BlockMask and the dense reference.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int):
    """mask_mod(b, h, q, kv) for anchors [b, N] and keep [b, N] (padding blocks have keep False)."""
    num_blocks = anchors.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        # create_block_mask rounds Q up to its 128 tile: clamp the block index so the gather stays
        # in bounds, and let `in_range` reject the rounded-up queries.
        j = torch.clamp(q_idx // block_size, max=num_blocks - 1)
        in_range = q_idx < num_blocks * block_size
        anchor = anchors[b, j]
        sees_context = (kv_idx < ctx_len) & (kv_idx < anchor)
        sees_own_block = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == j)
        return in_range & keep[b, j] & (sees_context | sees_own_block)

    return mask_mod


def build_block_mask(
    anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int, builder=create_block_mask
) -> BlockMask:
    """BlockMask with H=None (one mask shared by all heads: H=num_heads multiplies its memory)."""
    b, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    return builder(
        dflash_mask_mod(anchors, keep, block_size, ctx_len), b, None, q_len, kv_len, device=anchors.device
    )


def dense_mask(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """Boolean [b, 1, N*B, S+N*B] mask for the SDPA reference path (small shapes only)."""
    b, n = anchors.shape
    q = torch.arange(n * block_size, device=anchors.device)
    kv = torch.arange(ctx_len + n * block_size, device=anchors.device)
    mod = dflash_mask_mod(anchors, keep, block_size, ctx_len)
    rows = [mod(i, 0, q[:, None], kv[None, :]) for i in range(b)]
    return torch.stack(rows).unsqueeze(1)
