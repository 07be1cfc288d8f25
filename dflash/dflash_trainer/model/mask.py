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
NO_KEY = 1 << 30  # a key index past any sequence: the block interval of a row that sees nothing


def row_intervals(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int,
                  rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the two key intervals it sees: context [0, ctx_hi) and its block [blk_lo, blk_lo + B).

    int32 [b, rows] each, rows >= N*B (the tile-rounded query length for flex). Padding blocks and the
    rows past N*B see nothing: ctx_hi 0, blk_lo past every key.
    """
    b, n = anchors.shape
    row = torch.arange(rows, device=anchors.device)
    j = torch.clamp(row // block_size, max=n - 1)
    live = (row < n * block_size).unsqueeze(0) & keep.gather(1, j.expand(b, -1))
    ctx_hi = torch.where(live, anchors.gather(1, j.expand(b, -1)), 0)
    blk_lo = torch.where(live, ctx_len + j * block_size, NO_KEY)
    return ctx_hi.to(torch.int32), blk_lo.to(torch.int32)


def dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int, tile: int = TILE):
    """mask_mod(b, h, q, kv) for anchors [b, N] and keep [b, N] (padding blocks have keep False)."""
    rows = -(-anchors.shape[1] * block_size // tile) * tile  # create_block_mask's tile-rounded queries
    return interval_mask_mod(*row_intervals(anchors, keep, block_size, ctx_len, rows), block_size)


def interval_mask_mod(ctx_hi: torch.Tensor, blk_lo: torch.Tensor, block_size: int):
    # Two int32 row lookups and three compares per pair: flex evaluates this on every partial tile, and
    # deriving the block from q_idx there (divide, clamp, gather anchors and keep, in int64) made one
    # layer's forward + backward 4.5-5% slower at the 8B bench shape on an H200 (3.16 vs 3.02 ms and
    # 3.36 vs 3.19 ms in two runs).
    def mask_mod(b, h, q_idx, kv_idx):
        lo = blk_lo[b, q_idx]
        return (kv_idx < ctx_hi[b, q_idx]) | ((kv_idx >= lo) & (kv_idx < lo + block_size))

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
    rows_hi, rows_lo = row_intervals(anchors, keep, block_size, ctx_len, q_tiles * tile)
    ctx_hi, blk_lo = rows_hi.unsqueeze(-1), rows_lo.unsqueeze(-1)
    blk_hi = blk_lo + block_size
    k0 = (torch.arange(kv_tiles, device=device) * tile).view(1, 1, -1)
    k1 = k0 + tile  # the last tile overhangs kv_len: never "full", always masked by mask_mod
    any_pair = (k0 < ctx_hi) | (torch.maximum(blk_lo, k0) < torch.minimum(blk_hi, k1))
    all_pairs = (k1 <= ctx_hi) | ((k0 >= blk_lo) & (k1 <= blk_hi))
    any_tile = any_pair.view(b, q_tiles, tile, kv_tiles).any(2)
    full_tile = all_pairs.view(b, q_tiles, tile, kv_tiles).all(2)
    partial_tile = any_tile & ~full_tile

    def as_blocks(tiles):  # [b, rows, cols] bool -> counts [b,1,rows], indices [b,1,rows,cols] (present first)
        counts = tiles.sum(-1, dtype=torch.int32)
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        # Contiguous: flex's Triton kernels read an index row with stride 1 whatever its stride says, and argsort
        # of the transposed tiles below keeps their transposed strides (the backward then read the wrong Q tiles
        # for dK and dV, with the forward and dQ exact).
        return counts.unsqueeze(1).contiguous(), order.unsqueeze(1).contiguous()

    mask = BlockMask.from_kv_blocks(*as_blocks(partial_tile), *as_blocks(full_tile), BLOCK_SIZE=tile,
                                    mask_mod=interval_mask_mod(rows_hi, rows_lo, block_size),
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
