"""Test-only attention helpers: undo the dense-path guards, masks built by create_block_mask, the
fused-kernel memory probe. Production code never needs these (the trainer's masks come from
mask.dflash_block_mask, and its guards stay installed for the life of the process)."""

from __future__ import annotations

import importlib
import warnings

import torch
from dflash_trainer.model import attention
from dflash_trainer.model.attention import EAGER_FLEX_WARNING, DenseFallbackError, attend, dense_scores_bytes
from dflash_trainer.model.mask import dflash_mask_mod
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def remove_dense_guards() -> None:
    """Undo attention.install_dense_guards, so each test starts from torch's own behaviour."""
    state = attention._guard_state
    hop_module = importlib.import_module("torch._higher_order_ops.flex_attention")
    if state["original"] is not None:
        hop_module._math_attention_inner = state["original"]
        state["original"] = None
    warnings.filters[:] = [
        f for f in warnings.filters
        if not (f[0] == "error" and f[1] is not None and f[1].pattern == EAGER_FLEX_WARNING)
    ]
    state["installed"] = False
    state["shown"] = None


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_block_mask(length: int, device) -> BlockMask:
    """A causal BlockMask through create_block_mask (eager: it evaluates the mask over the whole grid)."""
    return create_block_mask(causal, 1, None, length, length, device=device)


def reference_block_mask(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, ctx_len: int) -> BlockMask:
    """The DFlash BlockMask through create_block_mask (mask_mod evaluated over the whole grid): the
    reference that mask.dflash_block_mask's interval arithmetic is tested against. H=None: one mask
    shared by all heads."""
    b, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    return create_block_mask(dflash_mask_mod(anchors, keep, block_size, ctx_len), b, None, q_len, kv_len,
                             device=anchors.device)


def fused_memory_probe(batch: int, heads: int, length: int, head_dim: int, device,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """One no-grad attend() over a full mask: (its peak memory above the inputs, one dense fp32 score copy).

    Raises DenseFallbackError when the peak exceeds a quarter of one dense copy (the fused kernel needs
    O(B*H*L*D), the math path more than 3 copies). CUDA only.
    """
    mask = create_block_mask(lambda b, h, q, kv: q >= 0, batch, None, length, length, device=device)
    q = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
    k, v = torch.randn_like(q), torch.randn_like(q)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        out = attend(q, k, v, mask)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    dense = dense_scores_bytes(batch, heads, length, length)
    if peak > dense // 4:
        raise DenseFallbackError(f"attention peaked at {peak / 2**20:.0f} MiB, more than a quarter of one dense "
                                 f"score copy ({dense / 2**20:.0f} MiB): it is not running the fused kernel")
    return peak, dense
