"""Answers that fall into a loop: a base model's greedy answer often ends repeating a few tokens until the
token limit, and any drafter predicts such a loop almost perfectly (9-10 tokens per step), lifting the mean.
The benchmark reports the share of such answers and tau with them left out.

The rule: an answer loops when its last `window` tokens repeat with a period of at most `window // 2` tokens
(so the repeated span is seen at least twice, token for token). Greedy decoding that enters a cycle stays in it,
so a looping answer ends that way; one that ends on its stop token before the window fills does not."""

from __future__ import annotations

WINDOW = 48


def loops(output_ids: list[int], window: int = WINDOW) -> bool:
    tail = output_ids[-window:]
    if len(tail) < window:
        return False
    return any(all(tail[i] == tail[i + p] for i in range(window - p)) for p in range(1, window // 2 + 1))
