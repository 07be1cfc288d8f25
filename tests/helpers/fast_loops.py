"""The fast decoding loops against the reference loops, on a GPU: the shared check of the GPU test files."""

from __future__ import annotations

import torch
from dflash_trainer.decoding.fast import FastDecoding
from dflash_trainer.decoding.speculative import greedy_generate, speculative_generate

NEW = 40  # tokens decoded per prompt


def random_prompts(vocab: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


def replayed_greedy_equals_the_reference(target, drafter, prompts, batches):
    """For each batch size: the speculative step recorded as a CUDA graph, its tokens and acceptance lengths the
    reference loop's, its tokens target-only greedy's. (the loops by batch size, the greedy tokens)."""
    reference = [speculative_generate(drafter, target, p, NEW) for p in prompts]
    greedy = [greedy_generate(target, p, NEW) for p in prompts]
    kept = {}
    for batch in batches:
        loops = FastDecoding(target, drafter, batch)
        fast = loops.speculative(prompts, NEW)
        assert loops._decoders[True, False][1].spec_step.graph is not None  # replayed, not run eagerly
        assert [r.tokens for r in fast] == [r.tokens for r in reference] == greedy
        assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in reference]
        kept[batch] = loops
    return kept, greedy
