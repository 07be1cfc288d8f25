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


def regenerate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch_size: int = 32,
               stop_token: str | None = None) -> list[dict]:
    """Rows {input_ids, loss_mask} answering each conversation's last user turn, greedily."""
    eos = tokenizer.convert_tokens_to_ids(stop_token) if stop_token else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = []
    for messages in conversations:
        upto = max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
        text = tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    answers = generate_batched(model, prompts, max_new_tokens, pad, eos, batch_size)
    return [{"input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a)} for p, a in zip(prompts, answers)]
