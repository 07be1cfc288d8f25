"""Speculative decoding against the target (greedy, or sampled at a temperature), target-only decoding, and
acceptance statistics.

The one decoding loop that the trainer's tau (run/evaluate.py) and `dflash-eval` (eval/cli.py) share; it is
z-lab's `dflash_generate`, step for step (top-p and top-k off; a DFlash 2 drafter's candidate selector
included). Each verify step: the drafter fills a block
[anchor, MASK x (B-1)] from the fused target features of every verified token; the target checks the
B tokens in one forward; the agreeing prefix plus the target's bonus token are kept. The acceptance
length of a step is the number of tokens it adds (accepted + 1, at most B; less when the token limit or
a stop token cuts the step short, as z-lab counts it). The target keeps a KV cache; the drafter keeps
its fused context (fc + hidden_norm, computed once per token) and recomputes the layers' K/V from it.

At a temperature > 0 (`Sampling`) the step is speculative sampling (Leviathan et al. 2023, Chen et al. 2023),
as z-lab's loop and vLLM's rejection sampler run it: the drafter samples each slot from its softmax q at the
temperature (one pass fills the block, so q of slot k is the drafter's at slot k; a DFlash 2 drafter's
selector samples along the block as z-lab's does, each slot from the softmax at T of its top-k candidates'
scores given the token drawn before it, and q is that softmax, zero off the candidates); draft x is accepted when
u * q(x) < p(x), u uniform in [0, 1), p the target's softmax at the same temperature; the first rejected slot
is replaced by a sample of norm(max(0, p - q)), and a block accepted whole gets a bonus token sampled from p.
The output is distributed as the target's own sampling. Every random draw comes from one seeded
torch.Generator, in a fixed order and shape per step (`Sampling`), so a run is reproducible and the fast loop
(decoding/fast.py) at batch 1 consumes the same numbers as this one.
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
from ..model.sampling import race, temperature_probs
from ..target.frozen import FrozenTarget


class Sampling:
    """Sampling at `temperature` (> 0) from one seeded generator. A token is drawn by the exponential race
    (model/sampling.py: argmax(pr / E), E ~ Exp(1) per token), so each draw is a fixed-shape tensor of noise
    that a CUDA graph can read. Per prefill:
    Exp noise [b, V]; per verify step: Exp noise [b, B-1, V] (the drafts), uniforms [b, B-1] (acceptance),
    Exp noise [b, V] (the replacement or bonus token); per target-only step: Exp noise [b, V]."""

    def __init__(self, temperature: float, seed: int, device):
        if not temperature > 0:
            raise ValueError(f"temperature {temperature}: sampling needs a temperature > 0 (0 decodes greedily)")
        self.temperature, self.seed = float(temperature), int(seed)
        self.generator = torch.Generator(device=device).manual_seed(self.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return temperature_probs(logits, torch.full((), self.temperature, device=logits.device))

    def exponential_(self, out: torch.Tensor) -> torch.Tensor:
        # An Exp(1) draw of exactly 0 would make pr / E infinite (or NaN where pr = 0): the smallest float instead.
        return out.exponential_(generator=self.generator).clamp_min_(torch.finfo(out.dtype).tiny)

    def uniform_(self, out: torch.Tensor) -> torch.Tensor:
        return out.uniform_(generator=self.generator)

    def noise(self, *shape: int, device) -> torch.Tensor:
        return self.exponential_(torch.empty(shape, device=device))


def accept_draft(p_draft: torch.Tensor, q_draft: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Whether each draft token x is accepted: u * q(x) < p(x), i.e. with probability min(1, p(x) / q(x))."""
    return uniforms * q_draft < p_draft


def rejection_sample(draft_probs: torch.Tensor, target_probs: torch.Tensor, drafts: torch.Tensor,
                     uniforms: torch.Tensor, noise: torch.Tensor, drafted: torch.Tensor | None = None):
    """One verify step's speculative sampling for b rows of D draft slots: (accepted [b], next token [b]).

    draft_probs [b, D, V] (q), target_probs [b, D + 1, V] (p, the last for the bonus), drafts [b, D], uniforms
    [b, D], noise [b, V]; drafted [b]: slots that hold a draft (a block cut at the token limit has fewer; None:
    all D). The next token replaces the first rejected draft (a sample of max(0, p - q), or of p where that is
    all 0, as z-lab's loop falls back), or is the bonus sampled from p after a block accepted whole."""
    d = drafts.shape[1]
    pick = drafts.unsqueeze(-1)
    ok = accept_draft(target_probs[:, :d].gather(-1, pick)[..., 0], draft_probs.gather(-1, pick)[..., 0], uniforms)
    slots = torch.arange(d, device=drafts.device)
    if drafted is not None:
        ok = ok & (slots < drafted[:, None])
    accepted = ok.long().cumprod(1).sum(1)
    vocab = target_probs.shape[-1]
    p_next = target_probs.gather(1, accepted.view(-1, 1, 1).expand(-1, 1, vocab))[:, 0]
    q_next = draft_probs.gather(1, accepted.clamp(max=d - 1).view(-1, 1, 1).expand(-1, 1, vocab))[:, 0]
    rejected = accepted < (d if drafted is None else drafted)
    residual = (p_next - q_next).clamp_min(0)
    use_residual = rejected[:, None] & (residual.sum(-1, keepdim=True) > 0)
    return accepted, race(torch.where(use_residual, residual, p_next), noise)


