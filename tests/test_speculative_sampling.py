"""Speculative sampling at a temperature > 0 (decoding/speculative.py, decoding/fast.py): lossless (the tokens are
distributed as the target's own sampling, checked against the exact distribution of the first positions on a
tiny target, and a broken acceptance rule fails the same check), seeded and reproducible, the fast loop equal to
the reference loop at batch 1, and greedy at temperature 0 as before; for DFlash, DFlash 2 and DSpark drafters."""

import math

import pytest
import torch
from dflash_trainer.decoding import speculative
from dflash_trainer.decoding.fast import FastDecoding
from dflash_trainer.decoding.speculative import Sampling, greedy_generate, speculative_generate
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.target.frozen import FrozenTarget
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 24
PROMPT = [3, 17, 5, 9]
SAMPLES = 1500
POSITIONS = 3  # the first generated tokens checked: the prefill's, then a verify step's drafts and its next token


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    """A target peaked enough that its distributions differ clearly from the drafters' near-uniform ones: one
    for the module (the same for every drafter kind, and the target-only checks run once, not once per kind)."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.3,
                         attn_implementation="sdpa")
    return FrozenTarget(Qwen3ForCausalLM(config).eval(), [0, 2])


@pytest.fixture(scope="module", params=["dflash", "dflash2", "dspark"])
def tiny(request, target):
    """The target and a drafter of each kind (DFlash 2: its selector samples along the block from its top 6
    candidates, its codebooks large enough that the predecessor moves the draws; DSpark: its Markov bias along
    the block, as large)."""
    torch.manual_seed(1)
    selector = ({"selector_rank": 8, "selector_top_k": 6} if request.param == "dflash2"
                else {"markov_rank": 8} if request.param == "dspark" else {})
    drafter = DFlashDrafter(drafter_config(target.model.config, DrafterShape(
        num_layers=1, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2], kind=request.param,
        **selector))).eval()
    if drafter.candidate_selector is not None:
        with torch.no_grad():
            drafter.candidate_selector.reset_parameters(1.0)
    if drafter.markov_head is not None:
        with torch.no_grad():
            drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
            drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
    return target, drafter


def exact_marginals(target: FrozenTarget, temperature: float) -> list[torch.Tensor]:
    """P(token at generated position k), k = 1..POSITIONS, of the target's own sampling: every prefix enumerated."""
    marginals, prefixes, weights = [], torch.tensor([PROMPT]), torch.ones(1)
    with torch.no_grad():
        for _ in range(POSITIONS):
            probs = torch.softmax(target.model(prefixes).logits[:, -1].double() / temperature, -1)  # [n, V]
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(prefixes))[:, None]],
                                 1)
            weights = joint.reshape(-1)
    return marginals


