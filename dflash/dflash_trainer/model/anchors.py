"""Random anchors and the block inputs, labels and loss weights built from them.

Per sequence, N anchor positions are drawn uniformly without replacement at every step from the
positions a with loss_mask[a] and loss_mask[a+1] set (an assistant token followed by one). N is
fixed, so shapes are static; sequences with fewer valid positions get padding blocks (keep False).
Block j is [x_a, MASK x (B-1)] at positions a..a+B-1; slot k >= 1 predicts x[a+k] (the same
position, no shift), weighted by exp(-(k-1)/gamma).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# gamma for the position decay, by block size (DFlash paper; SpecForge recipes).
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [b, N] (sorted ascending, 0 for padding) and keep [b, N]; no host sync."""
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    keys = torch.rand(lm.shape, generator=generator, device=lm.device)
    keys = keys.masked_fill(~valid, 2.0)  # invalid positions sort last
    k = min(num_anchors, lm.shape[1])
    picked_keys, picked = torch.topk(keys, k, dim=1, largest=False)
    keep = picked_keys < 2.0
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    # Sort valid anchors ascending (padding, keyed past every position, goes last).
    order = torch.argsort(torch.where(keep, anchors, torch.full_like(anchors, lm.shape[1])), dim=1)
    anchors, keep = anchors.gather(1, order), keep.gather(1, order)
    if k < num_anchors:  # fewer positions than anchors: pad with empty blocks
        pad = num_anchors - k
        anchors = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(keep.shape[0], pad)], dim=1)
    return anchors, keep


@dataclass
class Blocks:
    """Everything the drafter step needs about the N blocks of a micro-batch."""

    anchors: torch.Tensor  # [b, N]
    keep: torch.Tensor  # [b, N] bool
    token_ids: torch.Tensor  # [b, N*B] anchor token then MASK
    position_ids: torch.Tensor  # [b, N*B] a..a+B-1
    labels: torch.Tensor  # [b, N*B] x[a+k]
    weights: torch.Tensor  # [b, N*B] float, 0 where no loss

    @property
    def total_weight(self) -> torch.Tensor:
        return self.weights.sum()


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
) -> Blocks:
    b, seq = input_ids.shape
    n = anchors.shape[1]
    gamma = default_gamma(block_size) if gamma is None else gamma
    offsets = torch.arange(block_size, device=input_ids.device)
    pos = anchors.unsqueeze(-1) + offsets  # [b, N, B]
    in_seq = pos < seq
    pos_c = pos.clamp(max=seq - 1).view(b, -1)
    labels = input_ids.gather(1, pos_c).view(b, n, block_size)
    supervised = loss_mask.bool().gather(1, pos_c).view(b, n, block_size) & in_seq
    slot = offsets.view(1, 1, -1)
    decay = torch.exp(-(offsets.float() - 1).clamp(min=0) / gamma)
    active = keep.unsqueeze(-1) & (slot >= 1) & supervised
    weights = active.float() * decay
    anchor_tok = input_ids.gather(1, anchors)  # [b, N]
    first = torch.where(keep, anchor_tok, torch.full_like(anchor_tok, mask_token_id))
    token_ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    token_ids[:, :, 0] = first
    return Blocks(
        anchors=anchors,
        keep=keep,
        token_ids=token_ids.view(b, -1),
        position_ids=pos.view(b, -1),
        labels=labels.view(b, -1),
        weights=weights.view(b, -1),
    )

