"""Held out means held out: no evaluation prompt is also a training prompt.

Chat data repeats itself (the bundled corpus: 600 rows, 445 distinct, 304 distinct prompts), and a
split by row puts copies of training rows into the evaluation set, where the drafter has seen the
target's answer. So the split is over distinct prompts, and an evaluation set given apart from the
training set is checked against it. A row's prompt is its tokens before the first supervised one
(the rendered conversation up to the answer), so rows compare the way the drafter sees them.
"""

from __future__ import annotations

import hashlib
import json

import torch

from .prompts import prompt_messages
from .rows import DataError


def _key(input_ids, loss_mask) -> str:
    prompt = input_ids[: loss_mask.index(1)] if 1 in loss_mask else input_ids
    return hashlib.blake2b(json.dumps(prompt).encode(), digest_size=16).hexdigest()


def prompt_keys(ds) -> list[str]:
    """One key per tokenized row (input_ids + loss_mask): equal keys, equal prompts."""
    keyed = ds.map(lambda b: {"prompt_key": [_key(i, m) for i, m in zip(b["input_ids"], b["loss_mask"], strict=True)]},
                   batched=True, remove_columns=ds.column_names, desc="prompt keys")
    return keyed["prompt_key"]


def split_by_prompt(ds, seed: int, fraction: float = 0.1, most: int = 64):
    """(train, eval): eval holds one row for each of ~fraction of the distinct prompts (at most `most`),
    train every row whose prompt is not among them. Returns (train, eval, distinct prompts, rows dropped)."""
    keys = prompt_keys(ds)
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    distinct = list(first)
    if len(distinct) < 2:
        raise DataError(f"the training data holds {len(distinct)} distinct prompt(s): nothing can be held out "
                        "for evaluation. Add data, or give an evaluation set in data.eval")
    size = min(int(len(distinct) * fraction) or 1, most)
    order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(seed)).tolist()
    held = {distinct[j] for j in order[:size]}
    eval_rows = sorted(first[k] for k in held)
    train_rows = [i for i, k in enumerate(keys) if k not in held]
    return ds.select(train_rows), ds.select(eval_rows), len(distinct), len(keys) - len(train_rows) - size


def overlapping(train_ds, eval_ds) -> int:
    """How many evaluation rows have a prompt the training data also has."""
    seen = set(prompt_keys(train_ds))
    return sum(k in seen for k in prompt_keys(eval_ds))


def distinct_prompts(conversations: list[list[dict]]) -> list[list[dict]]:
    """The conversations with a prompt not seen before, in order (the first answer to a prompt is kept)."""
    seen, out = set(), []
    for messages in conversations:
        key = json.dumps(prompt_messages(messages), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(messages)
    return out
