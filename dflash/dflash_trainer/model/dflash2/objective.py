"""DFlash 2's selector objective, as speculators trains it (models/dflash2: core.py, metrics.py).

At every scored block position the selector sees the drafter's unary top-k candidates; when the label is not
among them it replaces the weakest, so each position has a k-way cross-entropy label. The candidates' scores
are their unary logits plus the selector's transition scores with the teacher-forced predecessor (the label
of the position before; the anchor token for the first drafted position), as serving follows the drafted
path. The CE is weighted as the unary CE is (the position decay), and the step's loss is
unary + selector_loss_weight * selector. Its gradient reaches the selector and, through the candidates'
unary logits and the selector's hidden projection, the drafter.

The unary term is the run's objective (`unary_objective` of model/objective.py: train.loss_*, the hard-label CE
by default; speculators' default is the KL to the target's distribution), and the selector's CE weighs each
position as the unary term does (D-PACE's weights where the run chose them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .modules import CandidateSelector


def predecessors(labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, N*B] labels -> each slot's predecessor: the label of the slot before (slot 1: the anchor's token,
    which is slot 0's label)."""
    blocks = labels.view(labels.shape[0], -1, block_size)
    return torch.cat([blocks[..., :1], blocks[..., :-1]], dim=-1).view_as(labels)


def training_candidates(candidates: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """speculators' selector_training_candidates: (candidates with a missing label in the last column, the
    label's column, whether the unary top-k held it)."""
    matches = candidates.eq(labels.unsqueeze(-1))
    contains = matches.any(dim=-1)
    last = candidates.shape[-1] - 1
    column = torch.where(contains, matches.long().argmax(dim=-1), last)
    injected = candidates.clone()
    injected[..., last] = torch.where(contains, candidates[..., last], labels)
    return injected, column, contains


class _CandidateLogits(torch.autograd.Function):
    """The LM head's (shaped) logits of k candidates per row, in chunks: the [rows, k, H] head rows they need
    are gathered chunk by chunk in the forward and again in the backward, never kept."""

    @staticmethod
    def forward(ctx, hidden, head_weight, candidates, chunk_rows, multiplier, softcap):
        out = torch.empty(candidates.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            sl = slice(start, start + chunk_rows)
            raw = torch.einsum("rh,rkh->rk", hidden[sl], F.embedding(candidates[sl], head_weight)).float()
            raw = raw * multiplier
            out[sl] = torch.tanh(raw / softcap) * softcap if softcap else raw
        ctx.save_for_backward(head_weight, candidates, out)
        ctx.chunk_rows, ctx.multiplier, ctx.softcap, ctx.dtype = chunk_rows, multiplier, softcap, hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        head_weight, candidates, out = ctx.saved_tensors
        slope = ctx.multiplier * (1 - (out / ctx.softcap) ** 2) if ctx.softcap else ctx.multiplier
        grad_raw = (grad_out * slope).to(head_weight.dtype)
        grad_hidden = torch.empty(candidates.shape[0], head_weight.shape[1], dtype=ctx.dtype, device=out.device)
        for start in range(0, candidates.shape[0], ctx.chunk_rows):
            sl = slice(start, start + ctx.chunk_rows)
            grad_hidden[sl] = torch.einsum("rk,rkh->rh", grad_raw[sl], F.embedding(candidates[sl], head_weight))
        return grad_hidden, None, None, None, None, None


def selector_ce(selector: CandidateSelector, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor, chunk_rows: int = 2048,
                multiplier: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * k-way CE) over the scored rows ([rows, H] hidden; [rows] labels, weights, predecessors;
    [rows, k] unary top-k), and the rows whose selector-ranked first candidate is the label, among the rows
    whose unary top-k held it (what serving could have picked): the teacher-forced selector accuracy."""
    injected, column, contains = training_candidates(candidates, labels)
    unary = _CandidateLogits.apply(hidden, head_weight, injected, chunk_rows, multiplier, softcap)
    scores = unary + selector(hidden, previous, injected).float()
    ce = F.cross_entropy(scores, column, reduction="none")
    hit = (scores.detach().argmax(-1) == column) & contains
    return (ce * weights.float()).sum(), hit
