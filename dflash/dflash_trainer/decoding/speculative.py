"""Greedy speculative decoding against the target, target-only greedy decoding, and acceptance statistics.

The one decoding loop that the trainer's tau (run/evaluate.py) and `dflash-eval` (eval/cli.py) share; it is
z-lab's `dflash_generate` at temperature 0, step for step (a DFlash 2 drafter's candidate selector included). Each verify step: the drafter fills a block
[anchor, MASK x (B-1)] from the fused target features of every verified token; the target checks the
B tokens in one forward; the agreeing prefix plus the target's bonus token are kept. The acceptance
length of a step is the number of tokens it adds (accepted + 1, at most B; less when the token limit or
a stop token cuts the step short, as z-lab counts it). The target keeps a KV cache; the drafter keeps
its fused context (fc + hidden_norm, computed once per token) and recomputes the layers' K/V from it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..data.rows import DataError
from ..model.drafter import DFlashDrafter
from ..model.objective import sdpa_attention
from ..target.frozen import FrozenTarget


@dataclass
class SpecResult:
    tokens: list[int]  # the prompt, then the generated tokens
    accept_lengths: list[int] = field(default_factory=list)  # tokens added by each verify step



def cache_argument(model) -> str:
    """transformers >= 5.2x calls the cache argument `cache` (`past_key_values` warns, and goes in 5.40);
    earlier 5.x `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

def stop_token_ids(model, tokenizer, stop_tokens: list[str] | None = None) -> list[int]:
    """The tokens that end an answer, in order: `stop_tokens` (--stop-token) when given, else the target's
    generation-config EOS ids, then the tokenizer's EOS (Qwen3: <|im_end|> and <|endoftext|>). `model` is the
    target, or only its GenerationConfig (or None) when its weights are not loaded."""
    if stop_tokens:
        ids = []
        for token in stop_tokens:
            tid = tokenizer.convert_tokens_to_ids(token)
            if tid is None or tid == tokenizer.unk_token_id:
                raise DataError(f"--stop-token {token!r} is not a token of the target's tokenizer: give one of its "
                                "tokens (e.g. its end-of-turn token)")
            ids.append(tid)
        return ids
    config = getattr(model, "generation_config", model)
    eos = getattr(config, "eos_token_id", None)
    found = []
    for tid in ([eos] if isinstance(eos, int) else list(eos or [])) + [getattr(tokenizer, "eos_token_id", None)]:
        if tid is not None and int(tid) not in found:
            found.append(int(tid))
    return found


def _crop(cache: DynamicCache, length: int) -> None:
    """Drop the rejected draft tokens from the target's cache (crop takes a negative count in 5.x). Called
    after every verify, as z-lab's loop does: on sliding-window layers crop(0) also trims the recorded past
    back to the window (_new_cache)."""
    cache.crop(-(cache.get_seq_length() - length))


def _new_cache(model, rollback: bool) -> DynamicCache:
    """The target's cache. rollback: recording the past of its sliding-window layers, so that a verify step
    can be rolled back on every layer type (transformers refuses to crop a sliding layer past its window
    otherwise)."""
    cache = DynamicCache(config=model.config)
    if rollback:
        cache.activate_past_recording()
    return cache


def _features(hidden_states, layer_ids) -> torch.Tensor:
    """Outputs of the tapped decoder layers (HF hidden_states[l + 1]), concatenated."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _prefill(model, prompt_ids: list[int], device, hidden: bool):
    """hidden: the speculative loop's prefill (hidden states, a cache that can be rolled back)."""
    if not prompt_ids:
        raise ValueError("empty prompt: a prompt needs at least one token")
    cache = _new_cache(model, rollback=hidden)
    out = model(torch.tensor([prompt_ids], device=device), **{cache_argument(model): cache}, use_cache=True,
                output_hidden_states=hidden, logits_to_keep=1)
    return cache, out


@torch.inference_mode()
def speculative_generate(
    drafter: DFlashDrafter,
    target: FrozenTarget,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: Iterable[int] = frozenset(),
) -> SpecResult:
    model, block, stop_ids = target.model, drafter.block_size, set(stop_ids)
    embed, head = target.embed_weight, target.head_weight
    device, dtype = embed.device, drafter.fc.weight.dtype
    cache, out = _prefill(model, prompt_ids, device, hidden=True)
    _crop(cache, len(prompt_ids))
    # The fused context of every verified token except the newest (its feature comes with the next verify).
    context = drafter.fuse(_features(out.hidden_states, drafter.target_layer_ids).to(dtype))
    seq = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    limit = len(prompt_ids) + max_new_tokens
    result = SpecResult(tokens=seq)
    attention = sdpa_attention(None)  # the block sees its whole context and itself
    while len(seq) < limit and seq[-1] not in stop_ids:
        start = len(seq) - 1  # the anchor: the last verified token
        size = min(block, limit - start)  # >= 2 inside the loop
        draft = torch.full((1, size), drafter.mask_token_id, device=device)
        draft[0, 0] = seq[start]
        pos = torch.arange(start + size, device=device).unsqueeze(0)
        hidden = drafter(None, F.embedding(draft, embed).to(dtype), pos, attention, context=context)
        draft[0, 1:] = drafter.propose(hidden[:, 1:], draft[:, 0], head)[0]
        out = model(draft, **{cache_argument(model): cache}, use_cache=True, output_hidden_states=True)
        posterior = out.logits[0].argmax(-1)
        accepted = int((draft[0, 1:] == posterior[:-1]).cumprod(0).sum())
        new = draft[0, 1 : accepted + 1].tolist() + [int(posterior[accepted])]
        stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        new = new[: limit - len(seq)]
        seq.extend(new)
        result.accept_lengths.append(len(new))
        verified = _features(out.hidden_states, drafter.target_layer_ids)[:, : accepted + 1]
        context = torch.cat([context, drafter.fuse(verified.to(dtype))], dim=1)
        _crop(cache, start + accepted + 1)
    return result


@torch.inference_mode()
def greedy_generate(target: FrozenTarget, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: Iterable[int] = frozenset()) -> list[int]:
    """Target-only greedy decoding, one token per forward: the reference speculative decoding must equal."""
    model, stop_ids = target.model, set(stop_ids)
    device = target.embed_weight.device
    cache, out = _prefill(model, prompt_ids, device, hidden=False)
    seq = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    limit = len(prompt_ids) + max_new_tokens
    while len(seq) < limit and seq[-1] not in stop_ids:
        out = model(torch.tensor([[seq[-1]]], device=device), **{cache_argument(model): cache}, use_cache=True)
        seq.append(int(out.logits[0, -1].argmax()))
    return seq


@dataclass
class AcceptanceStats:
    """Acceptance lengths of a set of requests, and the figures reported from them."""

    block_size: int
    per_request: list[list[int]] = field(default_factory=list)  # each request's acceptance lengths
    tokens: int = 0  # generated tokens (the prefill's first token included)

    def add(self, accept_lengths: list[int], new_tokens: int) -> None:
        self.per_request.append(list(accept_lengths))
        self.tokens += new_tokens

    @property
    def lengths(self) -> list[int]:
        return [n for r in self.per_request for n in r]

    @property
    def verify_steps(self) -> int:
        return len(self.lengths)

    @property
    def tau(self) -> float:
        """Mean over all verify steps of the tokens a step adds (accepted + 1): z-lab's paper tau."""
        lengths = self.lengths
        return sum(lengths) / max(1, len(lengths))

    @property
    def tau_per_request_mean(self) -> float:
        """Mean over requests of each request's mean acceptance length: what z-lab's benchmark prints."""
        means = [sum(r) / len(r) for r in self.per_request if r]
        return sum(means) / max(1, len(means))

    @property
    def slot_acceptance(self) -> list[float]:
        """P(draft slot k accepted), k = 1..B-1: the share of verify steps that kept slot k."""
        lengths, steps = self.lengths, max(1, self.verify_steps)
        return [sum(1 for n in lengths if n > k) / steps for k in range(1, self.block_size)]

    @property
    def length_counts(self) -> list[int]:
        """Verify steps per acceptance length; index = length (0..B, index 0 always 0, as z-lab prints it)."""
        counts = [0] * (self.block_size + 1)
        for n in self.lengths:
            counts[n] += 1
        return counts

    @property
    def length_histogram(self) -> list[float]:
        steps = max(1, self.verify_steps)
        return [c / steps for c in self.length_counts]

    def summary(self) -> str:
        return f"tau {self.tau:.2f} over {self.verify_steps} verify steps ({self.tokens} tokens)"
