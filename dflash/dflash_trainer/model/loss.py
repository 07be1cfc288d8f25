"""LM head + weighted cross-entropy, in chunks of rows, with the gradient computed in the forward.

The full [N*B, vocab] logits of one sample are 2.5 GB in bf16 for Qwen3-8B (8,192 queries x
151,936): never materialise them. The head is the target's and frozen, so the loss needs only the
gradient with respect to the drafter's hidden states, and that gradient does not depend on anything
computed later: each chunk computes logits -> CE -> d(loss)/d(hidden) at once, keeps the [rows, H]
gradient (64 MiB for the 8B shape) and drops its logits. The backward is one multiply by the
incoming scalar. Against activation checkpointing this saves recomputing the head in the backward:
a third of the head's GEMM work, the largest GEMM of the step.

The elementwise part (log-softmax, CE, softmax - one-hot, argmax) runs as one Triton kernel on GPUs
(`ce_kernel.ce_and_grad_`, which writes the gradient over the logits) and eagerly on CPUs and in
no-grad passes (`ce_and_grad`, the reference).

Against the target's distribution (`Objective`: kl, tv, mixed with ce as DSpark's 0.1 CE + 0.9 TV): the
target's logits at each block position come from its final normed hidden state through the same head,
chunk by chunk beside the drafter's, and the mixture and its gradient are computed in torch
(`mixture_and_grad`; compiled on GPUs with a gradient, COMPILED_MIXTURE) on chunks capped at
MIXTURE_CHUNK_LOGITS logits, since that path holds a few fp32 [rows, vocab] tensors at once. A pure CE
objective takes the CE path above, unchanged.

DSpark (model/dspark/objective.py) runs the same pass over its Markov-biased logits: `logit_bias` is a trained
low-rank term codes @ W^T added to each chunk's logits, whose gradients (codes', W's) come out of the chunk's
gradient like the hidden states' do, and `acceptance` returns each row's sum_v min(p_v, q_v) for its confidence
head, from the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F


@dataclass
class LossSums:
    """Additive terms of one micro-batch; divide by the step's total weight at the end."""

    weighted_loss: torch.Tensor  # scalar, carries the graph
    slot_correct: torch.Tensor  # [B] argmax == label where weight > 0
    slot_count: torch.Tensor  # [B] positions with weight > 0
    # the sum of the position weights the loss chose (D-PACE's); None: the blocks' own weights (Blocks.total_weight)
    weight: torch.Tensor | None = None
    candidates: torch.Tensor | None = None  # [rows, k] the top-k tokens of each scored row (DFlash 2's selector)
    row_weights: torch.Tensor | None = None  # [rows] D-PACE's weight of each scored row, where it chose them
    # [rows] each scored row's chance that the target accepts the drafter's token, sum_v min(p_v, q_v) (without
    # the target's distribution: q of the data's token), no gradient; where asked for (DSpark's confidence target)
    acceptance: torch.Tensor | None = None


def ce_and_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, with_grad: bool):
    """sum(w * CE), d(that)/d(logits) in the logits' dtype (or None), argmax == label, for [rows, V] logits."""
    ce, grad, hit = ce_rows_and_grad(logits, labels, weights, with_grad)
    return ce.sum(), grad, hit


