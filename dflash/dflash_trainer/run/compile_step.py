"""The drafter's compile step: each context bucket a step can take, forward + backward, before step 1.

The mechanics (turn-taking lock, cache directory, fail-on-recompile) are in compile/guard.py; this file
says what a DFlash drafter step runs (step.DrafterStep), so that the compile step compiles exactly that.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig
from ..model.drafter import DFlashDrafter
from .step import DrafterStep


def check_dense_fits(cfg: RunConfig, drafter: DFlashDrafter, device: torch.device) -> None:
    """The sdpa backend materialises scores: refuse shapes where that cannot fit (use flex on a GPU)."""
    from ..model.attention import dense_risk

    config = drafter.config
    q = cfg.train.num_anchors * config.block_size
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if device.type == "cpu" else None
    risk = dense_risk(cfg.train.micro_batch, config.num_attention_heads, q, cfg.data.context_buckets[-1] + q,
                      device=device, free_bytes=free)
    if not risk.fits:
        raise ConfigError(f"train.attention = 'sdpa' would materialise dense scores: {risk.explain()}. "
                          "Train with attention = 'flex' on a GPU.")


def compile_cache_dir(setting: str | None) -> Path:
    """Where compiled kernels are kept: train.compile_cache_dir, else one directory per user that every run
    shares (torch's own default is per boot, under /tmp), so only the first run of a shape compiles cold."""
    path = Path(setting) if setting else \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-trainer" / "compile-cache"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only home under a service, a file in the way
        raise ConfigError(f"the compile cache {path} cannot be created ({exc.strerror}): set "
                          "train.compile_cache_dir to a writable directory") from exc
    return path


def compile_drafter_step(step: DrafterStep, buckets, micro_batch: int, cache_dir: Path, log, label: str = "",
                         serialized: bool = True, target=None):
    """The serialized compile step: compile the drafter step for every bucket in `buckets` (forward +
    backward, and the optimizer's update kernel) before step 1.

    Ranks take turns through a file lock in the shared cache directory, so the first fills the cache
    and the others hit it; afterwards a recompile is an error and an eager flex_attention call raises.
    The probe is the step's own forward_backward on random inputs of the bucket's shape, run on the
    bare drafter (bare=True: no DDP all-reduce inside the lock). The optimizer's one-pass update is
    compiled on scratch tensors, so the probe changes no weight and no optimizer state.
    serialized=False: no lock, for FSDP, whose forward needs every rank. target: the colocated target,
    whose compiled feature forward is compiled for the same buckets (target.FrozenTarget).
    """
    from ..compile.guard import compile_cache_env, compile_variants
    from ..model.attention import install_dense_guards

    compile_cache_env(cache_dir)
    install_dense_guards()
    drafter = step.drafter
    config = drafter.config
    feat_dim = len(drafter.target_layer_ids) * config.hidden_size
    device = step.embed_weight.device

    def probe(ctx_len: int) -> None:
        drafter.train()  # the step's mode: compiled graphs are guarded on it
        t0 = time.perf_counter()
        ids = torch.randint(config.vocab_size, (micro_batch, ctx_len), device=device)
        with_final = step.objective is not None and step.objective.needs_target
        if target is not None:
            probe_target(target, ids, with_final)
        loss_mask = torch.ones(micro_batch, ctx_len, dtype=torch.uint8, device=device)
        features = torch.randn(micro_batch, ctx_len, feat_dim, device=device, dtype=drafter.fc.weight.dtype)
        target_hidden = None  # an objective against the target's distribution reads its final hidden states
        if with_final:
            target_hidden = torch.randn(micro_batch, ctx_len, config.hidden_size, device=device,
                                        dtype=drafter.fc.weight.dtype)
        step.forward_backward(ids, loss_mask, features, bare=True, target_hidden=target_hidden)
        drafter.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        step.optimizer.precompile()
        log(f"{label}  bucket {ctx_len}: forward + backward {t1 - t0:.1f}s, optimizer {time.perf_counter() - t1:.1f}s")

    lock = Path(cache_dir) / "compile.lock" if serialized else None
    return compile_variants(probe, list(buckets), lock, log=log, label=label, share="drafter")


def probe_target(target, ids: torch.Tensor, with_final: bool) -> None:
    """The target's forward as the run calls it: the features, or with_final (a loss against the target's
    distribution) every layer and the final norm too, whose layers above the tapped ones may compile to graphs
    of their own (a MoE model's sparse layers): compiled here, not at step 1, where a new graph is an error."""
    if with_final:
        target.features_and_final(ids)
    else:
        target.features(ids)


def compile_target_step(target, buckets, micro_batch: int, cache_dir: Path, log, label: str = "",
                        serialized: bool = True, with_final: bool = False):
    """A target rank's compile step: its compiled feature forward for every bucket in `buckets`, through the
    same lock and cache as the drafter ranks' (no-op where the target runs eagerly: not on a GPU, or a
    backbone without the tapped forward). serialized=False: no lock, for a tensor-parallel target group,
    whose forward needs every rank of the group. with_final: the run sends the target's final hidden states."""
    from ..compile.guard import compile_cache_env, compile_variants

    if not target.compile_layers:
        return None
    compile_cache_env(cache_dir)
    device = target.embed_weight.device
    vocab = target.embed_weight.shape[0]

    def probe(ctx_len: int) -> None:
        probe_target(target, torch.randint(vocab, (micro_batch, ctx_len), device=device), with_final)

    lock = Path(cache_dir) / "compile.lock" if serialized else None
    return compile_variants(probe, list(buckets), lock, log=log, label=label, share="target")
