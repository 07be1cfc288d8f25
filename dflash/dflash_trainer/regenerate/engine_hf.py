"""Engine `hf`: the target itself, in this process, through transformers' `generate`.

What makes it fast is the shape of the work, not a new decoder: prompts sorted by length are cut into
large batches sized to the GPU's free memory, left-padded to a length bucket, and decoded with a static
KV cache (one per batch shape, reused) so that on a GPU `generate` compiles the decode step once per
shape and replays it as a CUDA graph. Greedy answers equal `model.generate` on each prompt alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)

from ..data.rows import DataError
from ..decoding.buckets import bucket
from ..infra.hub import remote_code_hint
from .answers import Answer, Request, answer_from_ids
from .sampling import Sampling, SeededSampler


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes over all layers (keys and values)."""
    c = config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


class StopAsked(StoppingCriteria):
    """Ends `generate` at the next decode step once `should_stop()` is true (its answers are then dropped)."""

    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.should_stop(), dtype=torch.bool, device=input_ids.device)


class HFEngine:
    name = "hf"

    def __init__(self, model, tokenizer, sampling: Sampling, stop_ids: list[int], batch_size: int = 256,
                 prefill_tokens: int = 131072, memory_fraction: float = 0.6, compile: bool | None = None,
                 log=print):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.batch_size = batch_size
        self.prefill_tokens = prefill_tokens
        self.device = next(model.parameters()).device
        self.compiled = self.device.type == "cuda" if compile is None else compile
        self.pad = next(t for t in (getattr(tokenizer, "pad_token_id", None), *stop_ids, 0) if t is not None)
        # Only our settings: a checkpoint's generation_config.json (Qwen3: do_sample, top_k 20, ...) would
        # otherwise fill in what we leave unset.
        model.generation_config = GenerationConfig(pad_token_id=self.pad, eos_token_id=stop_ids or None)
        # transformers >= 5.2x calls the cache argument `cache`; earlier 5.x `past_key_values`
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._cache: tuple[tuple[int, int], StaticCache] | None = None
        self.kv_per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
        self.kv_budget = None
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            self.kv_budget = int(memory_fraction * free)
        self._announced: set[int] = set()
        self.log = log

    # -- batch shapes ------------------------------------------------------------------------------
    def rows_for(self, width: int) -> int:
        """Rows per batch at this prompt bucket: --batch-size, fewer when the KV cache or prefill would not fit."""
        length = width + self.sampling.max_new_tokens
        rows = min(self.batch_size, max(1, self.prefill_tokens // width))
        if self.kv_budget is not None:
            rows = min(rows, max(1, self.kv_budget // (length * self.kv_per_token)))
        return rows

    def batches(self, prompts: list[list[int]]) -> Iterator[list[int]]:
        """Indices into `prompts`, shortest first, in batches that share one bucket (the longest prompt's)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        start = 0
        while start < len(order):
            rows = self.batch_size
            while True:  # the batch's longest prompt picks the bucket, the bucket caps the rows
                end = min(start + rows, len(order))
                width = bucket(len(prompts[order[end - 1]]))
                if self.rows_for(width) >= end - start:
                    break
                rows = self.rows_for(width)
            yield order[start:end]
            start = end

    # -- generation --------------------------------------------------------------------------------
    def _static_cache(self, rows: int, length: int) -> StaticCache:
        """One static cache per batch shape, reset between batches (a new one would re-record CUDA graphs)."""
        if self._cache is None or self._cache[0] != (rows, length):
            self._cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._cache = ((rows, length), StaticCache(config=self.model.config, max_cache_len=length))
        else:
            self._cache[1].reset()
        return self._cache[1]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> list[list[int]]:
        """Answer token ids for one batch of prompts (cut after the first stop token). Once `should_stop()` is
        true the decoding ends at the next step: the answers are then cut short, for the caller to drop."""
        s = self.sampling
        width = bucket(max(map(len, prompts)))
        real = len(prompts)
        rows = self.rows_for(width) if self.compiled else real  # a compiled step keeps one batch shape
        if rows > real:
            prompts = prompts + [prompts[0]] * (rows - real)
            seeds = None if seeds is None else seeds + [seeds[0]] * (rows - real)
        if width not in self._announced and self.compiled:
            self._announced.add(width)
            self.log(f"hf engine: prompts up to {width} tokens run {rows} at a time "
                     f"(static cache of {width + s.max_new_tokens} tokens; the first batch compiles)")
        ids = torch.full((rows, width), self.pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        processors = LogitsProcessorList()
        if not s.greedy:
            processors.append(SeededSampler(seeds, width, s.temperature, s.top_p))
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
            generation_config=GenerationConfig(
                max_new_tokens=s.max_new_tokens, min_new_tokens=s.max_new_tokens if s.ignore_eos else None,
                do_sample=False, eos_token_id=self.stop_ids or None, pad_token_id=self.pad,
                disable_compile=not self.compiled),
            logits_processor=processors, **{self._cache_arg: self._static_cache(rows, width + s.max_new_tokens)},
            **({"stopping_criteria": StoppingCriteriaList([StopAsked(should_stop)])} if should_stop else {}),
        )
        answers = []
        for row in out[:real, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
            answers.append(row if cut is None or s.ignore_eos else row[: cut + 1])
        return answers

    def answer(self, requests: list[Request], should_stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[Request, Answer]]:
        """Answers batch by batch; once `should_stop()` is true, the batch being decoded is dropped and no
        other starts."""
        prompts = [r.prompt for r in requests]
        for batch in self.batches(prompts):
            if should_stop is not None and should_stop():
                return
            got = self.generate([prompts[i] for i in batch], [requests[i].seed for i in batch], should_stop)
            if should_stop is not None and should_stop():  # cut short: not the answers the target would give
                return
            for i, ids in zip(batch, got):
                yield requests[i], answer_from_ids(self.tokenizer, ids, self.stop_ids)


def load_target(path: str, device: torch.device, dtype: str = "auto", trust_remote_code: bool = False):
    """The target for engine hf: bf16 on a GPU, fp32 on the CPU unless --dtype says otherwise."""
    from transformers import AutoModelForCausalLM

    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                     trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:  # no weights beside the tokenizer, a model class transformers lacks
        hint = remote_code_hint(exc, "--trust-remote-code")
        raise DataError(f"--target {path}: cannot load the model ({exc}){hint}; give the target model's directory "
                        "(config.json, tokenizer files, weights), or use --engine openai with a tokenizer only") from exc
    return model.to(device).eval()