def ce_rows_and_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, with_grad: bool):
    """w * CE per row, d(sum of it)/d(logits) in the logits' dtype (or None), argmax == label."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    ce = lse.squeeze(-1) - x.gather(1, labels.unsqueeze(1)).squeeze(1)
    hit = x.argmax(-1) == labels
    grad = None
    if with_grad:
        one_hot = torch.arange(x.shape[1], device=x.device) == labels.unsqueeze(1)
        grad = ((torch.exp(x - lse) - one_hot.float()) * weights.unsqueeze(1)).to(logits.dtype)
    return ce * weights, grad, hit


# Logits per chunk of the KL / TV path: six fp32 [rows, vocab] tensors of 512 MiB each at most (512 rows
# of Gemma 3's 262,144-token vocabulary).
MIXTURE_CHUNK_LOGITS = 1 << 27


@dataclass(frozen=True)
class Objective:
    """The loss per scored position, a weighted sum of: ce, the cross-entropy on the data's token (the
    default, alone); kl, KL(target || drafter), the forward KL from the target's softmax to the drafter's;
    tv, the total variation between the two, 1 - sum_v min(p_v, q_v), which is one minus the chance that
    speculative sampling accepts the drafter's token (so it optimises acceptance directly). Both
    distributions at temperature 1, as speculators' `kl_div` and `tv` losses."""

    ce: float = 1.0
    kl: float = 0.0
    tv: float = 0.0
    # None: the per-slot weights the blocks carry (exp(-(k-1)/gamma)); a number: D-PACE's weights instead
    # (dpace_weights), with this smoothing constant
    dpace_alpha: float | None = None

    @property
    def needs_target(self) -> bool:
        """The loss reads the target's distribution: the features must carry its final hidden states."""
        return self.kl > 0 or self.tv > 0


def dpace_weights(ce_rows: torch.Tensor, scored: torch.Tensor, slots: int, alpha: float) -> torch.Tensor:
    """D-PACE's per-position weights (speculators' dpace_loss_decay), no gradient: per block of `slots` scored
    positions, the drafter's confidence c_k = exp(-CE_k) in its token, smoothed to s_k = (1 - alpha) c_k + alpha
    (1 where a position carries no loss), prefix products P_k = s_1 ... s_k, and weight_k = the sum of P_j over
    the positions j >= k that carry loss: a slot weighs as much as the accepted run it can still start."""
    carries = scored.view(-1, slots).float()
    smooth = torch.where(carries > 0, (1 - alpha) * torch.exp(-ce_rows.view(-1, slots)) + alpha, 1.0)
    prefix = smooth.cumprod(-1) * carries
    return (prefix.flip(-1).cumsum(-1).flip(-1) * carries).reshape(-1)


def mixture_and_grad(logits: torch.Tensor, target_logits: torch.Tensor | None, labels: torch.Tensor,
                     weights: torch.Tensor, objective: Objective, with_grad: bool, acceptance: bool = False):
    """w * (ce * CE + kl * KL(p || q) + tv * TV(p, q)) per row, its sum's gradient over the drafter's logits in
    their dtype (or None), argmax == label, the CE per row (unweighted), and with acceptance each row's
    sum_v min(p_v, q_v) (else None); q the drafter's softmax, p the target's, for [rows, V] logits. target_logits
    None: CE alone, the acceptance q of the label (DSpark without the target's distribution)."""
    return mixture_rows_and_grad(logits, target_logits, labels, weights, objective.ce, objective.kl, objective.tv,
                                 with_grad, acceptance)


