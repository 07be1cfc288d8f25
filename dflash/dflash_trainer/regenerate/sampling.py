"""How answers are drawn: greedy by default; with a temperature, sampled from a stream of its own per prompt.

Each prompt's random numbers are a hash of (seed, prompt key, turn, step, token id), not draws from a
global generator: an answer does not depend on which other prompts shared its batch, on how many GPUs
took part, or on where a resumed run restarted. The draw is the Gumbel-max trick (argmax of logits/T
plus Gumbel noise samples softmax(logits/T) exactly), so `generate` runs greedy on the processed scores.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch
from transformers import LogitsProcessor

M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """Everything that decides an answer besides the prompt: part of every answer's resume key."""

    max_new_tokens: int = 2048
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    turns: str = "last"  # "last": the final answer only; "all": every assistant turn, in order
    ignore_eos: bool = False  # run every answer to max_new_tokens (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict:
        return asdict(self)

    def problems(self) -> list[str]:
        out = []
        if self.max_new_tokens < 1:
            out.append(f"--max-new-tokens {self.max_new_tokens}: give at least 1")
        if self.temperature < 0:
            out.append(f"--temperature {self.temperature}: use 0 (greedy) or a positive temperature")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p {self.top_p}: use a value in (0, 1]")
        if self.turns not in ("last", "all"):
            out.append(f"--turns {self.turns!r}: use last or all")
        return out


def row_seed(seed: int, key: str, turn: int) -> int:
    """The 31-bit seed of one answer: a function of the run's seed, the prompt's key and the turn only."""
    digest = hashlib.sha256(f"{seed}:{key}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors; products wrap, and only their low 32 bits count."""
    h = h & M32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & M32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & M32
    return h ^ (h >> 16)


def uniforms(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1), a pure function of (row seed, step, token id): the same on any device."""
    base = _mix32(seeds.to(torch.int64) * 0x9E3779B1 + step)
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix32(_mix32(base[:, None] ^ tokens[None, :]) + 0x632BE5AB)
    return ((h >> 8).to(torch.float32) + 0.5) / 2**24


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with every token outside the top-p nucleus at -inf (the most likely token always stays)."""
    if top_p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mass_before = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draw(logits: torch.Tensor, seeds: torch.Tensor, step: int, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row, distributed as softmax(logits / temperature) restricted to the top-p nucleus."""
    scores = nucleus(logits.float() / temperature, top_p)
    gumbel = -torch.log(-torch.log(uniforms(seeds, step, logits.shape[-1])))
    return (scores + gumbel).argmax(dim=-1)


class SeededSampler(LogitsProcessor):
    """A `generate` logits processor: the drawn token keeps score 0, every other -inf (greedy then picks it)."""

    def __init__(self, seeds: list[int], prompt_width: int, temperature: float, top_p: float):
        self.seeds = torch.tensor(seeds, dtype=torch.int64)
        self.width = prompt_width
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        seeds = self.seeds.to(scores.device)
        chosen = draw(scores, seeds, step, self.temperature, self.top_p)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, chosen[:, None], 0.0)
