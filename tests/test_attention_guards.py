"""The compile guards of dflash_trainer.model.attention raise when they should, and the compiled path is exact.

CPU only (flex has no CPU backward through 2.13, so these run forward; grad mode is covered by a GPU
test). One compiled flex graph per process, shared by the tests through the Inductor disk cache.
"""

from __future__ import annotations

import threading
import unittest
import warnings

import pytest
import torch
import torch.nn.functional as F
from dflash_trainer.compile.guard import compile_variants, leave_run_phase
from dflash_trainer.model import attention
from dflash_trainer.model.attention import (
    CompileRaceError,
    DenseFallbackError,
    RecompileError,
    attend,
    dense_risk,
    dense_scores_bytes,
    install_dense_guards,
)
from torch.nn.attention.flex_attention import flex_attention

from tests.helpers.attention import causal_block_mask, fused_memory_probe, remove_dense_guards

L, H, D = 128, 2, 16


def qkv(length=L, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, length, D, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def reset_compile_state():
    if hasattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag"):
        torch.fx._symbolic_trace._is_fx_tracing_flag = False
    leave_run_phase()
    remove_dense_guards()
    torch._dynamo.reset()


class GuardTest(unittest.TestCase):
    def setUp(self):
        reset_compile_state()

    def tearDown(self):
        reset_compile_state()

    def test_fx_trace_in_same_thread_raises_compile_race(self):
        q, k, v = qkv()
        mask = causal_block_mask(L, "cpu")

        def traced(x):  # symbolic_trace holds the FX flag while this body runs
            attend(q, k, v, mask)
            return x

        with self.assertRaisesRegex(CompileRaceError, "FX trace is active"):
            torch.fx.symbolic_trace(traced)

    @pytest.mark.skipif(
        not hasattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag"),
        reason="torch >= 2.14 keeps the FX flag per thread: another thread's trace is invisible",
    )
    def test_fx_trace_in_another_thread_raises_compile_race(self):
        # The race: thread A traces, thread B enters a compiled call meanwhile.
        q, k, v = qkv()
        mask = causal_block_mask(L, "cpu")
        entered, release = threading.Event(), threading.Event()

        def slow(x):
            entered.set()
            release.wait(30)
            return x

        tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(slow,))
        tracer.start()
        try:
            self.assertTrue(entered.wait(30))
            with self.assertRaisesRegex(CompileRaceError, "process-global"):
                attend(q, k, v, mask)
        finally:
            release.set()
            tracer.join(30)
        self.assertFalse(attention.fx_tracing_active())

    def test_eager_flex_call_raises_after_install(self):
        q, k, v = qkv()
        mask = causal_block_mask(L, "cpu")
        with warnings.catch_warnings():  # an earlier eager call records the warning id ...
            warnings.simplefilter("ignore")
            flex_attention(q, k, v, block_mask=mask)
        install_dense_guards()  # ... which install_dense_guards forgets, so the next call raises
        for _ in range(2):  # every time, not once
            with self.assertRaisesRegex(UserWarning, "without torch.compile"):
                flex_attention(q, k, v, block_mask=mask)
        with warnings.catch_warnings():  # silenced once more: the id is recorded again ...
            warnings.simplefilter("ignore")
            flex_attention(q, k, v, block_mask=mask)
        # ... and attend() re-arms it, so an eager run through attend still fails loudly.
        with torch.compiler.set_stance("force_eager"), self.assertRaisesRegex(DenseFallbackError, "eager"):
            attend(q, k, v, mask)

    def test_forced_eager_stance_through_attend_is_a_dense_fallback_error(self):
        q, k, v = qkv()
        mask = causal_block_mask(L, "cpu")
        install_dense_guards()
        with torch.compiler.set_stance("force_eager"), self.assertRaisesRegex(DenseFallbackError, "eager"):
            attend(q, k, v, mask)

    def test_tripwire_catches_math_path_when_warnings_are_silenced(self):
        q, k, v = qkv()
        mask = causal_block_mask(L, "cpu")
        install_dense_guards(limit_bytes=dense_scores_bytes(1, H, L, L) - 1)
        install_dense_guards(limit_bytes=dense_scores_bytes(1, H, L, L) - 1)  # idempotent: one wrapper
        hop = __import__("importlib").import_module("torch._higher_order_ops.flex_attention")
        self.assertIs(hop._math_attention_inner.__wrapped__, attention._guard_state["original"])
        with warnings.catch_warnings():  # a catch_warnings elsewhere can hide the warning filter
            warnings.simplefilter("ignore")
            with self.assertRaisesRegex(DenseFallbackError, r"\[1, 2, 128, 128\]"):
                flex_attention(q, k, v, block_mask=mask)
        install_dense_guards(limit_bytes=dense_scores_bytes(1, H, L, L))  # at the limit: allowed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q, k, v, block_mask=mask)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    @pytest.mark.slow  # Inductor builds the flex kernel in C++: 15-35 s on 2 cores with a cold compile cache
    def test_compiled_flex_matches_sdpa_and_never_trips_then_recompile_raises(self):
        # limit 0: any real dense score tensor would raise; the compiled path must not make one.
        install_dense_guards(limit_bytes=0)
        q, k, v = qkv()
        mask = causal_block_mask(L, "cpu")

        def probe(variant):
            with torch.no_grad():
                attend(q, k, v, mask)

        report = compile_variants(probe, ["L128 no_grad"], self._lock_path(), log=lambda _: None)
        self.assertEqual(report.counters["graph_breaks"], 0)
        with torch.no_grad():
            out = attend(q, k, v, mask)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))

        q2, k2, v2 = qkv(2 * L)
        mask2 = causal_block_mask(2 * L, "cpu")
        with torch.no_grad(), self.assertRaisesRegex(RecompileError, "compile step did not compile"):
            attend(q2, k2, v2, mask2)

    def test_mask_shape_mismatch_names_the_fix(self):
        q, k, v = qkv()
        mask = causal_block_mask(2 * L, "cpu")
        with self.assertRaisesRegex(ValueError, "padded bucket"):
            attend(q, k, v, mask)

    def _lock_path(self):
        import tempfile

        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        return f"{self._tmp.name}/compile.lock"


