"""Test helper: one plain training step of a drafter on CPU (dense SDPA attention, no compile), the loop
the objective and evaluation tests use to get a drafter that has learnt something."""

from __future__ import annotations

import torch
from dflash_trainer.model.objective import drafter_loss, prepare_micro_batch


def sdpa_step(drafter, optimizer, target, ids, loss_mask, features, num_anchors: int, seed: int) -> None:
    """The trainer's micro-batch (anchors seeded by `seed`, blocks, the dense reference attention),
    weighted CE, backward, AdamW."""
    mb = prepare_micro_batch(ids, loss_mask, num_anchors, drafter.config, drafter.mask_token_id, None, "sdpa",
                             torch.Generator().manual_seed(seed))
    sums = drafter_loss(drafter, target.embed_weight, target.head_weight, features, mb.blocks, mb.attention)
    sums.weighted_loss.backward()
    optimizer.step(1.0 / mb.blocks.total_weight)
    optimizer.zero_grad()


def random_drafter_dir(target_dir, out):
    """A drafter with random weights built for the target in `target_dir` (1 layer, block 4), saved in `out`."""
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = drafter_config(AutoConfig.from_pretrained(target_dir),
                            DrafterShape(num_layers=1, block_size=4, mask_token_id=tokenizer.mask_token_id))
    DFlashDrafter(config).save_pretrained(out)
    return out
