"""DSpark's two heads beside a DFlash drafter, with speculators' parameter names and math (speculators 0.9:
models/dspark/model_definitions.py), so that its DSparkDraftModel loads the weights as they are.

MarkovHead: a low-rank logit bias markov_w2(markov_w1[previous token]) added to each block position's logits,
so a position depends on the token drafted before it (the anchor for the first drafted position). Three
variants: vanilla (that bias), gated (the previous token's embedding gated by the position's hidden state) and
rnn (a recurrent state carried along the block).

ConfidenceHead: a linear map of the position's (normalised) hidden state, and the Markov embedding of its
previous token, to one logit: the predicted chance that the target accepts the position's draft.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, head_type: str = "vanilla"):
        super().__init__()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {head_type!r} is not one of {MARKOV_HEAD_TYPES}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":  # [gate; candidate; output] from [state; previous token; hidden]
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def reset_parameters(self) -> None:
        """speculators' initialisation of the embedding (std 0.01); the linear maps are the drafter's."""
        nn.init.normal_(self.markov_w1.weight, std=0.01)

    def step(self, previous: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: previous [...] token ids, hidden [..., H] -> (the bias's low-rank code [..., r], the
        rnn's next state); the bias itself is markov_w2 of the code."""
        embedding = self.markov_w1(previous.long())
        if self.head_type == "vanilla":
            return embedding, None
        hidden = hidden.to(embedding.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, embedding], dim=-1))) * embedding, None
        if state is None:
            state = embedding.new_zeros(embedding.shape)
        gate, candidate, out = self.joint_proj(torch.cat([state, embedding, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(candidate)

    def block_codes(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Every position of blocks laid along dim -2 at once: previous [N, B], hidden [N, B, H] -> [N, B, r]
        (teacher-forced: the true previous tokens, as speculators trains)."""
        if self.head_type != "rnn":
            return self.step(previous, hidden)[0]
        state, codes = None, []
        for k in range(previous.shape[1]):
            code, state = self.step(previous[:, k], hidden[:, k], state)
            codes.append(code)
        return torch.stack(codes, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)