def test_dense_scores_bytes_arithmetic():
    assert dense_scores_bytes(1, 32, 32768, 72768) == 32 * 32768 * 72768 * 4  # the 305 GB of the notes
    assert round(dense_scores_bytes(1, 32, 32768, 72768) / 1e9) == 305
    assert dense_scores_bytes(2, 16, 8192, 8192) == 2 * 4 * 2**30
    assert dense_scores_bytes(1, 1, 3, 5, bytes_per_element=2) == 30
    with pytest.raises(ValueError, match="heads must be >= 0"):
        dense_scores_bytes(1, -1, 2, 2)


def test_dense_risk_says_what_a_fallback_would_cost():
    small = dense_risk(1, 2, 128, 128, free_bytes=2**30)
    assert small.fits and "fits" in small.explain()
    risk = dense_risk(1, 32, 32768, 72768, free_bytes=140 * 2**30)
    assert not risk.fits and "would NOT fit" in risk.explain()
    assert risk.peak_bytes > 3 * risk.score_bytes


def test_sdpa_backend_refuses_shapes_whose_dense_scores_cannot_fit(tmp_path):
    """The trainer's sdpa path (CPU) checks the dense scores before step 1 (compile_step.check_dense_fits)."""
    from dflash_trainer.config import ConfigError, load_config
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from dflash_trainer.run.compile_step import check_dense_fits
    from transformers import Qwen3Config

    target = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=8)
    drafter = DFlashDrafter(drafter_config(target, DrafterShape(num_layers=1, block_size=16, mask_token_id=1)))
    cfg = load_config("embedded", ["train.num_anchors=2048", "data.context_buckets=[65536]",
                                   "data.max_length=65536"])
    with pytest.raises(ConfigError, match="would NOT fit"):
        check_dense_fits(cfg, drafter, torch.device("cpu"))
    check_dense_fits(load_config("embedded"), drafter, torch.device("cpu"))  # the embedded shape fits


def test_missing_private_name_gives_a_clear_error(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    monkeypatch.delattr(fa, "_WARNINGS_SHOWN")
    with pytest.raises(attention.PrivateTorchAPIError, match="_WARNINGS_SHOWN is missing in torch"):
        install_dense_guards()
    assert not attention.dense_guards_installed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_eager_flex_with_grad_trips_and_compiled_path_is_fused():
    reset_compile_state()
    try:
        install_dense_guards(limit_bytes=0)
        length = 1024
        q, k, v = [t.cuda().bfloat16().requires_grad_() for t in qkv(length)]
        mask = causal_block_mask(length, "cuda")
        attend(q, k, v, mask).sum().backward()  # compiled fwd+bwd: no real dense scores
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(DenseFallbackError):
                flex_attention(q, k, v, block_mask=mask).sum().backward()
        peak, dense = fused_memory_probe(1, 16, 8192, 64, "cuda")
        assert peak < dense // 4
    finally:
        reset_compile_state()
