"""The production training step against an independent eager reference, from the same weights, micro-batches
and anchors: the first step's loss and every parameter's gradient, then the per-step losses and the weights
over 20 steps.

Production: step.DrafterStep as train.py builds it (on a GPU: flex_attention with mask.dflash_block_mask,
the layers compiled by the compile step, the chunked loss with its Triton CE kernel, MasterWeightAdamW's
one-pass update over fp32 masters of bf16 parameters; on a CPU: the sdpa backend, the chunked loss with more
chunks than one, the one-pass update run eagerly), with the clip and the step's grad scale folded into it.
Reference, written here: the drafter's modules in fp32, mask.dense_mask through F.scaled_dot_product_attention,
one weighted cross-entropy over every block slot (anchors.build_blocks' weights, normalised by their sum),
torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW with its own warmup-cosine schedule. It shares with the
production step only the drafter's modules and the anchor / mask definitions, so a gradient the GPU paths drop,
scale or mask wrongly shows as a gap here while every CPU test of those paths on their own passes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from dflash_trainer.config import TrainConfig
from dflash_trainer.distributed.sources import FeatureBatch, Wait
from dflash_trainer.model.anchors import build_blocks, default_gamma, sample_anchors
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.mask import dense_mask
from dflash_trainer.model.optim import MasterWeightAdamW, warmup_cosine
from dflash_trainer.run.step import DrafterStep
from transformers import Qwen3Config

STEPS = 20
WARMUP = 2  # steps of linear warmup before the cosine decay


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    block: int
    vocab: int
    batch: int
    ctx_len: int
    anchors: int
    intermediate: int
    tokens_used: int  # the data draws its tokens from this many ids (skewed): a distribution 20 steps learn


# Gemma 3 270M's attention (hidden 640, 4 heads, 1 KV head, head_dim 256) and vocabulary, a 3-layer drafter.
GEMMA_270M = Shape(hidden=640, heads=4, kv_heads=1, head_dim=256, layers=3, block=16, vocab=262_144, batch=2,
                   ctx_len=1024, anchors=128, intermediate=2048, tokens_used=64)
TINY = Shape(hidden=64, heads=4, kv_heads=1, head_dim=16, layers=2, block=8, vocab=512, batch=2, ctx_len=48,
             anchors=6, intermediate=128, tokens_used=16)


def make_drafter(shape: Shape, device) -> DFlashDrafter:
    target = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=18, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=max(2048, 2 * shape.ctx_len))
    config = drafter_config(target, DrafterShape(num_layers=shape.layers, block_size=shape.block, mask_token_id=3))
    return DFlashDrafter.initialised(config, device, seed=0)


def make_batches(shape: Shape, feat_dim: int, device, dtype, count: int = 4) -> list[FeatureBatch]:
    """`count` micro-batches, cycled over the steps (so the drafter can learn them). Row 0's loss mask ends
    early: it has fewer valid anchor positions than anchors, so the step meets padding blocks too."""
    g = torch.Generator().manual_seed(1)
    skew = 0.7 ** torch.arange(shape.tokens_used, dtype=torch.float64)
    feature_table = torch.randn(shape.tokens_used, feat_dim, generator=g)
    batches = []
    for index in range(count):
        # A skewed unigram over a few ids: the first steps visibly learn it (a vacuous check otherwise).
        ids = torch.multinomial(skew, shape.batch * shape.ctx_len, replacement=True, generator=g)
        ids = ids.view(shape.batch, shape.ctx_len) + 16
        loss_mask = torch.zeros(shape.batch, shape.ctx_len, dtype=torch.uint8)
        loss_mask[:, shape.ctx_len // 8:] = 1  # a prompt, then the answer
        loss_mask[0, shape.ctx_len // 8 + shape.anchors // 2:] = 0  # row 0: a short answer, then padding
        features = feature_table[ids - 16]  # the target's features say which token sits where
        batches.append(FeatureBatch(features.to(device, dtype), ids.to(device), loss_mask.to(device),
                                    int(loss_mask.sum()), index, Wait.host(0.0, torch.device(device))))
    return batches


def anchor_generator(device, index: int) -> torch.Generator:
    """The anchors of micro-batch `index`: the same seed gives the same anchors to both sides."""
    return torch.Generator(device=device).manual_seed(1000 + index)


# --- the reference -------------------------------------------------------------------------------------------


def reference_attention(mask: torch.Tensor):
    """SDPA over the dense boolean mask. A padding block's rows see no key: they attend to key 0 instead (SDPA
    gives NaN for an empty row, which a where() would hide in the forward but not in the backward) and output 0."""
    empty = ~mask.any(-1, keepdim=True)
    first_key = torch.zeros_like(mask)
    first_key[..., 0] = True
    safe = mask | (empty & first_key)

    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, enable_gqa=True)
        return out.masked_fill(empty, 0.0)

    return attend


def reference_loss(model: DFlashDrafter, embed, head, batch: FeatureBatch, device, block: int,
                   num_anchors: int) -> torch.Tensor:
    """(sum(w * CE), sum(w)) over every block slot, the logits in full, in fp32."""
    anchors, keep = sample_anchors(batch.loss_mask, num_anchors, anchor_generator(device, batch.index))
    blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block, model.mask_token_id,
                          default_gamma(block))
    b, ctx_len = batch.input_ids.shape
    positions = torch.cat([torch.arange(ctx_len, device=device).expand(b, -1), blocks.position_ids], dim=1)
    attend = reference_attention(dense_mask(anchors, keep, block, ctx_len))
    hidden = model(batch.features.float(), F.embedding(blocks.token_ids, embed), positions, attend)
    logits = hidden @ head.T
    if model.output_multiplier != 1.0:
        logits = logits * model.output_multiplier
    if model.final_logit_softcapping:
        logits = torch.tanh(logits / model.final_logit_softcapping) * model.final_logit_softcapping
    ce = F.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), reduction="none")
    weights = blocks.weights.flatten()
    return (ce * weights).sum(), weights.sum()


def reference_lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


# --- the comparison ------------------------------------------------------------------------------------------


class Reference:
    """The drafter's modules in fp32 from the production drafter's initial weights, trained eagerly: the loss
    over every slot normalised by the step's total weight, torch's clip and torch's AdamW, its own schedule."""

    def __init__(self, drafter: DFlashDrafter, embed, head, shape: Shape, device, train: TrainConfig):
        self.model = copy.deepcopy(drafter).float()  # the same initial weights (rounded to dtype), in fp32
        self.params = dict(self.model.named_parameters())
        self.init = {n: p.detach().clone() for n, p in self.params.items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                                     weight_decay=train.weight_decay, eps=1e-8)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: reference_lr_factor(s, STEPS, WARMUP))
        self.embed, self.head = embed.float(), head.float()
        self.shape, self.device, self.max_grad_norm = shape, device, train.max_grad_norm

    def step(self, micro_batches: list[FeatureBatch]) -> tuple[float, float, dict[str, torch.Tensor]]:
        """(the step's loss, the gradient norm before the clip, each parameter's gradient before the clip)."""
        self.opt.zero_grad(set_to_none=True)
        sums = [reference_loss(self.model, self.embed, self.head, mb, self.device, self.shape.block,
                               self.shape.anchors) for mb in micro_batches]
        loss = sum(s for s, _ in sums) / sum(w for _, w in sums)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in self.params.items()}
        norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.max_grad_norm)
        self.opt.step()
        self.sched.step()
        return loss.item(), norm.item(), grads


