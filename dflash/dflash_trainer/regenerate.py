"""Regenerate assistant turns with the target itself (greedy), as the DFlash recipe does.

A drafter learns to predict *its target's* continuation; training on answers another model
wrote teaches it the wrong distribution. Output rows are pre-tokenized: `input_ids` = prompt
rendered by the chat template + the target's answer, `loss_mask` = 1 on the answer.
"""

from __future__ import annotations

import torch
from tqdm import tqdm


@torch.no_grad()
def regenerate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch_size: int = 32,
               stop_token: str | None = None) -> list[dict]:
    eos = tokenizer.convert_tokens_to_ids(stop_token) if stop_token else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = []
    for messages in conversations:
        upto = max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
        text = tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    device = next(model.parameters()).device
    rows = []
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
            do_sample=False, eos_token_id=eos, pad_token_id=pad,
        )
        for i, p in enumerate(chunk):
            answer = out[i, width:].tolist()
            if eos in answer:
                answer = answer[: answer.index(eos) + 1]
            rows.append({"input_ids": p + answer, "loss_mask": [0] * len(p) + [1] * len(answer)})
    return rows
