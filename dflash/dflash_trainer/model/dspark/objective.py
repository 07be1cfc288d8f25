"""DSpark's objective, as speculators trains it (models/dspark: core.py, metrics.py).

Each scored block position's logits are the LM head's plus the Markov head's bias of its true previous token
(teacher-forced: the label of the position before; the anchor's token for the first drafted position). On them,
the run's mixture (train.loss_ce / loss_kl / loss_tv; DSpark's authors train 0.1 CE + 0.9 TV), and the
confidence head's binary cross-entropy against the position's acceptance: speculators' analytic acceptance
sum_v min(q_v, p_v) = 1 - TV(q, p), q the drafter's distribution and p the target's. Without the target's
distribution (a CE-only run), p is the data's token: the acceptance is q of that token. Both terms are weighted
by the blocks' position decay exp(-(k-1)/gamma); the step's loss is mixture + confidence_loss_weight * BCE.

The rows go through in chunks, each recomputed in the backward (activation checkpointing), so no more than a
chunk of [rows, vocab] logits is ever held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..loss import LossSums, Objective


def mixture_rows(logits: torch.Tensor, target_logits: torch.Tensor | None, labels: torch.Tensor,
                 objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mixture per row, differentiable; the acceptance per row, no gradient) for [rows, V] logits."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    q = log_q.exp()
    loss = objective.ce * -log_q.gather(1, labels.unsqueeze(1)).squeeze(1)
    if target_logits is None:
        return loss, q.detach().gather(1, labels.unsqueeze(1)).squeeze(1)
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    p = log_p.exp()
    overlap = torch.minimum(p, q).sum(-1)
    if objective.kl:
        loss = loss + objective.kl * torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    if objective.tv:
        loss = loss + objective.tv * (1 - overlap)
    return loss, overlap.detach()


def dspark_loss(drafter, hidden: torch.Tensor, previous: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                head_weight: torch.Tensor, objective: Objective | None = None,
                target_hidden: torch.Tensor | None = None, confidence_weight: float = 1.0,
                chunk_rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * (mixture + confidence_weight * BCE)) over scored rows ([rows, H] hidden and target_hidden;
    [rows] previous tokens, labels, weights), and each row's argmax == label under the Markov-biased logits."""
    if drafter.markov_head.head_type == "rnn":
        raise ValueError("DSpark's rnn Markov head carries its state from the anchor's slot, which this trainer "
                         "does not train or draft: use markov_head_type vanilla or gated")
    objective = objective or Objective()
    weights = weights.float()

    def chunk(h, prev, lab, w, target):
        logits = drafter.markov_logits(h, prev, head_weight)
        target_logits = None if target is None else drafter.logits(target.to(head_weight.dtype), head_weight)
        loss, accept = mixture_rows(logits, target_logits, lab, objective)
        bce = F.binary_cross_entropy_with_logits(drafter.confidence(h, prev).float(), accept, reduction="none")
        return (w * (loss + confidence_weight * bce)).sum(), logits.detach().argmax(-1) == lab

    total, hits = hidden.new_zeros((), dtype=torch.float32), []
    for start in range(0, hidden.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        target = None if target_hidden is None else target_hidden[sl]
        part, hit = checkpoint(chunk, hidden[sl], previous[sl], labels[sl], weights[sl], target, use_reentrant=False)
        total = total + part
        hits.append(hit)
    return total, torch.cat(hits)


def dspark_sums(total: torch.Tensor, hit: torch.Tensor, weights: torch.Tensor, block_size: int) -> LossSums:
    """LossSums of dspark_loss's rows (scored rows of whole blocks, slots 1..B-1 in order)."""
    slots = torch.arange(1, block_size, device=hit.device).repeat(weights.shape[0] // (block_size - 1))
    scored = weights > 0
    correct = torch.zeros(block_size, device=hit.device).index_add_(0, slots, (hit & scored).float())
    count = torch.zeros(block_size, device=hit.device).index_add_(0, slots, scored.float())
    return LossSums(total, correct, count)