def production_step(shape: Shape, drafter, embed, head, device: str, dtype, *, backend: str, compiled: bool,
                    chunk_rows: int, one_pass: bool | None, train: TrainConfig) -> DrafterStep:
    """DrafterStep with MasterWeightAdamW and the warmup-cosine schedule, as train.py builds them; on a GPU,
    compiled by the compile step."""
    optimizer = MasterWeightAdamW(drafter.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                  betas=(train.adam_beta1, train.adam_beta2), max_grad_norm=train.max_grad_norm,
                                  one_pass=one_pass)
    scheduler = warmup_cosine(optimizer.opt, STEPS, WARMUP, 0.0)
    step = DrafterStep(drafter, embed, head, optimizer, num_anchors=shape.anchors, gamma=None, chunk_rows=chunk_rows,
                       backend=backend, compiled_layers=compiled, vocab_size=shape.vocab, scheduler=scheduler)
    if device == "cuda":
        assert optimizer.one_pass == (dtype != torch.float32), "the GPU trainer's optimizer path"
        compile_production_step(step, shape)
    return step


def check_first_step(step: DrafterStep, reference: Reference, first: FeatureBatch, device,
                     tol: dict) -> tuple[float, float]:
    """Step 1, unrolled as DrafterStep.run runs it for one rank and one micro-batch, to read the gradients:
    the loss, the gradient norm and every parameter's gradient against the reference's. Returns both losses."""
    sums = step.forward_backward(first.input_ids, first.loss_mask, first.features, anchor_generator(device, 0))
    weight = sums.weight.float()
    loss = (sums.weighted_loss / weight).item()
    grads = {n: p.grad.float() / weight for n, p in step.drafter.named_parameters()}
    norm = step.optimizer_step(1.0 / weight.clamp(min=1e-6)).item()
    ref_loss, ref_norm, ref_grads = reference.step([first])
    assert set(grads) == set(ref_grads)
    assert loss == pytest.approx(ref_loss, rel=tol["loss"]), "step 1's loss"
    assert norm == pytest.approx(ref_norm, rel=tol["norm"]), "step 1's gradient norm (before the clip)"
    gaps = []
    for name, ref in ref_grads.items():
        cos = F.cosine_similarity(grads[name].flatten(), ref.flatten(), dim=0).item()
        ratio = (grads[name].norm() / ref.norm()).item()
        if cos < tol["cos"] or abs(ratio - 1) > tol["grad_norm"]:
            gaps.append(f"{name}: cosine {cos:.5f}, norm ratio {ratio:.4f}")
    assert not gaps, "step 1's gradients differ:\n" + "\n".join(gaps)
    return loss, ref_loss


