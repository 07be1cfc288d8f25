"""DFlash 2's two additions to a DFlash drafter, with z-lab's parameter names and math.

GroupedDynamicCausalConv: around attention and around the MLP of every layer, a causal convolution over the
block's positions whose kernel is a learned base per offset plus a per-token kernel projected from the hidden
state, shared by each group of `group_size` channels. It never reaches across a block: serving runs it over
one block [anchor, MASK ...] (z-lab's loop pads before the block's first token with zeros), and training lays
N blocks end to end, so each block is convolved on its own, with the same zero padding.

CandidateSelector: the drafter's top-k tokens at each block position re-ranked by a low-rank score
predecessor_codebook[prev] * hidden_projection(h) . successor_codebook[candidate], added to the candidate's
logit, so a position depends on the token drafted before it (the anchor for the first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import race, temperature_probs


def block_causal_conv(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                      block_size: int) -> torch.Tensor:
    """hidden [b, L, H] (blocks of block_size end to end, or one block of L <= block_size positions),
    dynamic [b, L, K, G] per-token kernels, base [K, H] -> [b, L, H]."""
    b, length, hidden_size = hidden.shape
    span = min(block_size, length)
    if length % span:
        raise ValueError(f"{length} positions are not whole blocks of {block_size}")
    groups = hidden_size // group_size
    blocks = hidden.view(b, length // span, span, groups, group_size)
    dynamic = dynamic.view(b, length // span, span, base.shape[0], groups, 1)
    output = torch.zeros_like(blocks)
    for offset in range(min(base.shape[0], span)):  # an offset past the block sees only padding
        values = blocks if offset == 0 else F.pad(blocks[:, :, :-offset], (0, 0, 0, 0, offset, 0))
        # z-lab's order of operations (base, then the dynamic part), so the two agree to the last bit in fp32.
        output = output + base[offset].view(groups, group_size).to(hidden.dtype) * values
        output = torch.addcmul(output, dynamic[:, :, :, offset], values)
    return output.view(b, length, hidden_size)


class GroupedDynamicCausalConv(nn.Module):
    """z-lab's module: base_kernel [2, K, H] (input side, output side), kernel_projection H -> 2*K*G.

    prepare convolves the sublayer's input and returns the output side's per-token kernels (projected from the
    same input); finish convolves the sublayer's output with them."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset_parameters(self) -> None:
        """The identity (speculators' initialisation): a new DFlash 2 drafter starts as a DFlash one."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.groups)
        out = block_causal_conv(hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, self.block_size)
        return out, dynamic[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return block_causal_conv(hidden, dynamic, self.base_kernel[1], self.group_size, self.block_size)


class CandidateSelector(nn.Module):
    """The codebooks are bare parameters, as speculators saves them (z-lab's loader maps them onto its
    embeddings); the selector needs the target's full vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if top_k > vocab_size:
            raise ValueError(f"selector_top_k {top_k} exceeds the target's vocabulary ({vocab_size} tokens)")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self, std: float) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, mean=0.0, std=std)

    def forward(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Transition scores [..., k]: hidden [..., H], predecessors [...], candidates [..., k] token ids. Called
        as a module so that a sharded selector (FSDP) gathers its weights first."""
        context = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        return torch.einsum("...r,...kr->...k", context, F.embedding(candidates, self.successor_codebook))

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
               temperature: torch.Tensor | None = None,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The path through the block, as z-lab's select: hidden [b, n, H] and logits [b, n, V] of the drafted
        positions, anchors [b] -> (tokens [b, n], q). Greedy (temperature None): each position's best-scored
        candidate, q None. Sampled (a 0-dim temperature > 0, Exp(1) noise [b, n, V]): each position's candidate
        drawn from q = softmax(scores / T) over its k candidates (by the exponential race on the candidates'
        noise), given the token drawn before it; q [b, n, V] is that softmax, zero off the candidates: what
        the acceptance rule divides by, as z-lab's loop does."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        predecessor, path, q_rows = anchors, [], []
        for position in range(hidden.shape[1]):
            scores = unary[:, position] + torch.einsum(
                "br,bkr->bk", F.embedding(predecessor, self.predecessor_codebook) * projected[:, position],
                F.embedding(candidates[:, position], self.successor_codebook))
            if temperature is None:
                index = scores.argmax(-1, keepdim=True)
            else:
                q = temperature_probs(scores, temperature)
                index = race(q, noise[:, position].gather(-1, candidates[:, position])).unsqueeze(-1)
                q_rows.append(q)
            predecessor = candidates[:, position].gather(-1, index)[:, 0]
            path.append(predecessor)
        tokens = torch.stack(path, dim=1)
        if temperature is None:
            return tokens, None
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return tokens, q.scatter_(-1, candidates, torch.stack(q_rows, dim=1))
