"""Test helper: one plain training step of a drafter on CPU (dense SDPA attention, no compile), the loop
the objective and evaluation tests use to get a drafter that has learnt something."""

from __future__ import annotations

import torch
from dflash_trainer.anchors import build_blocks, sample_anchors
from dflash_trainer.objective import block_attention, drafter_loss


def sdpa_step(drafter, optimizer, target, ids, loss_mask, features, num_anchors: int, seed: int) -> None:
    """Anchors seeded by `seed`, blocks, the dense reference attention, weighted CE, backward, AdamW."""
    config = drafter.config
    anchors, keep = sample_anchors(loss_mask, num_anchors=num_anchors, generator=torch.Generator().manual_seed(seed))
    blocks = build_blocks(ids, loss_mask, anchors, keep, config.block_size, drafter.mask_token_id)
    sums = drafter_loss(drafter, target.embed_weight, target.head_weight, features, blocks,
                        block_attention("sdpa", blocks, ids.shape[1], config.block_size, config))
    sums.weighted_ce.backward()
    optimizer.step(1.0 / blocks.total_weight)
    optimizer.zero_grad()
