"""The compile step's mechanics: every rank compiles every variant before step 1, one rank at a time.

Why (README, "How the compile step works"): compiling lazily inside the step let several workers trace
at once, which raced on torch's process-global FX flag, fell back to dense attention, or deadlocked. Here:

- every rank compiles each (bucket x grad mode) variant, forward AND backward, in its main thread;
- ranks on a host take turns through a file lock in the shared cache dir, so the first compile fills
  TORCHINDUCTOR_CACHE_DIR and the others load from it instead of compiling again; once one rank of a
  torchrun start has finished, the host's other ranks of that start load theirs side by side (a marker
  beside the lock names the start), instead of one after another;
- afterwards the compiler stance is fail_on_recompile: a shape the compile step missed raises, never
  runs eager.

No lock wraps the run-phase calls: with activation checkpointing the autograd thread's recompute calls
flex again, and a per-call lock deadlocks against it (measured on an H200).
run/compile_step.py says what a DFlash drafter step runs; this file knows nothing about DFlash.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from ..infra.storage import write_text_atomic

__all__ = [
    "CompileReport",
    "compile_cache_env",
    "compile_counters",
    "compile_lock",
    "compile_variants",
    "isolate_local_gpu",
    "leave_run_phase",
    "prefetch_triton_key",
    "start_compile_workers",
]

# Room for recompiles we do not count as variants (e.g. the first call after a grad-mode switch).
RECOMPILE_MARGIN = 4


def compile_cache_env(cache_dir: str | os.PathLike, environ: dict | None = None) -> dict[str, str]:
    """Point Inductor's and Triton's on-disk caches at cache_dir (shared by all ranks of a host).

    Call before the first compile. Returns the variables it set (also written to `environ`, default
    os.environ, so torchrun children and Triton's subprocesses inherit them).

    Cache keys include the device index of the example inputs (codecache.FxGraphHashDetails): a graph
    compiled on cuda:1 is a miss for cuda:2. For the ranks to share compiled kernels every worker should
    see its own GPU as cuda:0, i.e. start with CUDA_VISIBLE_DEVICES=<its GPU> (isolate_local_gpu).
    Trade-off: NCCL may then not use peer-to-peer copies between GPUs it cannot see; if the feature
    hand-off becomes the bottleneck, keep all GPUs visible and accept one compile per local rank.
    """
    environ = os.environ if environ is None else environ
    root = Path(cache_dir).expanduser().resolve()
    values = {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }
    for path in values.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    environ.update(values)
    return values


def isolate_local_gpu(local_rank: int, environ: dict | None = None) -> str:
    """Make this worker see only its own GPU, as cuda:0, so compile-cache keys match across ranks.

    Must run before CUDA is initialized in this process (before any torch.cuda call that touches a
    device). Honours an existing CUDA_VISIBLE_DEVICES list by picking its local_rank-th entry.
    """
    environ = os.environ if environ is None else environ
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "isolate_local_gpu() ran after CUDA was initialized in this process, so CUDA_VISIBLE_DEVICES "
            "no longer applies; call it first thing in the worker, before any torch.cuda use."
        )
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if devices is not None and local_rank >= len(devices):
        raise ValueError(
            f"local rank {local_rank} has no GPU: CUDA_VISIBLE_DEVICES={visible!r} lists {len(devices)}; "
            "start at most that many workers per host."
        )
    chosen = devices[local_rank] if devices is not None else str(local_rank)
    environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen


def start_compile_workers(cache_dir: str | os.PathLike) -> None:
    """Start Inductor's Triton compile workers now, beside the setup, rather than at the first compile.

    Inductor starts its worker processes when the first graph reaches it, and each worker imports torch
    before it compiles a kernel, so a cold compile step began with seconds of waiting on them. The
    workers inherit the environment at start: the cache variables are set first, or their kernels would
    land outside the shared cache. Honours TORCH_WARM_POOL=0 and TORCHINDUCTOR_COMPILE_THREADS=1.
    """
    compile_cache_env(cache_dir)
    with suppress(Exception):  # only a head start: the compile step starts them itself and says what failed
        from torch._inductor.async_compile import maybe_warm_pool
        maybe_warm_pool()


def prefetch_triton_key(device: torch.device) -> threading.Thread | None:
    """Start hashing Triton's install on a thread; the compile step's first cache lookup needs the hash.

    Every process that looks a graph up in Inductor's cache first computes Triton's key, a sha256 of its
    sources and of libtriton.so (about 500 MB): 0.8 s of a warm compile step on an H200 host, in the main
    thread, before any cached graph loads. Hashing releases the GIL per 1 MB chunk, so a thread started
    after the imports finishes it beside the setup and Dynamo's tracing, and the lookup then finds it in
    triton_key's cache. The switch interval is lowered meanwhile: at the default 5 ms the busy main
    thread hands the GIL over so rarely that the hash would take seconds. None off CUDA or without Triton.
    """
    if device.type != "cuda":
        return None
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None

    def work() -> None:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 2e-4))
        try:
            with suppress(Exception):  # only a head start: the compile step's own call fails and says why
                triton_key()
        finally:
            sys.setswitchinterval(interval)

    thread = threading.Thread(target=work, name="triton-key", daemon=True)
    thread.start()
    return thread


@contextmanager
def compile_lock(lock_path: str | os.PathLike) -> Iterator[float]:
    """Exclusive cross-process lock on lock_path (filelock: flock on Linux); yields the seconds waited.

    flock is released by the kernel when the process dies, so a crashed rank never wedges the others.
    It needs a local filesystem (flock on NFS is not reliable): keep the cache dir on local disk.
    """
    with _compile_turn(lock_path, None) as (waited, _):
        yield waited


def launch_id(environ: dict | None = None) -> str | None:
    """This torchrun start on this host, the same in all its local ranks: their launcher's (torchrun's agent,
    every worker's parent) pid and start time, and the restart count. None outside torchrun."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RESTART_COUNT" not in environ:
        return None
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: start time
    except (OSError, IndexError):
        return None
    return f"{parent}-{started}-{environ['TORCHELASTIC_RESTART_COUNT']}"


@contextmanager
def _compile_turn(lock_path: str | os.PathLike | None, marker: Path | None) -> Iterator[tuple[float, bool]]:
    """Yields (seconds waited for the lock, whether a rank of this start already compiled these graphs).
    In that case the lock is given back at once: every graph is in the cache, and loading it needs no turn.
    Otherwise the lock is held through the block, and the marker written after it succeeded."""
    if lock_path is None:
        yield 0.0, False
        return
    start_id = launch_id() if marker is not None else None
    path = Path(lock_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # thread_local=False: the lock belongs to the process, like the flock it wraps.
    lock = FileLock(str(path), thread_local=False)
    t0 = time.monotonic()
    lock.acquire()
    try:
        waited = time.monotonic() - t0
        filled = start_id is not None and marker.is_file() and marker.read_text() == start_id
        if filled:
            lock.release()
        yield waited, filled
        if start_id is not None and not filled:
            try:
                write_text_atomic(marker, start_id)
            except OSError:
                pass  # only a speed-up: without it the other ranks queue behind the lock, as without torchrun
    finally:
        if lock.is_locked:
            lock.release()


def compile_counters() -> dict[str, int]:
    """A flat snapshot of the dynamo/inductor counters the compile step reports (cache hits, graphs, breaks)."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames_ok": counters["frames"]["ok"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


@dataclass
class CompileReport:
    """What one rank's compile step did; `summary()` is one log line."""

    label: str
    lock_wait_s: float
    compile_s: float
    variant_s: dict[str, float] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)  # deltas over the compile step
    graph_break_reasons: list[str] = field(default_factory=list)

    @property
    def cache_hits(self) -> int:
        return self.counters.get("fxgraph_cache_hit", 0) + self.counters.get("autograd_cache_hit", 0)

    @property
    def cache_misses(self) -> int:
        return self.counters.get("fxgraph_cache_miss", 0) + self.counters.get("autograd_cache_miss", 0)

    def summary(self) -> str:
        c = self.counters
        per_variant = ", ".join(f"{k} {v:.1f}s" for k, v in self.variant_s.items())
        return (
            f"{self.label}compile step {self.compile_s:.1f}s (waited {self.lock_wait_s:.1f}s for the lock); "
            f"fx graph cache {c.get('fxgraph_cache_hit', 0)} hit / {c.get('fxgraph_cache_miss', 0)} miss, "
            f"autograd cache {c.get('autograd_cache_hit', 0)} hit / {c.get('autograd_cache_miss', 0)} miss, "
            f"{c.get('unique_graphs', 0)} graphs, {c.get('graph_breaks', 0)} graph breaks; {per_variant}"
        )


def _set_if_present(config_module: Any, name: str, value: Any) -> bool:
    if hasattr(config_module, name):
        setattr(config_module, name, value)
        return True
    return False


def compile_variants(
    probe_fn: Callable[[Any], None],
    variants: Sequence[Any],
    lock_path: str | os.PathLike | None,
    log: Callable[[str], None] = print,
    label: str = "",
    share: str | None = None,
) -> CompileReport:
    """Compile every variant inside the cross-process lock, then forbid compiling.

    probe_fn(variant) must run what the step runs for that variant: forward AND backward, same dtypes,
    requires_grad, grad mode and activation checkpointing (use_reentrant=True adds a no_grad variant per
    bucket). Call it in the main thread, with no other thread running torch. Afterwards any recompile
    raises (torch.compiler.set_stance("fail_on_recompile")); leave_run_phase() undoes that.
    lock_path None: no turn-taking, for probes whose forward needs every rank (FSDP's all-gathers); each
    process still compiles only in its main thread, and the ranks may then each fill the cache.
    share: a name for what the probe compiles (e.g. "drafter"): under torchrun, once one rank of this
    start compiled it under the lock, the host's other ranks of the start skip the queue (cache hits).
    """
    _check_can_compile(variants)
    from torch._dynamo.utils import counters

    _allow_compiling(len(variants), log, label)
    before = compile_counters()
    breaks_before = set(counters["graph_break"])
    marker = Path(f"{lock_path}.{share}") if lock_path is not None and share else None
    with _compile_turn(lock_path, marker) as (waited, filled):
        log(label + _turn_line(lock_path, waited, filled, len(variants)))
        start = time.monotonic()
        variant_s = _run_probes(probe_fn, variants)
        compile_s = time.monotonic() - start

    _forbid_compiling()
    after = compile_counters()
    report = CompileReport(
        label=label,
        lock_wait_s=waited,
        compile_s=compile_s,
        variant_s=variant_s,
        counters={k: after[k] - before[k] for k in after},
        graph_break_reasons=[r for r in counters["graph_break"] if r not in breaks_before],
    )
    log(report.summary())
    return report


def _check_can_compile(variants: Sequence[Any]) -> None:
    """The main thread, and at least one variant."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "compile_variants() must run in the main thread: compiling in a thread races on torch's "
            "FX-tracing flag. Run it in each rank's main thread before step 1."
        )
    if not variants:
        raise ValueError("compile_variants() got no variants; pass every (bucket, grad mode) the run will use.")


def _allow_compiling(num_variants: int, log: Callable[[str], None], label: str) -> None:
    """Compiler settings for the compile step: the backward compiled eagerly, recompile limits that fit
    every variant, the default stance."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    # Compile the backward now, on this thread; lazily it would compile on the autograd device thread.
    if not _set_if_present(functorch_config, "force_non_lazy_backward_lowering", True):
        log(
            f"{label}torch {torch.__version__} has no force_non_lazy_backward_lowering: the backward may "
            "compile lazily; the probe's backward still compiles it here, on this thread."
        )
    # The limit is per code object and shared by every variant: all buckets x grad modes, plus margin.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, num_variants + RECOMPILE_MARGIN)
    accumulated = max(getattr(dynamo_config, "accumulated_recompile_limit", 0), 4 * dynamo_config.recompile_limit)
    _set_if_present(dynamo_config, "accumulated_recompile_limit", accumulated)
    torch.compiler.set_stance("default")


def _turn_line(lock_path: str | os.PathLike | None, waited: float, filled: bool, num_variants: int) -> str:
    """The log line at the start of this rank's turn: no lock, from the cache, or compiling."""
    if lock_path is None:
        return f"compiling {num_variants} variant(s) together with the other ranks (no lock)"
    if filled:
        return (f"compile lock taken after {waited:.1f}s; a rank of this start compiled these graphs "
                f"already: loading {num_variants} variant(s) from the cache beside the other ranks")
    return f"compile lock taken after {waited:.1f}s; compiling {num_variants} variant(s)"


def _run_probes(probe_fn: Callable[[Any], None], variants: Sequence[Any]) -> dict[str, float]:
    """Each variant's probe, timed to the end of its GPU work: seconds per variant."""
    variant_s: dict[str, float] = {}
    for variant in variants:
        t0 = time.monotonic()
        probe_fn(variant)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        variant_s[str(variant)] = time.monotonic() - t0
    return variant_s


def _forbid_compiling() -> None:
    """From here on any recompile raises (leave_run_phase() undoes it)."""
    import torch._dynamo.config as dynamo_config

    torch.compiler.set_stance("fail_on_recompile")  # process-wide: applies to every thread
    dynamo_config.fail_on_recompile_limit_hit = True  # past the limit: raise, not eager


def leave_run_phase() -> None:
    """Back to the default compiler stance (tests, or a new compile step for a new bucket set)."""
    import torch._dynamo.config as dynamo_config

    torch.compiler.set_stance("default")
    dynamo_config.fail_on_recompile_limit_hit = False