def mixture_rows_and_grad(logits: torch.Tensor, target_logits: torch.Tensor | None, labels: torch.Tensor,
                          weights: torch.Tensor, ce_weight: float, kl_weight: float, tv_weight: float,
                          with_grad: bool, acceptance: bool = False):
    """mixture_and_grad with the objective's weights as numbers (what COMPILED_MIXTURE is traced with).

    The gradient is one expression, w * (q * (ce + kl + tv * sum_{q<p} q) - tv * [q < p] q - kl * p - ce * one_hot),
    built in place: eager, few [rows, vocab] passes; compiled, the logits are read a few times and the gradient
    written once."""
    x = logits.float()
    log_q = x - torch.logsumexp(x, dim=-1, keepdim=True)
    q = log_q.exp()
    ce = -log_q.gather(1, labels.unsqueeze(1)).squeeze(1)
    loss = ce_weight * ce
    per_row = ce_weight + kl_weight  # d(loss)/dx's multiple of q
    accepted = torch.exp(-ce) if acceptance and target_logits is None else None
    if target_logits is not None:
        log_p = torch.log_softmax(target_logits.float(), dim=-1)
        p = log_p.exp()
        overlap = torch.minimum(p, q).sum(-1) if tv_weight or acceptance else None
        accepted = overlap if acceptance else None
    if kl_weight:  # p * (log p - log q) summed; a token the target gives no mass adds nothing (0 * log 0 = 0)
        loss = loss + kl_weight * torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    if tv_weight:
        loss = loss + tv_weight * (1 - overlap)
        # d(-sum_{v: q_v < p_v} q_v) / dx_j = q_j * (sum_{q < p} q - [q_j < p_j])
        q_below = torch.where(q < p, q, 0.0)
        per_row = per_row + tv_weight * q_below.sum(-1, keepdim=True)
    grad = None
    if with_grad:
        grad = q * per_row
        if tv_weight:
            grad.sub_(q_below, alpha=tv_weight)
        if kl_weight:
            grad.sub_(p, alpha=kl_weight)
        if ce_weight and torch.compiler.is_compiling():  # element-wise: fuses into the gradient's one write
            grad = grad - ce_weight * (torch.arange(x.shape[1], device=x.device) == labels.unsqueeze(1)).float()
        elif ce_weight:  # eager: one small op, not a pass over [rows, vocab]
            grad.scatter_add_(1, labels.unsqueeze(1), torch.full((x.shape[0], 1), -ce_weight, device=x.device))
        grad = grad.mul_(weights.unsqueeze(1)).to(logits.dtype)
    return loss * weights, grad, x.argmax(-1) == labels, ce, accepted


# The mixture on GPUs with a gradient. Eager, each of its element-wise ops is a pass over fp32 [rows, vocab]
# tensors (before this was compiled, 0.1 CE + 0.9 TV spent 12.5x the CE kernel's element-wise CPU time on a
# 65,536-token vocabulary; compiled, 2.3x); compiled, they fuse into one kernel that reads the two logits and
# writes the gradient once. Rows are dynamic (the last chunk
# is shorter), so one graph serves every chunk; the compile step compiles it with the drafter's step. DSpark's
# objective runs the same function over its Markov-biased logits, with the acceptance its confidence head learns.
COMPILED_MIXTURE = torch.compile(mixture_rows_and_grad, dynamic=False, fullgraph=True)


def compiled_mixture_and_grad(logits, target_logits, labels, weights, objective: Objective, acceptance: bool = False):
    """mixture_and_grad (with the gradient) through COMPILED_MIXTURE, one graph for any count of rows."""
    for t in (logits, target_logits, labels, weights):
        if t is not None:
            torch._dynamo.mark_dynamic(t, 0)
    return COMPILED_MIXTURE(logits, target_logits, labels, weights, objective.ce, objective.kl, objective.tv, True,
                            acceptance)


def chunk_slices(rows: int, chunk_rows: int) -> list[slice]:
    """[0, rows) in chunks of chunk_rows, none of exactly one row where rows > 1: a compiled kernel marked dynamic
    in its rows (COMPILED_MIXTURE) specialises a size of 1 into a graph of its own, a recompile after the compile
    step. A last chunk of one row joins the chunk before it."""
    bounds = list(range(0, rows, chunk_rows)) + [rows]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return [slice(a, b) for a, b in pairwise(bounds)]


