"""The DFlash training attention mask.

Queries are the N blocks of B slots laid end to end (Q = N*B); keys are [context (S) | blocks (N*B)].
A query in block j sees context positions t < a_j (strictly before its anchor: at inference the
anchor's own target feature does not exist yet) and every slot of its own block; padding blocks
see nothing. The same predicate builds the flex_attention BlockMask and the dense reference.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

TILE = 128  # flex_attention's default sparse block size


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


def dflash_block_mask(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int,
                      tile: int = TILE) -> BlockMask:
    """The BlockMask computed from the anchors directly, with plain tensor ops: no tracing, no compile.

    Every query row sees at most two key intervals, [0, a_j) and its own block [S + jB, S + jB + B),
    so which 128x128 tiles hold a visible pair (partial) or only visible pairs (full) follows from
    interval arithmetic on [b, Q, KV/128] booleans. create_block_mask would evaluate mask_mod over the
    whole Q x KV grid, and compiling it for Qwen3-8B shapes (8,192 x 11,264) took minutes on an H200.
    """
    b, n = anchors.shape
    device = anchors.device
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    rows = torch.arange(q_tiles * tile, device=device)
    j = torch.clamp(rows // block_size, max=n - 1)
    live = (rows < q_len).unsqueeze(0) & keep.gather(1, j.expand(b, -1))  # [b, rows]
    ctx_hi = torch.where(live, anchors.gather(1, j.expand(b, -1)), 0)  # context interval [0, a_j)
    blk_lo = (ctx_len + j * block_size).expand(b, -1)  # own block [S + jB, S + jB + B)
    blk_hi = torch.where(live, blk_lo + block_size, blk_lo)
    k0 = (torch.arange(kv_tiles, device=device) * tile).view(1, 1, -1)
    k1 = k0 + tile  # the last tile overhangs kv_len: never "full", always masked by mask_mod
    ctx_hi, blk_lo, blk_hi = ctx_hi.unsqueeze(-1), blk_lo.unsqueeze(-1), blk_hi.unsqueeze(-1)
    any_pair = (k0 < ctx_hi) | ((torch.maximum(blk_lo, k0) < torch.minimum(blk_hi, k1)) & (blk_hi > blk_lo))
    all_pairs = (k1 <= ctx_hi) | ((k0 >= blk_lo) & (k1 <= blk_hi))
    any_tile = any_pair.view(b, q_tiles, tile, kv_tiles).any(2)
    full_tile = all_pairs.view(b, q_tiles, tile, kv_tiles).all(2)
    partial_tile = any_tile & ~full_tile

    def as_blocks(tiles):  # [b, rows, cols] bool -> counts [b,1,rows], indices [b,1,rows,cols] (present first)
        counts = tiles.sum(-1, dtype=torch.int32)
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts.unsqueeze(1), order.unsqueeze(1)

    mask = BlockMask.from_kv_blocks(*as_blocks(partial_tile), *as_blocks(full_tile), BLOCK_SIZE=tile,
                                    mask_mod=dflash_mask_mod(anchors, keep, block_size, ctx_len),
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=False)
    # The backward's Q-direction tables are the transposed tile tables: set them, rather than have
    # from_kv_blocks derive them from the KV tables in ~40 more small kernels per micro-batch.
    (mask.q_num_blocks, mask.q_indices), (mask.full_q_num_blocks, mask.full_q_indices) = (
        as_blocks(partial_tile.transpose(1, 2)), as_blocks(full_tile.transpose(1, 2)))
    return mask


def dense_mask(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """Boolean [b, 1, N*B, S+N*B] mask for the SDPA reference path (small shapes only)."""
    b, n = anchors.shape
    q = torch.arange(n * block_size, device=anchors.device)
    kv = torch.arange(ctx_len + n * block_size, device=anchors.device)
    mod = dflash_mask_mod(anchors, keep, block_size, ctx_len)
    rows = [mod(i, 0, q[:, None], kv[None, :]) for i in range(b)]
    return torch.stack(rows).unsqueeze(1)
