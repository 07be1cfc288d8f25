"""The compile step for each drafter kind (DFlash, DFlash 2, DSpark).

Its probe is the kind's whole step: the layers (DFlash 2's convolutions inside them), DFlash 2's selector CE over
the unary top-k, DSpark's Markov-biased mixture and confidence BCE, and the target's final hidden states where the
loss reads them (DFlash 2 with its KL, DSpark with its TV); it changes no weight and no optimizer state. With the
layers compiled, every bucket's graphs exist before step 1: the steps after it compile nothing and train the
eager step's losses, and a shape the compile step missed raises instead of running eagerly.

On CPUs the layers compile with SDPA (flex_attention has no backward there); tests/test_kinds_gpu.py runs the
same helpers on a GPU with flex_attention.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dflash_trainer.compile.guard import compile_counters, leave_run_phase
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.loss import Objective
from dflash_trainer.model.optim import MasterWeightAdamW
from dflash_trainer.run.compile_step import compile_drafter_step
from dflash_trainer.run.step import DrafterStep
from transformers import Qwen3Config

# the shape of tests/conftest.py's tiny target, so a GPU session's trainer runs hit these graphs in the cache
TARGET = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MICRO_BATCH, NUM_ANCHORS, BLOCK = 4, 8, 8
# each kind with the loss its authors train it with
KINDS = {
    "dflash": ({}, None),
    "dflash2": ({"selector_rank": 16, "selector_top_k": 8}, Objective(ce=0.0, kl=1.0)),
    "dspark": ({"markov_rank": 16}, Objective(ce=0.1, tv=0.9)),
}


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    leave_run_phase()
    torch._dynamo.reset()
    yield
    leave_run_phase()
    torch._dynamo.reset()


def kind_step(kind: str, device, backend: str, compiled_layers: bool, dtype=torch.float32) -> DrafterStep:
    """A new drafter of `kind` with its step: borrowed random embedding and head, the kind's objective."""
    extra, objective = KINDS[kind]
    config = drafter_config(TARGET, DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=3, kind=kind, **extra))
    drafter = DFlashDrafter.initialised(config, device, seed=0).to(dtype)
    g = torch.Generator().manual_seed(1)
    embed = (torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g) * 0.5).to(device, dtype)
    head = (torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g) * 0.2).to(device, dtype)
    optimizer = MasterWeightAdamW(drafter.parameters(), lr=3e-3)
    return DrafterStep(drafter, embed, head, optimizer, num_anchors=NUM_ANCHORS, gamma=4.0, chunk_rows=48,
                       backend=backend, compiled_layers=compiled_layers, vocab_size=TARGET.vocab_size,
                       objective=objective, selector_loss_weight=0.5, confidence_loss_weight=0.5)


def train_steps(step: DrafterStep, lengths: list[int]) -> list[float]:
    """One optimizer step per context length, on seeded random micro-batches: each step's normalised loss."""
    device, dtype = step.embed_weight.device, step.drafter.fc.weight.dtype
    feat_dim = step.drafter.fc.in_features
    with_final = step.objective is not None and step.objective.needs_target
    losses = []
    for i, ctx_len in enumerate(lengths):
        g = torch.Generator().manual_seed(10 + i)
        ids = torch.randint(TARGET.vocab_size, (MICRO_BATCH, ctx_len), generator=g).to(device)
        loss_mask = (torch.rand(MICRO_BATCH, ctx_len, generator=g) < 0.8).to(device, torch.uint8)
        features = torch.randn(MICRO_BATCH, ctx_len, feat_dim, generator=g).to(device, dtype)
        final = torch.randn(MICRO_BATCH, ctx_len, TARGET.hidden_size, generator=g).to(device, dtype) \
            if with_final else None
        anchors = torch.Generator(device=device).manual_seed(i)
        sums = step.forward_backward(ids, loss_mask, features, anchors, target_hidden=final)
        step.optimizer_step(1.0 / sums.weight.clamp(min=1e-6))
        losses.append((sums.weighted_loss / sums.weight).item())
    return losses


def compile_and_train(kind: str, device, backend: str, compiled_layers: bool, buckets: list[int], cache_dir,
                      dtype=torch.float32) -> dict:
    """The compile step over `buckets`, then a training step at each: what the compile step reported, whether
    it left the weights and the optimizer as they were, the losses, and the graphs compiled after it."""
    step = kind_step(kind, device, backend, compiled_layers, dtype)
    weights = copy.deepcopy(step.drafter.state_dict())
    lines: list[str] = []
    report = compile_drafter_step(step, buckets, MICRO_BATCH, cache_dir, lines.append)
    untouched = (all(torch.equal(w, step.drafter.state_dict()[k]) for k, w in weights.items())
                 and not step.optimizer.opt.state and all(p.grad is None for p in step.drafter.parameters()))
    before = compile_counters()
    losses = train_steps(step, buckets)
    after = compile_counters()
    return {"step": step, "report": report, "log": lines, "untouched": untouched, "losses": losses,
            "graphs_after": after["unique_graphs"] - before["unique_graphs"]}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_compile_steps_probe_runs_each_kinds_whole_step_and_changes_nothing(kind, tmp_path):
    """Eager layers (SDPA): the probe's forward and backward reach every parameter the kind trains, then its
    gradients are dropped; the training steps after it are the steps of a drafter that never saw the probe."""
    got = compile_and_train(kind, "cpu", "sdpa", False, [32, 48], tmp_path)
    assert got["untouched"] and got["report"].variant_s.keys() == {"32", "48"}
    assert all(math.isfinite(x) for x in got["losses"])
    fresh = kind_step(kind, "cpu", "sdpa", False)
    assert train_steps(fresh, [32, 48]) == got["losses"]
    names = {"dflash2": "candidate_selector.", "dspark": "markov_head."}
    if kind in names:  # the kind's own parameters learned in those steps
        moved = [n for n, p in got["step"].drafter.named_parameters()
                 if n.startswith(names[kind]) and not torch.equal(p, kind_step(kind, "cpu", "sdpa", False)
                                                                  .drafter.get_parameter(n))]
        assert moved, f"no {names[kind]} parameter moved"


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kinds_compiled_layers_cover_every_bucket_and_a_missed_shape_raises(kind, tmp_path):
    """Layers compiled (Inductor, SDPA on a CPU), and with them the loss's KL / TV mixture (DFlash 2's KL, DSpark's
    TV over its Markov-biased logits, as on GPUs): no graph break, every bucket compiled before step 1, the mixture
    in one graph, the steps after it compile nothing and train the eager losses; a context length the compile step
    missed raises."""
    from dflash_trainer.model.loss import mixture_rows_and_grad
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    got = compile_and_train(kind, "cpu", "sdpa", True, [32, 48], tmp_path)
    report = got["report"]
    assert report.counters["graph_breaks"] == 0 and report.graph_break_reasons == [], report.graph_break_reasons
    assert report.counters["unique_graphs"] >= 2 and got["graphs_after"] == 0, (report.counters, got["graphs_after"])
    mixture_graphs = len(_debug_get_cache_entry_list(mixture_rows_and_grad.__code__))
    assert mixture_graphs == (0 if KINDS[kind][1] is None else 1), mixture_graphs
    assert got["untouched"]
    eager = train_steps(kind_step(kind, "cpu", "sdpa", False), [32, 48])
    assert got["losses"] == pytest.approx(eager, rel=1e-4)
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        train_steps(got["step"], [40])