@dataclass
class SpecResult:
    tokens: list[int]  # the prompt, then the generated tokens
    accept_lengths: list[int] = field(default_factory=list)  # tokens added by each verify step
    # DSpark: each verify step's (predicted acceptance of every drafted slot, drafts accepted)
    confidence: list[tuple[list[float], int]] = field(default_factory=list)



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
    sampling: Sampling | None = None,
) -> SpecResult:
    """sampling: speculative sampling at its temperature; None: greedy."""
    model, block, stop_ids = target.model, drafter.block_size, set(stop_ids)
    embed, head = target.embed_weight, target.head_weight
    device, dtype = embed.device, drafter.fc.weight.dtype
    cache, out = _prefill(model, prompt_ids, device, hidden=True)
    _crop(cache, len(prompt_ids))
    # The fused context of every verified token except the newest (its feature comes with the next verify).
    context = drafter.fuse(_features(out.hidden_states, drafter.target_layer_ids).to(dtype))
    seq = list(prompt_ids) + [_next_token(out.logits[:, -1], sampling)]
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
        temperature = noise = uniforms = final_noise = None
        if sampling is not None:  # the step's draws at full block shape whatever the cut, as the fast loop draws them
            draft_noise = sampling.noise(1, block - 1, head.shape[0], device=device)
            uniforms = sampling.uniform_(torch.empty(1, block - 1, device=device))
            final_noise = sampling.noise(1, head.shape[0], device=device)
            noise = draft_noise[:, : size - 1]
            temperature = torch.full((), sampling.temperature, device=device)
        drafts, draft_probs = drafter.propose(hidden[:, 1:], draft[:, 0], head, temperature, noise)
        draft[0, 1:] = drafts[0]
        predicted = drafter.predicted_acceptance(hidden[:, 1:], draft[:, 0], drafts)
        out = model(draft, **{cache_argument(model): cache}, use_cache=True, output_hidden_states=True)
        if sampling is None:
            posterior = out.logits[0].argmax(-1)
            accepted = int((draft[0, 1:] == posterior[:-1]).cumprod(0).sum())
            following = int(posterior[accepted])
        else:
            accepted_t, token = rejection_sample(draft_probs, sampling.probs(out.logits), draft[:, 1:],
                                                 uniforms[:, : size - 1], final_noise)
            accepted, following = int(accepted_t[0]), int(token[0])
        if predicted is not None:
            result.confidence.append((predicted[0].tolist(), accepted))
        new = draft[0, 1 : accepted + 1].tolist() + [following]
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


def _next_token(logits: torch.Tensor, sampling: Sampling | None) -> int:
    """The target's next token from its [1, V] logits: the argmax, or a sample at the temperature."""
    if sampling is None:
        return int(logits[0].argmax())
    return int(race(sampling.probs(logits), sampling.noise(1, logits.shape[-1], device=logits.device))[0])


@torch.inference_mode()
def greedy_generate(target: FrozenTarget, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: Iterable[int] = frozenset(), sampling: Sampling | None = None) -> list[int]:
    """Target-only decoding, one token per forward: greedy (the reference speculative decoding must equal), or
    sampled at sampling's temperature (what speculative sampling must match in distribution)."""
    model, stop_ids = target.model, set(stop_ids)
    device = target.embed_weight.device
    cache, out = _prefill(model, prompt_ids, device, hidden=False)
    seq = list(prompt_ids) + [_next_token(out.logits[:, -1], sampling)]
    limit = len(prompt_ids) + max_new_tokens
    while len(seq) < limit and seq[-1] not in stop_ids:
        out = model(torch.tensor([[seq[-1]]], device=device), **{cache_argument(model): cache}, use_cache=True)
        seq.append(_next_token(out.logits[:, -1], sampling))
    return seq


@dataclass
class AcceptanceStats:
    """Acceptance lengths of a set of requests, and the figures reported from them."""

    block_size: int
    per_request: list[list[int]] = field(default_factory=list)  # each request's acceptance lengths
    tokens: int = 0  # generated tokens (the prefill's first token included)

    # DSpark: every verify step's (predicted acceptance of each drafted slot, drafts accepted)
    confidence: list[tuple[list[float], int]] = field(default_factory=list)

    def add(self, accept_lengths: list[int], new_tokens: int,
            confidence: list[tuple[list[float], int]] | None = None) -> None:
        self.per_request.append(list(accept_lengths))
        self.tokens += new_tokens
        self.confidence += confidence or []

    @property
    def confidence_calibration(self) -> dict | None:
        """DSpark's confidence head against what happened, per draft slot k = 1..B-1, over the verify steps that
        reached slot k (every slot before it accepted): the mean predicted acceptance, the measured share
        accepted, and the steps; None without a confidence head."""
        if not self.confidence:
            return None
        slots = self.block_size - 1
        reached, kept, predicted = [0] * slots, [0] * slots, [0.0] * slots
        for chances, accepted in self.confidence:
            for k in range(min(len(chances), accepted + 1)):  # slots 1..accepted+1 (0-based k) were reached
                reached[k] += 1
                predicted[k] += chances[k]
                kept[k] += k < accepted
        share = lambda total, n: total / n if n else None
        return {"predicted": [share(p, n) for p, n in zip(predicted, reached, strict=True)],
                "measured": [share(a, n) for a, n in zip(kept, reached, strict=True)], "reached": reached}

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
