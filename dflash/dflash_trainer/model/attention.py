"""The one compiled flex_attention per process, and the guards that keep the run phase off the dense path.

Why this file exists (README, "Troubleshooting the trainer"): an uncompiled flex_attention call is not an
error in torch, it is a silent fallback to a math path that materializes fp32 B*H*L*S scores (305 GB at
H=32, L=32768, S=72768). It happens when the FX-tracing flag is set while a compiled call enters (torch
2.11-2.13 keep that flag in a process global), with `error_on_nested_fx_trace` switched off, under a
`force_eager`/`eager_on_recompile` stance, or past the recompile limit. So:

- `attend` is the only run-phase call site. It calls the module-level compiled flex (`FLEX`) and refuses
  to enter it while an FX trace is active, instead of letting dynamo raise or fall back. Inside a
  compiled drafter layer (objective.COMPILED_LAYER, the default on GPUs) it inlines flex_attention
  into that layer's graph instead: that graph is compiled in the compile step like FLEX.
- `install_dense_guards` turns every eager flex_attention entry into an error and puts a size tripwire on
  the math path itself, so a fallback that bypasses `attend` still stops with a named error.
- `dense_risk` says what a dense fallback would cost; the sdpa path refuses shapes where it would not
  fit (compile_step.check_dense_fits). The DFlash masks need no compiled create_block_mask at all:
  mask.dflash_block_mask computes them from the anchors.

Everything here relies on private torch names; each is looked up by name and fails with a clear error
naming the torch version when it is missing (checked on 2.13; the notes read them in 2.11-2.14).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = [
    "FLEX",
    "CompileRaceError",
    "DenseFallbackError",
    "DenseRisk",
    "PrivateTorchAPIError",
    "RecompileError",
    "attend",
    "dense_guards_installed",
    "dense_risk",
    "dense_scores_bytes",
    "fx_tracing_active",
    "install_dense_guards",
]

# One compiled object per process (torchtitan does the same): every call site shares its guards and
# its recompile budget, so the compile step can cover all of them. dynamic=False: buckets give static shapes.
FLEX = torch.compile(flex_attention, dynamic=False, fullgraph=True)

# The start of flex's eager-path warning (torch/nn/attention/flex_attention.py, `_warn_once`).
EAGER_FLEX_WARNING = "flex_attention called without torch.compile"
_EAGER_FLEX_WARNING_ID = "flex_attention_performance"
# fp32 score copies the eager math path holds at its peak (measured 3.3 on an H200, see the notes).
DENSE_PEAK_COPIES = 3.3
# Default tripwire: a real dense score tensor above this size is a fallback, not a unit test.
DEFAULT_DENSE_LIMIT_BYTES = 64 * 2**20


class CompileRaceError(RuntimeError):
    """A compiled flex call entered while an FX trace was active (the multi-thread compile race)."""


class DenseFallbackError(RuntimeError):
    """flex_attention was about to run (or ran) its unfused math path, which materializes all scores."""


class RecompileError(RuntimeError):
    """A compiled call met a shape or grad mode that the compile step did not cover."""


class PrivateTorchAPIError(RuntimeError):
    """A private torch name these guards depend on is missing in this torch version."""


def _private(module_name: str, attr: str):
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise PrivateTorchAPIError(
            f"{module_name}.{attr} is missing in torch {torch.__version__}; dflash_trainer's dense-path "
            "guards were written against torch 2.11-2.14. Pin torch to a supported version or update "
            "dflash/dflash_trainer/attention.py for this one."
        )
    return module, getattr(module, attr)


def fx_tracing_active() -> bool:
    """True while an FX trace (symbolic_trace, make_fx, AOTAutograd, ...) is active.

    torch 2.11-2.13 keep the flag in a module global, so a trace on ANY thread counts; 2.14 moved it to a
    thread-local with a getter, so only this thread's traces count there.
    """
    module = torch.fx._symbolic_trace
    getter = getattr(module, "_get_is_fx_tracing", None)  # 2.14+: thread-local
    if getter is not None:
        return bool(getter())
    if hasattr(module, "_is_fx_tracing_flag"):  # 2.11-2.13: process global
        return bool(module._is_fx_tracing_flag)
    if hasattr(module, "is_fx_tracing"):
        return bool(module.is_fx_tracing())
    raise PrivateTorchAPIError(
        f"torch {torch.__version__} has neither torch.fx._symbolic_trace._get_is_fx_tracing nor "
        "_is_fx_tracing_flag; update fx_tracing_active() in dflash/dflash_trainer/attention.py for this version."
    )


def _is_recompile_failure(err: Exception) -> bool:
    # set_stance("fail_on_recompile") raises a RuntimeError naming the stance; the recompile limit with
    # fail_on_recompile_limit_hit (or fullgraph=True) raises FailOnRecompileLimitHit (not a RuntimeError).
    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None)
    return "fail_on_recompile" in str(err) or (limit_hit is not None and isinstance(err, limit_hit))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """flex_attention through the process's one compiled object; never a silent dense fallback.

    q [B, Hq, L, D], k/v [B, Hkv, S, D]; block_mask built for (L, S). Raises CompileRaceError if an FX trace
    is active, RecompileError for a shape the compile step did not cover (once it set fail_on_recompile),
    DenseFallbackError if the call ran eagerly anyway (with install_dense_guards).
    """
    if torch.compiler.is_compiling():
        # Inside an outer compiled region dynamo inlines flex into that graph: nothing to guard here.
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if fx_tracing_active():
        raise CompileRaceError(
            "attend() was called while an FX trace is active (torch.fx._symbolic_trace's tracing flag is "
            "set). In torch 2.11-2.13 that flag is process-global, so another thread compiling or tracing "
            "(a lazy backward compile, torch.compile(create_block_mask), make_fx) makes every compiled call "
            "raise or, with error_on_nested_fx_trace switched off, run dense attention. Compile everything in the "
            "serialized compile step (dflash_trainer.compile_guard.compile_variants), one process per GPU, before step 1."
        )
    q_len, kv_len = block_mask.seq_lengths
    if q.shape[-2] != q_len or k.shape[-2] != kv_len:
        raise ValueError(
            f"block_mask was built for q_len={q_len}, kv_len={kv_len} but q has {q.shape[-2]} rows and k "
            f"{k.shape[-2]}; build the mask for the padded bucket the tensors use."
        )
    if _guard_state["shown"] is not None:  # re-arm: a call under catch_warnings may have recorded the id
        _guard_state["shown"].discard(_EAGER_FLEX_WARNING_ID)
    try:
        return FLEX(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    except UserWarning as err:  # install_dense_guards made the eager-path warning an exception
        if EAGER_FLEX_WARNING not in str(err):
            raise
        raise DenseFallbackError(
            "the compiled flex_attention ran its eager (unfused, dense) path. Causes: a compiler stance "
            "such as force_eager/eager_on_recompile, the recompile limit, or error_on_nested_fx_trace switched off. "
            f"Original warning: {str(err).splitlines()[0]}"
        ) from err
    except Exception as err:
        if not _is_recompile_failure(err):
            raise
        raise RecompileError(
            f"flex_attention met a variant the compile step did not compile: q {tuple(q.shape)} {q.dtype}, "
            f"k {tuple(k.shape)}, grad {'on' if torch.is_grad_enabled() else 'off'}, mask ({q_len}, "
            f"{kv_len}). Pad to one of the compiled buckets (data.context_buckets), or add this one to them."
        ) from err


# ---------------------------------------------------------------------------------------------------
# Dense-path guards
# ---------------------------------------------------------------------------------------------------

_guard_state: dict = {
    "installed": False,
    "limit_bytes": DEFAULT_DENSE_LIMIT_BYTES,
    "original": None,  # the unwrapped _math_attention_inner
    "shown": None,  # flex's _WARNINGS_SHOWN set, once the guards are installed
}


def _is_fake(t: torch.Tensor) -> bool:
    # Compilation runs the math path on fake (shape-only) tensors; only real ones allocate scores.
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def _make_tripwire(inner: Callable) -> Callable:
    @functools.wraps(inner)
    def math_attention_tripwire(query, key, *args, **kwargs):
        if not (_is_fake(query) or _is_fake(key)):
            b, h, q_len, kv_len = query.shape[0], query.shape[1], query.shape[-2], key.shape[-2]
            nbytes = dense_scores_bytes(b, h, q_len, kv_len)
            if nbytes > _guard_state["limit_bytes"]:
                raise DenseFallbackError(
                    f"flex_attention's unfused math path was about to materialize fp32 scores of "
                    f"[{b}, {h}, {q_len}, {kv_len}] = {nbytes / 2**30:.2f} GiB per copy (limit "
                    f"{_guard_state['limit_bytes'] / 2**30:.2f} GiB). flex_attention ran without "
                    "torch.compile (or under aot_eager); call dflash_trainer.attention.attend after the compile step."
                )
        return inner(query, key, *args, **kwargs)

    math_attention_tripwire._dflash_tripwire = True  # type: ignore[attr-defined]
    return math_attention_tripwire


def install_dense_guards(limit_bytes: int = DEFAULT_DENSE_LIMIT_BYTES) -> None:
    """Make every eager flex_attention call an error and trip on real dense scores above limit_bytes.

    Idempotent; a second call only updates the limit. Warning filters are process-wide, so another
    `warnings.catch_warnings()` block can hide the first guard: the tripwire does not depend on warnings.
    """
    if limit_bytes < 0:
        raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
    fa_module, shown = _private("torch.nn.attention.flex_attention", "_WARNINGS_SHOWN")
    if not hasattr(fa_module, "_warn_once"):
        _private("torch.nn.attention.flex_attention", "_warn_once")
    # `filterwarnings` removes an identical filter before inserting it, so repeating it adds nothing.
    warnings.filterwarnings("error", message=EAGER_FLEX_WARNING, category=UserWarning)
    # _warn_once is silent once its id is recorded (e.g. after an earlier eager call): forget it. Under an
    # "error" filter warnings.warn raises before the id is recorded, so every eager call raises.
    shown.discard(_EAGER_FLEX_WARNING_ID)
    _guard_state["shown"] = shown

    # `import torch._higher_order_ops.flex_attention` gives the HOP object, not the module: use importlib.
    hop_module, inner = _private("torch._higher_order_ops.flex_attention", "_math_attention_inner")
    _guard_state["limit_bytes"] = int(limit_bytes)
    if not getattr(inner, "_dflash_tripwire", False):
        # math_attention (forward) and sdpa_dense_backward look the name up at call time.
        _guard_state["original"] = inner
        hop_module._math_attention_inner = _make_tripwire(inner)
    _guard_state["installed"] = True


def dense_guards_installed() -> bool:
    return bool(_guard_state["installed"])


# ---------------------------------------------------------------------------------------------------
# What a dense fallback would cost
# ---------------------------------------------------------------------------------------------------


def dense_scores_bytes(batch: int, heads: int, q_len: int, kv_len: int, bytes_per_element: int = 4) -> int:
    """Bytes of ONE dense score tensor [batch, heads, q_len, kv_len] (the math path works in fp32)."""
    for name, value in (("batch", batch), ("heads", heads), ("q_len", q_len), ("kv_len", kv_len)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return batch * heads * q_len * kv_len * bytes_per_element


@dataclass(frozen=True)
class DenseRisk:
    """What the unfused path would need for one attention call against the memory that is free."""

    score_bytes: int  # one fp32 copy
    peak_bytes: int  # DENSE_PEAK_COPIES copies: the eager forward's measured peak
    free_bytes: int | None  # None: unknown (CPU)

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.peak_bytes <= self.free_bytes

    def explain(self) -> str:
        free = "unknown" if self.free_bytes is None else f"{self.free_bytes / 2**30:.1f} GiB"
        verdict = "fits" if self.fits else "would NOT fit"
        return (
            f"dense attention fallback: {self.score_bytes / 2**30:.1f} GiB per fp32 score copy, "
            f"~{self.peak_bytes / 2**30:.1f} GiB peak, free {free}: {verdict}"
        )


def dense_risk(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    device: torch.device | str | None = None,
    free_bytes: int | None = None,
) -> DenseRisk:
    """Estimate the dense path's memory; free_bytes defaults to torch.cuda.mem_get_info on a CUDA device."""
    score = dense_scores_bytes(batch, heads, q_len, kv_len)
    if free_bytes is None and device is not None and torch.device(device).type == "cuda":
        free_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
    return DenseRisk(score, int(score * DENSE_PEAK_COPIES), free_bytes)
