"""DSpark's objective, as speculators trains it (models/dspark: core.py, metrics.py).

Each scored block position's logits are the LM head's plus the Markov head's bias of its true previous token
(teacher-forced: the label of the position before; the anchor's token for the first drafted position). On them,
the run's mixture (train.loss_ce / loss_kl / loss_tv; DSpark's authors train 0.1 CE + 0.9 TV), and the
confidence head's binary cross-entropy against the position's acceptance: speculators' analytic acceptance
sum_v min(q_v, p_v) = 1 - TV(q, p), q the drafter's distribution and p the target's. Without the target's
distribution (a CE-only run), p is the data's token: the acceptance is q of that token. Both terms are weighted
by the blocks' position decay exp(-(k-1)/gamma); the step's loss is mixture + confidence_loss_weight * BCE.

The mixture is the plain drafter's (model/loss.py): the Markov bias is a trained low-rank term the chunked head
adds to each chunk's logits, so the [rows, vocab] work is one pass per chunk with its gradient computed in the
forward (one compiled kernel on GPUs, COMPILED_MIXTURE), and that pass also gives each row's acceptance. The
Markov codes and the confidence head are [rows, rank] and [rows] tensors: plain autograd.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..loss import LossSums, Objective, chunked_block_loss, scored_rows


def dspark_loss(drafter, hidden: torch.Tensor, previous: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                head_weight: torch.Tensor, objective: Objective | None = None,
                target_hidden: torch.Tensor | None = None, confidence_weight: float = 1.0,
                chunk_rows: int = 2048, compiled_mixture: bool | None = None) -> LossSums:
    """LossSums of sum(w * (mixture + confidence_weight * BCE)) over the scored rows of whole blocks ([b, N*B, H]
    hidden and target_hidden; [b, N*B] previous tokens, labels, weights; slot 0 of each block carries no loss),
    the slots' accuracy that of the Markov-biased logits. compiled_mixture: as chunked_block_loss's."""
    if drafter.markov_head.head_type == "rnn":
        raise ValueError("DSpark's rnn Markov head carries its state from the anchor's slot, which this trainer "
                         "does not train or draft: use markov_head_type vanilla or gated")
    block = drafter.block_size
    codes = drafter.markov_head.step(previous, hidden)[0]  # markov_logits's bias, before markov_w2
    sums = chunked_block_loss(hidden.to(head_weight.dtype), head_weight, labels, weights, block, chunk_rows,
                              drafter.output_multiplier, drafter.final_logit_softcapping, objective or Objective(),
                              target_hidden, logit_bias=(codes, drafter.markov_head.markov_w2.weight),
                              acceptance=True, compiled_mixture=compiled_mixture)
    rows_hidden, rows_previous, rows_weights = (scored_rows(t, block) for t in (hidden, previous, weights))
    bce = F.binary_cross_entropy_with_logits(drafter.confidence(rows_hidden, rows_previous).float(), sums.acceptance,
                                             reduction="none")
    return replace(sums, weighted_loss=sums.weighted_loss + confidence_weight * (rows_weights.float() * bce).sum())
