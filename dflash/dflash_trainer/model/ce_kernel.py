"""Weighted cross-entropy and its gradient over one chunk of head logits, as one Triton kernel (GPUs).

Per row of [rows, vocab] bf16 logits: sum(w * CE), argmax == label, and d(w * CE)/d(logits) =
w * (softmax - one_hot), written over the logits in place (they are not needed afterwards, and a
second [2048, 151936] buffer would be 622 MB). The row is read twice: once for an online max /
sum-of-exp / argmax, once to write the gradient. Inductor's kernel for the same expression
(`loss.ce_and_grad` compiled) read the logits more often: 0.91 ms against 0.60 ms per 2,048-row chunk
of Qwen3's vocabulary on an H200, and its compile was one more graph in every start's compile step.
`loss.ce_and_grad` stays the reference (CPUs, evaluation, the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per loop iteration and warps per row: the fastest of 2,048-16,384 x 4-16 on an H200.
BLOCK = 8192
NUM_WARPS = 8


@triton.jit
def _ce_and_grad_kernel(logits, row_stride, labels, weights, ce_out, hit_out, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    label = tl.load(labels + row)
    # Pass 1: running max, sum of exp (rescaled when the max grows) and argmax (first index on ties, as torch).
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_at = tl.zeros((), tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_at = tl.argmax(x, 0).to(tl.int64) + start
        better = block_max > best
        best_at = tl.where(better, block_at, best_at)
        best = tl.where(better, block_max, best)
        new_max = tl.maximum(run_max, block_max)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    weight = tl.load(weights + row)
    label_logit = tl.load(base + label).to(tl.float32)
    tl.store(ce_out + row, (lse - label_logit) * weight)
    tl.store(hit_out + row, (best_at == label).to(tl.int8))
    # Pass 2: the gradient, over the logits.
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - (cols == label).to(tl.float32)) * weight
        tl.store(base + cols, grad.to(logits.dtype.element_ty), mask=inside)


def ce_and_grad_(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """sum(w * CE), the gradient (the logits tensor, overwritten), argmax == label; as loss.ce_and_grad."""
    ce, grad, hit = ce_rows_and_grad_(logits, labels, weights)
    return ce.sum(), grad, hit


def ce_rows_and_grad_(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """w * CE per row, the gradient (the logits tensor, overwritten), argmax == label; as loss.ce_rows_and_grad."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("ce_and_grad_ needs row-major logits (stride 1 along the vocabulary)")
    ce = torch.empty(rows, device=logits.device, dtype=torch.float32)
    hit = torch.empty(rows, device=logits.device, dtype=torch.int8)
    _ce_and_grad_kernel[(rows,)](logits, logits.stride(0), labels, weights, ce, hit, vocab, BLOCK=BLOCK,
                                 num_warps=NUM_WARPS)
    return ce, logits, hit.bool()