def _chunk_kernel(mixture: Objective | None, head_weight, shaping, with_grad: bool, compiled_mixture: bool,
                  triton_ce: bool, acceptance: bool):
    """f(logits, labels, weights, target_rows) -> (w * loss per row, gradient, argmax == label, CE per row,
    acceptance per row or None). With a gradient, the mixture through COMPILED_MIXTURE where compiled_mixture,
    CE alone through the Triton kernel where triton_ce (GPUs)."""
    if mixture is not None:
        def mixture_kernel(logits, labels, weights, target_rows):
            target_logits = None
            if target_rows is not None:  # shaped as the target's own head shapes them
                target_logits = F.linear(target_rows, head_weight)
                if shaping is not None:
                    target_logits = _shaped_with_slope(target_logits, *shaping)[0]
            if compiled_mixture and with_grad:
                return compiled_mixture_and_grad(logits, target_logits, labels, weights, mixture, acceptance)
            return mixture_and_grad(logits, target_logits, labels, weights, mixture, with_grad, acceptance)
        return mixture_kernel
    if triton_ce and with_grad:
        from .ce_kernel import ce_rows_and_grad_

        def ce_kernel(logits, labels, weights, _target_logits):
            ce, grad, hit = ce_rows_and_grad_(logits, labels, weights)
            return ce, grad, hit, ce, None
        return ce_kernel

    def ce_reference(logits, labels, weights, _target_logits):  # CPUs and no-grad passes (evaluation)
        ce, grad, hit = ce_rows_and_grad(logits, labels, weights, with_grad)
        return ce, grad, hit, ce, None
    return ce_reference


def _chunk_logits(hidden, head_weight, shaping, codes, bias_weight):
    """A chunk's logits through the head, the target's transform (Gemma 2's soft-cap) and the trained bias (after
    the transform, as the drafter's markov_logits adds it); and the transform's slope, for the chain rule."""
    logits, slope = F.linear(hidden, head_weight), None
    if shaping is not None:
        logits, slope = _shaped_with_slope(logits, *shaping)
    if codes is not None:
        logits = logits + F.linear(codes, bias_weight).to(logits.dtype)
    return logits, slope


@dataclass
class _ChunkGrads:
    """What the chunks' gradients over their logits add up to: d/d(hidden) per row and, with a trained logit bias,
    d/d(codes) per row and d/d(its weight), summed over the chunks in the weight's dtype."""

    hidden: torch.Tensor
    codes: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def empty(cls, hidden, codes, bias_weight) -> _ChunkGrads:
        biased = codes is not None
        return cls(torch.empty_like(hidden), torch.empty_like(codes) if biased else None,
                   torch.zeros_like(bias_weight) if biased else None)

    def add(self, sl: slice, grad_logits, slope, head_weight, codes, bias_weight) -> None:
        if self.codes is not None:  # logits += codes @ W^T: d/d(codes) = g @ W, d/dW = g^T @ codes
            g = grad_logits.to(bias_weight.dtype)
            self.codes[sl] = g @ bias_weight
            self.bias.addmm_(g.t(), codes[sl].to(g.dtype))
        if slope is not None:
            grad_logits = grad_logits * slope
        torch.mm(grad_logits, head_weight, out=self.hidden[sl])


