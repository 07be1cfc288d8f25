"""Real speculative decoding against the target (greedy), reporting acceptance length tau.

Each verify step: the drafter fills a block [anchor, MASK x (B-1)] from the target features of
every verified token; the target checks the B tokens in one forward; the agreeing prefix plus
the target's bonus token are kept. tau = mean(accepted + 1) per verify step, as z-lab reports it
(at most B). The target keeps a KV cache; the drafter recomputes its context each step, which is
exact and cheap at evaluation sizes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .loading import DTYPES, console, new_drafter
from .model import DFlashDrafter
from .objective import drafter_loss, prepare_micro_batch, sdpa_attention
from .target import FrozenTarget


@dataclass
class SpecResult:
    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)


def _crop(cache: DynamicCache, length: int) -> None:
    """Drop the rejected draft tokens from the target's cache (crop takes a negative count in 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _features(hidden_states, layer_ids):
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def speculative_generate(
    drafter: DFlashDrafter,
    target: FrozenTarget,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int] = frozenset(),
) -> SpecResult:
    model, block = target.model, drafter.block_size
    device = target.embed_weight.device
    ids = torch.tensor([prompt_ids], device=device)
    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    feats = _features(out.hidden_states, drafter.target_layer_ids)
    seq = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    limit = len(prompt_ids) + max_new_tokens
    result = SpecResult(tokens=seq)
    attention = sdpa_attention(None)  # the block sees its whole context and itself
    while len(seq) < limit and seq[-1] not in stop_ids:
        start = len(seq) - 1  # the anchor: the last verified token, whose feature is not known yet
        size = min(block, limit - start)
        draft = torch.full((1, size), drafter.mask_token_id, device=device)
        draft[0, 0] = seq[start]
        if size > 1:
            pos = torch.arange(start + size, device=device).unsqueeze(0)
            hidden = drafter(feats[:, :start].to(drafter.fc.weight.dtype),
                             F.embedding(draft, target.embed_weight), pos, attention)
            draft[0, 1:] = F.linear(hidden[0, 1:], target.head_weight).argmax(-1)
        out = model(draft, past_key_values=cache, use_cache=True, output_hidden_states=True)
        posterior = out.logits[0].argmax(-1)
        accepted = int((draft[0, 1:] == posterior[:-1]).cumprod(0).sum())
        new = draft[0, 1 : accepted + 1].tolist() + [int(posterior[accepted])]
        stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        new = new[: limit - len(seq)]
        seq.extend(new)
        result.accept_lengths.append(len(new))
        feats = torch.cat([feats, _features(out.hidden_states, drafter.target_layer_ids)[:, : accepted + 1]], 1)
        _crop(cache, start + accepted + 1)
    return result


@dataclass
class SpecEval:
    tau: float  # mean(accepted + 1) per verify step
    verify_steps: int
    tokens: int
    slot_acceptance: list[float]  # P(slot k accepted) for k = 1..B-1

    def summary(self) -> str:
        return f"tau {self.tau:.2f} over {self.verify_steps} verify steps ({self.tokens} tokens)"


def evaluate_tau(drafter, target, prompts: list[list[int]], max_new_tokens: int, stop_ids=frozenset()) -> SpecEval:
    was_training = drafter.training
    drafter.eval()
    # transformers 5.2x renames past_key_values to cache with a FutureWarning; both work.
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    lengths: list[int] = []
    tokens = 0
    for prompt in prompts:
        r = speculative_generate(drafter, target, prompt, max_new_tokens, set(stop_ids))
        lengths += r.accept_lengths
        tokens += len(r.tokens) - len(prompt)
    drafter.train(was_training)
    steps = max(1, len(lengths))
    slot = [sum(1 for n in lengths if n - 1 >= k) / steps for k in range(1, drafter.block_size)]
    return SpecEval(sum(lengths) / steps, len(lengths), tokens, slot)


# ---- evaluation during and after training (where the target is) ----------------------------------
@torch.no_grad()
def teacher_forced_accuracy(cfg, drafter, target, eval_stream, batches: int = 4) -> list[float]:
    """Per-slot accuracy on held-out data, the training objective's view (no target in the loop)."""
    block, device = drafter.block_size, target.embed_weight.device
    correct = torch.zeros(block, device=device)
    count = torch.zeros(block, device=device)
    g = torch.Generator(device=device).manual_seed(cfg.train.seed + 7)
    for i in range(min(batches, eval_stream.per_epoch)):
        batch = eval_stream.batch(i).to(device)
        feats = target.features(batch.input_ids, batch.attention_mask).to(drafter.fc.weight.dtype)
        # The dense reference: no compiled variant is needed for this no-grad pass.
        mb = prepare_micro_batch(batch.input_ids, batch.loss_mask, cfg.train.num_anchors, drafter.config,
                                 drafter.mask_token_id, None, "sdpa", g)
        sums = drafter_loss(drafter, target.embed_weight, target.head_weight, feats, mb.blocks, mb.attention)
        correct += sums.slot_correct
        count += sums.slot_count
    return (correct[1:] / count[1:].clamp(min=1)).tolist()


def evaluate(cfg, drafter, target, tokenizer, eval_stream, prompts, label: str) -> dict:
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    spec = evaluate_tau(drafter, target, prompts, cfg.eval.max_new_tokens, stop)
    acc = teacher_forced_accuracy(cfg, drafter, target, eval_stream) if eval_stream is not None else []
    console.print(f"[bold]{label}[/]: {spec.summary()}; per-slot accuracy " + " ".join(f"{a:.2f}" for a in acc))
    return {"tau": spec.tau, "verify_steps": spec.verify_steps, "slot_acceptance": spec.slot_acceptance,
            "slot_accuracy": acc}


def evaluate_saved(cfg, target, tokenizer, eval_stream, prompts, drafter_dir: Path, device) -> tuple[dict, dict]:
    """tau of the initial drafter (same seed, rebuilt) and of the trained one saved in drafter_dir."""
    dtype = DTYPES[cfg.train.dtype]
    initial = new_drafter(cfg, target.config, tokenizer, device=device).to(dtype=dtype)  # as the run built it
    before = evaluate(cfg, initial, target, tokenizer, eval_stream, prompts, "before training")
    trained = DFlashDrafter.from_pretrained(drafter_dir).to(device=device, dtype=dtype)
    after = evaluate(cfg, trained, target, tokenizer, eval_stream, prompts, "after training")
    return before, after
