"""The first regeneration path, kept as the benchmark's baseline: batches of 32 in input order, left-padded,
plain `model.generate` with its dynamic cache (README "Performance" compares the hf engine with it).
"""

from __future__ import annotations

import torch
from tqdm import tqdm


@torch.no_grad()
def generate_batched(model, prompts: list[list[int]], max_new_tokens: int, pad: int, eos: int | None,
                     batch_size: int = 32, min_new_tokens: int | None = None) -> list[list[int]]:
    """Answer token ids per prompt (cut after the first `eos`), `batch_size` prompts per `generate` call."""
    device = next(model.parameters()).device
    answers = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="regenerating with the target", leave=False):
        chunk = prompts[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        out = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad,
        )
        for i in range(len(chunk)):
            answer = out[i, width:].tolist()
            if eos is not None and eos in answer:
                answer = answer[: answer.index(eos) + 1]
            answers.append(answer)
    return answers