def check_parity(shape: Shape, device: str, dtype: torch.dtype, *, backend: str, compiled: bool, chunk_rows: int,
                 one_pass: bool | None, tol: dict, grad_accum: int = 2) -> None:
    torch.manual_seed(0)
    train = TrainConfig()  # the trainer's defaults: lr, betas, weight decay, clip
    drafter = make_drafter(shape, device).to(dtype)
    g = torch.Generator().manual_seed(2)
    embed = (torch.randn(shape.vocab, shape.hidden, generator=g) * 0.02).to(device, dtype)
    head = (torch.randn(shape.vocab, shape.hidden, generator=g) * 0.02).to(device, dtype)
    batches = make_batches(shape, len(drafter.target_layer_ids) * shape.hidden, device, dtype)
    reference = Reference(drafter, embed, head, shape, device, train)
    step = production_step(shape, drafter, embed, head, device, dtype, backend=backend, compiled=compiled,
                           chunk_rows=chunk_rows, one_pass=one_pass, train=train)
    losses = [check_first_step(step, reference, batches[0], device, tol)]

    # Steps 2..20: DrafterStep.run itself over grad_accum micro-batches, the reference beside it on the same
    # micro-batches and anchors.
    for i in range(1, STEPS):
        indices = range(i * grad_accum, (i + 1) * grad_accum)
        micro = [batches[k % len(batches)] for k in indices]
        micro = [FeatureBatch(b.features, b.input_ids, b.loss_mask, b.tokens, k, b.wait) for b, k in zip(micro, indices)]
        result = step.run(iter(micro), grad_accum, generator_for=lambda index: anchor_generator(device, index))
        losses.append((result.read().loss, reference.step(micro)[0]))
    table = "\n".join(f"step {i + 1}: production {p:.4f}, reference {r:.4f}" for i, (p, r) in enumerate(losses))
    ref_losses = [r for _, r in losses]
    assert sum(ref_losses[-5:]) / 5 < ref_losses[0] * 0.95, "the reference learned nothing: a vacuous check\n" + table
    assert max(abs(p - r) / r for p, r in losses) < tol["losses"], "the per-step losses part\n" + table

    # The weights: what each side's 20 updates moved them by (fp32 masters against the reference's fp32).
    masters = dict(zip([n for n, _ in drafter.named_parameters()], step.optimizer.master))
    moved = torch.cat([(masters[n].detach().float() - reference.init[n]).flatten() for n in reference.params])
    ref_moved = torch.cat([(p.detach() - reference.init[n]).flatten() for n, p in reference.params.items()])
    cos = F.cosine_similarity(moved, ref_moved, dim=0).item()
    ratio = (moved.norm() / ref_moved.norm()).item()
    assert cos > tol["weights_cos"] and abs(ratio - 1) < tol["weights_norm"], (
        f"the weights part after {STEPS} steps: cosine of the updates {cos:.4f}, norm ratio {ratio:.4f}\n" + table)