def chi_square_excess(observed: list[int], expected: torch.Tensor) -> float:
    """Pearson's statistic over its 99.9% quantile (Wilson-Hilferty); cells expecting under 5 are pooled."""
    e = expected * sum(observed)
    o = torch.tensor(observed, dtype=torch.float64)
    small = e < 5
    cells_e = torch.cat([e[~small], e[small].sum().reshape(1)]) if small.any() else e
    cells_o = torch.cat([o[~small], o[small].sum().reshape(1)]) if small.any() else o
    keep = cells_e > 0
    stat = float(((cells_o[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum())
    df = int(keep.sum()) - 1
    quantile = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat / quantile


def sampled_positions(tokens_per_run: list[list[int]]) -> list[list[int]]:
    counts = [[0] * VOCAB for _ in range(POSITIONS)]
    for tokens in tokens_per_run:
        for k in range(POSITIONS):
            counts[k][tokens[len(PROMPT) + k]] += 1
    return counts


def speculative_samples(target, drafter, temperature: float, seed: int) -> list[list[int]]:
    loops = FastDecoding(target, drafter, batch_size=SAMPLES)  # one row per sample, each its own noise
    results = loops.speculative([PROMPT] * SAMPLES, POSITIONS + 1, sampling=Sampling(temperature, seed, "cpu"))
    return [r.tokens for r in results]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_speculative_sampling_is_distributed_as_the_targets_own_sampling(tiny, temperature):
    target, drafter = tiny
    exact = exact_marginals(target, temperature)
    runs = speculative_samples(target, drafter, temperature, seed=11)
    for k, counts in enumerate(sampled_positions(runs)):
        assert chi_square_excess(counts, exact[k]) < 1, f"position {k + 1}: {counts} vs {exact[k].tolist()}"


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_target_only_baseline_samples_the_same_distribution(target, temperature):
    exact = exact_marginals(target, temperature)
    own = FastDecoding(target, None, batch_size=SAMPLES).greedy([PROMPT] * SAMPLES, POSITIONS,
                                                                 sampling=Sampling(temperature, 12, "cpu"))
    for k, counts in enumerate(sampled_positions(own)):
        assert chi_square_excess(counts, exact[k]) < 1, f"target-only, position {k + 1}"


def test_a_broken_acceptance_rule_fails_the_same_check(tiny, monkeypatch):
    target, drafter = tiny
    exact = exact_marginals(target, 1.0)
    monkeypatch.setattr(speculative, "accept_draft", lambda p, q, u: torch.ones_like(p, dtype=torch.bool))
    counts = sampled_positions(speculative_samples(target, drafter, 1.0, seed=11))
    assert chi_square_excess(counts[0], exact[0]) < 1  # the prefill's token does not go through the rule
    assert chi_square_excess(counts[1], exact[1]) > 3 and chi_square_excess(counts[2], exact[2]) > 3


SEEDED_PROMPTS = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9], [20]]


def test_sampling_is_seeded_and_the_fast_loop_equals_the_reference_at_batch_one(tiny):
    target, drafter = tiny
    prompts = SEEDED_PROMPTS
    for temperature in (1.0, 0.7):
        fast = FastDecoding(target, drafter, batch_size=1).speculative(prompts, 24,
                                                                       sampling=Sampling(temperature, 5, "cpu"))
        sampling = Sampling(temperature, 5, "cpu")  # one generator over the prompts, as the fast loop draws
        reference = [speculative_generate(drafter, target, p, 24, sampling=sampling) for p in prompts]
        assert [r.tokens for r in fast] == [r.tokens for r in reference]
        assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in reference]
        again = FastDecoding(target, drafter, batch_size=1).speculative(prompts, 24,
                                                                        sampling=Sampling(temperature, 5, "cpu"))
        assert [r.tokens for r in again] == [r.tokens for r in fast]
        other = FastDecoding(target, drafter, batch_size=1).speculative(prompts, 24,
                                                                        sampling=Sampling(temperature, 6, "cpu"))
        assert [r.tokens for r in other] != [r.tokens for r in fast]  # the seed matters
    steps = [n for r in fast for n in r.accept_lengths]
    assert max(steps) > 1 and min(steps) == 1  # drafts were accepted and rejected


def test_target_only_sampling_is_seeded_and_the_fast_loop_equals_the_reference_at_batch_one(target):
    for temperature in (1.0, 0.7):
        own = FastDecoding(target, None, batch_size=1).greedy(SEEDED_PROMPTS, 24,
                                                               sampling=Sampling(temperature, 5, "cpu"))
        sampling = Sampling(temperature, 5, "cpu")
        assert own == [greedy_generate(target, p, 24, sampling=sampling) for p in SEEDED_PROMPTS]


def test_temperature_zero_is_greedy_and_sampling_refuses_it(tiny):
    target, drafter = tiny
    prompts = [PROMPT, [20, 1]]
    loops = FastDecoding(target, drafter, batch_size=2)
    greedy = [greedy_generate(target, p, 16) for p in prompts]
    assert [r.tokens for r in loops.speculative(prompts, 16)] == greedy
    with pytest.raises(ValueError, match="temperature > 0"):
        Sampling(0.0, 0, "cpu")