class _HeadCrossEntropy(torch.autograd.Function):
    """sum(weights * CE(hidden @ head^T, labels)), or the objective's mixture against the target's logits
    (target_hidden @ head^T), with d/d(hidden) computed chunk by chunk in the forward.

    mixture: the objective (None: CE through the CE kernels); its target_hidden None: CE alone through the
    mixture's kernel (for the acceptance); dpace: (alpha, scale): each row's loss and gradient computed
    unweighted, then weighted by D-PACE's weights (times scale) once every row's CE is known (the gradient is
    linear in a row's weight); None: by `weights`. top_k > 0: also each row's top_k tokens, from the same logits
    (DFlash 2's selector candidates). codes, bias_weight: a trained low-rank bias codes @ bias_weight^T added to
    the (shaped) logits, DSpark's Markov head: their gradients are computed in the same pass. acceptance: also
    each row's acceptance (LossSums.acceptance). compiled_mixture: the mixture through COMPILED_MIXTURE."""

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, slots, block_size, chunk_rows, with_grad, shaping,
                mixture, target_hidden, dpace, top_k, codes, bias_weight, acceptance, compiled_mixture):
        if mixture is not None:  # the torch mixture holds several fp32 [rows, vocab] tensors: smaller chunks
            chunk_rows = max(2, min(chunk_rows, MIXTURE_CHUNK_LOGITS // head_weight.shape[0]))
        kernel = _chunk_kernel(mixture, head_weight, shaping, with_grad, compiled_mixture, hidden.is_cuda, acceptance)
        scored = weights > 0
        if dpace is not None:
            weights = scored.float()
            row_loss, row_ce = (torch.zeros(hidden.shape[0], device=hidden.device) for _ in range(2))
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.zeros(block_size, device=hidden.device)
        count = torch.zeros(block_size, device=hidden.device)
        grads = _ChunkGrads.empty(hidden, codes, bias_weight) if with_grad else None
        accepted = torch.zeros(hidden.shape[0] if acceptance else 0, device=hidden.device)
        candidates = torch.zeros(hidden.shape[0], top_k, dtype=torch.long, device=hidden.device)
        for sl in chunk_slices(hidden.shape[0], chunk_rows):
            logits, slope = _chunk_logits(hidden[sl], head_weight, shaping, None if codes is None else codes[sl],
                                          bias_weight)
            if top_k:  # before the kernel, which may write the gradient over the logits
                candidates[sl] = torch.topk(logits, top_k, dim=-1).indices
            part, grad_logits, hit, ce, row_acceptance = kernel(
                logits, labels[sl], weights[sl], None if target_hidden is None else target_hidden[sl])
            del logits
            if acceptance:
                accepted[sl] = row_acceptance
            if grads is not None:
                grads.add(sl, grad_logits, slope, head_weight, codes, bias_weight)
            if dpace is None:
                total += part.sum()
            else:
                row_loss[sl], row_ce[sl] = part, ce
            correct.index_add_(0, slots[sl], (hit & scored[sl]).float())
            count.index_add_(0, slots[sl], scored[sl].float())
        row_weights = total.new_zeros(0)  # each row's weight where D-PACE chose them (else the caller's own)
        if dpace is not None:
            total, row_weights = _weigh_by_dpace(row_loss, row_ce, scored, block_size,
                                                 None if grads is None else grads.hidden, *dpace)
        ctx.save_for_backward(*(None, None, None) if grads is None else (grads.hidden, grads.codes, grads.bias))
        ctx.mark_non_differentiable(correct, count, row_weights, candidates, accepted)
        return total, correct, count, row_weights, candidates, accepted

    @staticmethod
    def backward(ctx, grad_total, *_non_differentiable):
        def scaled(grad):
            return None if grad is None else grad * grad_total.to(grad.dtype)

        grad_hidden, grad_codes, grad_bias = ctx.saved_tensors
        return (scaled(grad_hidden), *[None] * 12, scaled(grad_codes), scaled(grad_bias), None, None)


def _weigh_by_dpace(row_loss, row_ce, scored, block_size: int, grad_hidden, alpha: float, scale: float):
    """The loss and (in place) the rows' gradients weighted by D-PACE (times scale); (the loss, the weights)."""
    position_weights = dpace_weights(row_ce, scored, block_size - 1, alpha)
    if grad_hidden is not None:
        grad_hidden.mul_((position_weights * scale).unsqueeze(1).to(grad_hidden.dtype))
    return (position_weights * scale * row_loss).sum(), position_weights


def _shaped_with_slope(raw: torch.Tensor, multiplier: float, softcap: float | None):
    """c * tanh(m * raw / c) (or m * raw without a cap), and its derivative with respect to raw."""
    scaled = raw * multiplier
    if not softcap:
        return scaled, multiplier
    capped = torch.tanh(scaled / softcap) * softcap
    return capped, (1 - (capped.float() / softcap) ** 2).mul_(multiplier).to(raw.dtype)


def scored_rows(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, N*B, ...] -> [b*N*(B-1), ...]: every block's slots 1..B-1 (slot 0, the anchor, never carries loss)."""
    b, rows = t.shape[:2]
    return t.reshape(b, rows // block_size, block_size, *t.shape[2:])[:, :, 1:].reshape(-1, *t.shape[2:])


def chunked_block_loss(
    hidden: torch.Tensor,  # [b, N*B, H] drafter output (normalised)
    head_weight: torch.Tensor,  # [V, H] frozen target LM head
    labels: torch.Tensor,  # [b, N*B]
    weights: torch.Tensor,  # [b, N*B]; slot 0 of each block must be 0 (it is ignored)
    block_size: int,
    chunk_rows: int = 2048,
    output_multiplier: float = 1.0,  # the target's logit transform (model.shape_logits), as serving applies it
    final_logit_softcapping: float | None = None,
    objective: Objective | None = None,  # None, or ce alone: the CE path
    target_hidden: torch.Tensor | None = None,  # [b, N*B, H] the target's final normed hidden state before each
    # block position (the one whose logits predict its token); needed where objective.needs_target
    top_k: int = 0,  # > 0: also the top_k tokens of each scored row (LossSums.candidates), from the same logits
    # (codes [b, N*B, r], weight [V, r]): a trained low-rank bias codes @ weight^T added to the logits after the
    # target's transform (DSpark's Markov head); the gradients of both come out of the same pass
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    acceptance: bool = False,  # also each scored row's acceptance (LossSums.acceptance): the objective's mixture path
    compiled_mixture: bool | None = None,  # the mixture through COMPILED_MIXTURE; None: on GPUs
) -> LossSums:
    if head_weight.requires_grad:
        raise ValueError("the LM head is the target's and must be frozen (requires_grad=False): DFlash does "
                         "not train it, and the loss computes gradients for the drafter's hidden states only")
    # Slot 0 of every block is the anchor itself: it never carries loss (anchors.build_blocks), so its
    # rows skip the head's two GEMMs and the CE kernel (1/B of the largest GEMMs of the step).
    def scored(t: torch.Tensor) -> torch.Tensor:
        return scored_rows(t, block_size)

    h = scored(hidden)
    slots = torch.arange(1, block_size, device=h.device).repeat(h.shape[0] // (block_size - 1))
    codes, bias_weight = (None, None) if logit_bias is None else (scored(logit_bias[0]), logit_bias[1])
    trained = [h] if codes is None else [h, codes, bias_weight]
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in trained)
    shaping = (None if output_multiplier == 1.0 and not final_logit_softcapping
               else (output_multiplier, final_logit_softcapping))
    if objective is not None and objective.needs_target and target_hidden is None:
        raise ValueError(f"{objective} compares the drafter with the target's distribution: give target_hidden, "
                         "the target's final hidden states at the block positions")
    # the mixture's path where the loss reads the target or the acceptance is asked for; else the CE path
    reads_target = objective is not None and objective.needs_target
    mixture = (objective or Objective()) if acceptance or reads_target else None
    ce_scale = objective.ce if mixture is None and objective is not None else 1.0  # ce alone, scaled
    dpace = None if objective is None or objective.dpace_alpha is None else (objective.dpace_alpha, ce_scale)
    if dpace is not None and codes is not None:
        raise ValueError("D-PACE weighs the rows after their gradients are computed, which a trained logit bias's "
                         "weight (summed over the rows) cannot follow: weigh the positions by exp-decay")
    if dpace is None and ce_scale != 1.0:
        weights = weights * ce_scale
    target_rows = scored(target_hidden.to(head_weight.dtype)) if mixture is not None and mixture.needs_target else None
    compiled = hidden.is_cuda if compiled_mixture is None else compiled_mixture
    total, correct, count, row_weights, candidates, accepted = _HeadCrossEntropy.apply(
        h, head_weight, scored(labels), scored(weights).to(torch.float32), slots, block_size, chunk_rows, with_grad,
        shaping, mixture, target_rows, dpace, top_k, codes, bias_weight, acceptance, compiled)
    chosen = dpace is not None
    return LossSums(total, correct, count, row_weights.sum() if chosen else None, candidates if top_k else None,
                    row_weights if chosen else None, accepted if acceptance else None)