def compile_production_step(step: DrafterStep, shape: Shape) -> None:
    """The compile step as train.py runs it (compile_step.compile_drafter_step), for the one bucket used here,
    with the trainer's default compile cache (a second run of the test compiles warm)."""
    from dflash_trainer.compile.guard import leave_run_phase
    from dflash_trainer.run.compile_step import compile_cache_dir, compile_drafter_step

    leave_run_phase()  # a previous test's compile step left fail_on_recompile on
    compile_drafter_step(step, [shape.ctx_len], shape.batch, compile_cache_dir(None), log=print)


# --- CPU: the production pieces that run here ----------------------------------------------------------------

CPU_TOL_FP32 = {"loss": 1e-4, "norm": 1e-3, "cos": 0.9999, "grad_norm": 1e-3, "losses": 1e-3,
                "weights_cos": 0.999, "weights_norm": 0.01}
BF16_TOL = {"loss": 0.02, "norm": 0.03, "cos": 0.99, "grad_norm": 0.04, "losses": 0.05,
            "weights_cos": 0.9, "weights_norm": 0.1}


def test_cpu_fp32_step_with_chunked_loss_equals_the_reference():
    """fp32 parameters, the sdpa backend, the loss in chunks of 5 rows (not a divisor of the 84 scored rows),
    torch's AdamW on the masters: what a CPU run trains with, against the reference, tightly."""
    check_parity(TINY, "cpu", torch.float32, backend="sdpa", compiled=False, chunk_rows=5, one_pass=None,
                 tol=CPU_TOL_FP32)


def test_cpu_bf16_step_with_the_one_pass_update_equals_the_reference():
    """bf16 parameters with fp32 masters and the one-pass update run eagerly (the GPU's update, uncompiled),
    the clip and the grad scale folded into it, against the fp32 reference within bf16's precision."""
    check_parity(TINY, "cpu", torch.bfloat16, backend="sdpa", compiled=False, chunk_rows=5, one_pass=True,
                 tol=BF16_TOL)


def test_the_comparison_catches_a_mask_that_shows_a_hidden_key(monkeypatch):
    """The production step's mask, not the reference's, lets every query see the context one past its anchor
    (the anchor's own target feature, which serving does not have yet): the gradients part at step 1."""
    from dflash_trainer.model import objective

    def leaky(anchors, keep, block_size, ctx_len):
        mask = dense_mask(anchors, keep, block_size, ctx_len)
        rows = torch.arange(mask.shape[2]) // block_size
        at_anchor = anchors.gather(1, rows.expand(anchors.shape[0], -1))  # [b, Q]
        leak = torch.nn.functional.one_hot(at_anchor, mask.shape[3]).bool() & keep.gather(
            1, rows.expand(anchors.shape[0], -1)).unsqueeze(-1)
        return mask | leak.unsqueeze(1)

    monkeypatch.setattr(objective, "dense_mask", leaky)
    with pytest.raises(AssertionError, match="step 1's"):
        check_parity(TINY, "cpu", torch.float32, backend="sdpa", compiled=False, chunk_rows=5, one_pass=None,
                     tol=CPU_TOL_FP32)


