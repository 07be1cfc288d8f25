"""The serialized compile step: compile_variants covers the variants, then a recompile raises; ranks take turns
through the file lock and the second one loads the first one's compiled graphs from the shared cache."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
import unittest

import pytest
import torch
from dflash_trainer.compile.guard import (
    compile_cache_env,
    compile_lock,
    compile_variants,
    isolate_local_gpu,
    leave_run_phase,
)


def tiny_step(x, w):
    return torch.tanh(x @ w).square().sum()


def reset_compile_state():
    leave_run_phase()
    torch._dynamo.reset()


class WarmUpTest(unittest.TestCase):
    def setUp(self):
        reset_compile_state()
        self.addCleanup(reset_compile_state)

    def test_compile_two_variants_then_a_new_shape_raises(self):
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config

        # aot_eager: the same Dynamo guards and AOTAutograd fwd/bwd split as Inductor, without C++ builds.
        step = torch.compile(tiny_step, backend="aot_eager", dynamic=False, fullgraph=True)
        w = torch.randn(8, 8, requires_grad=True)
        seen = []

        def probe(rows):
            x = torch.randn(rows, 8)
            step(x, w).backward()  # forward AND backward, like the real step
            seen.append(rows)

        lines = []
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            report = compile_variants(probe, [4, 16], f"{tmp}/compile.lock", log=lines.append, label="[rank 0] ")
        self.assertEqual(seen, [4, 16])
        self.assertEqual(list(report.variant_s), ["4", "16"])
        self.assertEqual(report.counters["unique_graphs"], 2)
        self.assertEqual(report.counters["graph_breaks"], 0)
        self.assertEqual(report.graph_break_reasons, [])
        self.assertTrue(any(line.startswith("[rank 0] compile step") for line in lines))
        self.assertGreaterEqual(dynamo_config.recompile_limit, 2)
        self.assertTrue(dynamo_config.fail_on_recompile_limit_hit)
        if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
            self.assertTrue(functorch_config.force_non_lazy_backward_lowering)

        step(torch.randn(16, 8), w).backward()  # a compiled variant still runs
        with self.assertRaisesRegex(RuntimeError, "fail_on_recompile"):
            step(torch.randn(32, 8), w)

    def test_compile_variants_refuses_a_thread_and_empty_variants(self):
        errors = []

        def run():
            try:
                compile_variants(lambda v: None, [1], "/nonexistent/compile.lock", log=lambda _: None)
            except RuntimeError as err:
                errors.append(str(err))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        self.assertEqual(len(errors), 1)
        self.assertIn("main thread", errors[0])
        with self.assertRaisesRegex(ValueError, "no variants"):
            compile_variants(lambda v: None, [], "/nonexistent/compile.lock", log=lambda _: None)


def test_compile_cache_env_and_gpu_isolation(tmp_path):
    env: dict[str, str] = {}
    values = compile_cache_env(tmp_path / "cache", environ=env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor") == values["TORCHINDUCTOR_CACHE_DIR"]
    assert (tmp_path / "cache" / "triton").is_dir()
    assert isolate_local_gpu(1, environ={}) == "1"
    assert isolate_local_gpu(1, environ={"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"
    with pytest.raises(ValueError, match="lists 2"):
        isolate_local_gpu(2, environ={"CUDA_VISIBLE_DEVICES": "4,6"})


def test_runs_share_one_compile_cache_per_user_unless_one_is_named(tmp_path, monkeypatch):
    from dflash_trainer.config import ConfigError
    from dflash_trainer.run.compile_step import compile_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir(None) == tmp_path / "xdg" / "dflash-trainer" / "compile-cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache_dir(None) == tmp_path / "home" / ".cache" / "dflash-trainer" / "compile-cache"
    assert compile_cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"
    (tmp_path / "file").write_text("")  # a file where the cache's directory would go: the setting named
    with pytest.raises(ConfigError, match="cannot be created .*set train.compile_cache_dir to a writable"):
        compile_cache_dir(str(tmp_path / "file" / "cache"))


def _rank_worker(cache_dir: str, queue) -> None:
    compile_cache_env(cache_dir)  # before the first compile, as a rank does at start-up
    step = torch.compile(tiny_step, dynamic=False, fullgraph=True)  # Inductor: fills the disk cache
    w = torch.randn(8, 8, requires_grad=True)
    spans = []

    def probe(rows):
        start = time.time()
        with torch.no_grad():  # one C++ build instead of two keeps this test short; the in-process test
            step(torch.randn(rows, 8), w)  # above covers forward + backward
        time.sleep(0.3)  # widen the window in which an unserialized peer would overlap
        spans.append((start, time.time()))

    report = compile_variants(probe, [4], f"{cache_dir}/compile.lock", log=lambda _: None)
    queue.put({"spans": spans, "hits": report.cache_hits, "misses": report.cache_misses})


def run_ranks(ctx, target, args, count: int, timeout: float) -> list[dict]:
    """`count` processes of target(*args, queue); their results in the order their first probe began."""
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, queue)) for _ in range(count)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return sorted(results, key=lambda r: r["spans"][0][0])


@pytest.mark.slow
def test_lock_serializes_two_processes_and_second_hits_the_cache(tmp_path):
    first, second = run_ranks(mp.get_context("spawn"), _rank_worker, (str(tmp_path),), 2, timeout=240)
    assert first["spans"][-1][1] <= second["spans"][0][0], "the two compile steps overlapped: the lock did not hold"
    assert first["misses"] > 0 and first["hits"] == 0
    assert second["hits"] > 0 and second["misses"] == 0, second


def test_compile_lock_excludes_within_a_process_tree(tmp_path):
    lock = tmp_path / "compile.lock"
    with compile_lock(lock) as waited:
        assert waited >= 0.0
        ctx = mp.get_context("fork")
        started = ctx.Event()
        proc = ctx.Process(target=_hold_lock_briefly, args=(str(lock), started))
        proc.start()
        time.sleep(0.5)
        assert not started.is_set(), "a second process took the lock while it was held"
    proc.join(30)
    assert proc.exitcode == 0 and started.is_set()


def _hold_lock_briefly(lock_path: str, started) -> None:
    with compile_lock(lock_path):
        started.set()


def _start_worker(lock_path: str, restart: int, entered, barrier, queue) -> None:
    """One local rank of a torchrun start (its launcher: the test process, every worker's parent)."""
    import os

    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    lines, spans = [], []

    def probe(_variant):
        start = time.time()
        with entered.get_lock():
            entered.value += 1
            first = entered.value == 1
        if not first:  # the ranks after the first must be inside their probes at the same time
            barrier.wait(timeout=60)
        spans.append((start, time.time()))

    compile_variants(probe, [1], lock_path, log=lines.append, share="drafter")
    leave_run_phase()
    queue.put({"spans": spans, "log": lines[0]})


def test_after_the_first_rank_of_a_start_the_others_load_side_by_side(tmp_path):
    """Rank 1 compiles under the lock; ranks 2 and 3 of the same start then run their probes at once (a
    barrier they both must reach: serialized, the one holding the lock would wait forever). A new start
    (torchrun's restart) queues behind the lock again: its graphs may differ."""
    ctx = mp.get_context("fork")
    lock = str(tmp_path / "compile.lock")

    def start(restart: int, ranks: int) -> list[dict]:
        entered, barrier = ctx.Value("i", 0), ctx.Barrier(max(1, ranks - 1))
        return run_ranks(ctx, _start_worker, (lock, restart, entered, barrier), ranks, timeout=120)

    first, *others = start(0, 3)
    assert "compiling 1 variant(s)" in first["log"] and "already" not in first["log"]
    assert all("a rank of this start compiled these graphs already" in r["log"] for r in others)
    assert all(first["spans"][-1][1] <= r["spans"][0][0] for r in others), "a peer started before rank 1 finished"
    (again,) = start(1, 1)
    assert "already" not in again["log"]


def test_triton_key_is_hashed_on_a_thread_and_the_switch_interval_restored():
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from dflash_trainer.compile.guard import prefetch_triton_key

    assert prefetch_triton_key(torch.device("cpu")) is None  # nothing compiles with Inductor there
    triton_cache.triton_key.cache_clear()
    interval = sys.getswitchinterval()
    thread = prefetch_triton_key(torch.device("cuda", 0))  # only hashes files: no GPU needed
    assert thread is not None and thread.name == "triton-key"
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert triton_cache.triton_key.cache_info().currsize == 1  # the compile step's lookup finds it cached
    assert sys.getswitchinterval() == interval


def test_no_triton_means_no_thread(monkeypatch):
    from dflash_trainer.compile.guard import prefetch_triton_key

    monkeypatch.setitem(sys.modules, "triton.runtime.cache", None)  # `import` raises ImportError
    assert prefetch_triton_key(torch.device("cuda", 0)) is None


def test_the_thread_hashes_with_a_short_switch_interval_where_triton_is_a_stand_in(monkeypatch):
    """The mechanism without Triton installed (CI): the thread calls triton_key once, with the interval lowered."""
    import functools
    import types

    from dflash_trainer.compile.guard import prefetch_triton_key

    seen = []

    @functools.lru_cache
    def triton_key():
        seen.append(sys.getswitchinterval())
        return "3.x-abc"

    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = triton_key
    for name, module in (("triton", types.ModuleType("triton")), ("triton.runtime", types.ModuleType("triton.runtime")),
                         ("triton.runtime.cache", cache)):
        monkeypatch.setitem(sys.modules, name, module)
    interval = sys.getswitchinterval()
    thread = prefetch_triton_key(torch.device("cuda", 0))
    thread.join(timeout=30)
    assert seen and seen[0] <= 2e-4 < interval  # the busy main thread hands the GIL over every 0.2 ms meanwhile
    assert triton_key.cache_info().currsize == 1 and sys.getswitchinterval() == interval


def test_compile_workers_start_after_the_cache_variables_are_set(tmp_path, monkeypatch):
    """Inductor's workers inherit the environment when they start: started before TRITON_CACHE_DIR pointed
    at the shared cache, their kernels would land outside it and every later run would compile them again."""
    import os

    from dflash_trainer.compile.guard import start_compile_workers
    from torch._inductor import async_compile

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # records the value to restore; the function sets its own
        monkeypatch.delenv(name)
    seen = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool",
                        lambda: seen.append((os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR"))))
    start_compile_workers(tmp_path / "cc")
    root = (tmp_path / "cc").resolve()
    assert seen == [(str(root / "inductor"), str(root / "triton"))]

    def broken():
        raise RuntimeError("no subprocesses here")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", broken)
    start_compile_workers(tmp_path / "cc")  # only a head start: a failure is left to the compile step


@pytest.mark.slow
def test_the_target_compile_step_covers_the_layers_a_loss_against_its_distribution_runs(tmp_path):
    """A loss against the target's distribution (DSpark's TV, DFlash 2's KL) runs every layer to the final norm,
    where the features stop at the last tapped one: layers above it that differ (a MoE model's sparse layers
    above dense ones) compile to graphs of their own. The compile step compiles what the run calls; compiling
    only the features, the first step's final hidden states raise (a recompile), never run eager."""
    from dflash_trainer.run.compile_step import compile_target_step
    from dflash_trainer.target.frozen import FrozenTarget
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0, 1])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # layers 0-1 dense (tapped), 2-3 sparse
    ids = torch.randint(128, (2, 24))
    eager = FrozenTarget(model, [0, 1], compile_layers=False).features_and_final(ids)
    for with_final in (True, False):
        reset_compile_state()
        target = FrozenTarget(model, [0, 1], compile_layers=True)  # the tapped forward compiled, as on a GPU
        report = compile_target_step(target, [24], 2, tmp_path, log=lambda _: None, serialized=False,
                                     with_final=with_final)
        assert report.counters["unique_graphs"] == (2 if with_final else 1), report.counters
        if with_final:
            features, final = target.features_and_final(ids)
            torch.testing.assert_close(features, eager[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(final, eager[1], rtol=1e-4, atol=1e-5)
        else:
            with pytest.raises(RuntimeError, match="fail_on_recompile"):
                target.features_and_final(ids)
    reset_compile_state()
