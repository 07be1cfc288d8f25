"""Drawing tokens at a temperature, as the decoding loops and the drafter's propose draw them.

A token is drawn from probabilities pr as argmax(pr / E), E ~ Exp(1) per token (the exponential race, as
vLLM draws: the index has probability pr, unnormalised pr works alike), so each draw is a fixed-shape tensor
of noise that a CUDA graph can read."""

from __future__ import annotations

import torch


def temperature_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) in fp32, T a 0-dim fp32 tensor (the fast loop's recorded step reads it from a buffer,
    so one recording serves every temperature)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` (unnormalised is fine), drawn by the exponential race with Exp(1) noise."""
    return (probs / noise).argmax(-1)