def test_the_comparison_catches_a_dropped_loss_chunk(monkeypatch):
    """The chunked loss loses the gradient of its first chunk (the loss itself intact): the gradients part."""
    from dflash_trainer.model import loss

    calls = []
    real = loss.ce_rows_and_grad

    def dropping(logits, labels, weights, with_grad):
        ce, grad, hit = real(logits, labels, weights, with_grad)
        calls.append(1)
        return ce, (grad * 0 if grad is not None and len(calls) == 1 else grad), hit

    monkeypatch.setattr(loss, "ce_rows_and_grad", dropping)
    with pytest.raises(AssertionError, match="step 1.s gradient"):
        check_parity(TINY, "cpu", torch.float32, backend="sdpa", compiled=False, chunk_rows=5, one_pass=None,
                     tol=CPU_TOL_FP32)


def test_block_mask_tables_at_the_gpu_shape_equal_torchs_own():
    """The hand-built BlockMask the GPU step attends with, at GEMMA_270M's shape (16 query tiles, 24 key tiles,
    a row with padding blocks), holds the tiles create_block_mask derives from the mask's definition: the
    forward's KV-direction tables and the backward's Q-direction ones, partial and full, in counts and indices,
    each contiguous as torch's own."""
    from dflash_trainer.model.mask import dflash_block_mask, dflash_mask_mod
    from torch.nn.attention.flex_attention import create_block_mask

    shape = GEMMA_270M
    batch = make_batches(shape, 1, "cpu", torch.float32, count=1)[0]
    anchors, keep = sample_anchors(batch.loss_mask, shape.anchors, anchor_generator("cpu", 0))
    assert not keep[0].all() and keep[1].all()
    q_len, kv_len = shape.anchors * shape.block, shape.ctx_len + shape.anchors * shape.block
    built = dflash_block_mask(anchors, keep, shape.block, shape.ctx_len)
    derived = create_block_mask(dflash_mask_mod(anchors, keep, shape.block, shape.ctx_len), shape.batch, None,
                                q_len, kv_len, device="cpu")
    assert built.seq_lengths == derived.seq_lengths == (q_len, kv_len)

    def tiles(mask, counts: str, indices: str) -> list[list[set[int]]]:
        n, idx = getattr(mask, counts), getattr(mask, indices)
        return [[set(idx[b, 0, r, :n[b, 0, r]].tolist()) for r in range(n.shape[-1])] for b in range(n.shape[0])]

    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        assert torch.equal(getattr(built, counts), getattr(derived, counts)), counts
        assert tiles(built, counts, indices) == tiles(derived, counts, indices), indices
        # Laid out as torch lays them out: flex's Triton kernels read each index row with stride 1, whatever the
        # tensor's stride says (transposed Q tables gave wrong dK and dV on GPUs, with the forward and dQ exact).
        for name in (counts, indices):
            table = getattr(built, name)
            assert table.is_contiguous() and table.stride() == getattr(derived, name).stride(), (
                f"{name} has strides {table.stride()}, torch's {getattr(derived, name).stride()}")


@pytest.fixture
def default_compiler_stance():
    """The compile step leaves fail_on_recompile on: give the next test the default stance back."""
    from dflash_trainer.compile.guard import leave_run_phase

    yield
    leave_run_phase()


# --- GPU: the production step as the trainer builds it ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_production_step_equals_the_reference(default_compiler_stance):
    """Everything the GPU trainer runs: bf16 parameters, compiled layers with flex_attention and the hand-built
    BlockMask, the chunked loss (2,048 rows a chunk, the default, over 3,840 scored rows: a partial last chunk)
    with its Triton kernel, the compiled one-pass update over fp32 masters."""
    check_parity(GEMMA_270M, "cuda", torch.bfloat16, backend="flex", compiled=True,
                 chunk_rows=TrainConfig().loss_chunk_rows, one_pass=None, tol=BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp32_flex_compiled_chunked_step_equals_the_reference(default_compiler_stance):
    """The same GPU paths in fp32 (flex + BlockMask, compiled layers, chunked Triton CE; torch's fused AdamW on
    fp32 parameters): no bf16 noise, so a masking or scaling error cannot hide in the tolerance."""
    tight = {"loss": 2e-3, "norm": 5e-3, "cos": 0.9995, "grad_norm": 5e-3, "losses": 5e-3,
             "weights_cos": 0.99, "weights_norm": 0.03}
    check_parity(GEMMA_270M, "cuda", torch.float32, backend="flex", compiled=True, chunk_rows=1000, one_pass=None,
                 tol=tight)
