"""The drafter's compile step: every context bucket warmed (forward + backward) before step 1.

The mechanics (turn-taking lock, cache directory, fail-on-recompile) are in warmup.py; this file says
what a DFlash drafter step runs, so that warm-up compiles exactly that.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .config import ConfigError, RunConfig
from .model import DFlashDrafter
from .objective import drafter_loss, prepare_micro_batch


def check_dense_fits(cfg: RunConfig, drafter: DFlashDrafter, device: torch.device) -> None:
    """The sdpa backend materialises scores: refuse shapes where that cannot fit (use flex on a GPU)."""
    from .attention import dense_risk

    dc = drafter.config
    q = cfg.train.num_anchors * dc.block_size
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if device.type == "cpu" else None
    risk = dense_risk(cfg.train.micro_batch, dc.num_attention_heads, q, cfg.data.context_buckets[-1] + q,
                      device=device, free_bytes=free)
    if not risk.fits:
        raise ConfigError(f"train.attention = 'sdpa' would materialise dense scores: {risk.explain()}. "
                          "Train with attention = 'flex' on a GPU.")


def warm_drafter(drafter, embed_weight, head_weight, buckets, micro_batch: int, num_anchors: int,
                 gamma, chunk_rows: int, cache_dir: Path, log, label: str = "",
                 compiled_layers: bool = True, serialized: bool = True, optimizer=None):
    """The serialized compile step: warm every context bucket (forward + backward) before step 1.

    Ranks take turns through a file lock in the shared cache directory, so the first fills the cache
    and the others hit it; afterwards a recompile is an error and an eager flex_attention call raises.
    The probe runs the bare drafter, not its DDP wrapper: a gradient all-reduce inside the lock
    would wait for ranks that are waiting for the lock. `optimizer` (a MasterWeightAdamW) has its
    compiled update warmed too, on scratch tensors.
    """
    from .attention import install_dense_guards
    from .warmup import compile_cache_env, warm_up

    compile_cache_env(cache_dir)
    install_dense_guards()
    dc = drafter.config
    feat_dim = len(drafter.target_layer_ids) * dc.hidden_size
    device = embed_weight.device

    def probe(ctx_len: int) -> None:
        drafter.train()  # the step's mode: compiled graphs are guarded on it
        t0 = time.perf_counter()
        ids = torch.randint(dc.vocab_size, (micro_batch, ctx_len), device=device)
        lm = torch.ones(micro_batch, ctx_len, dtype=torch.uint8, device=device)
        feats = torch.randn(micro_batch, ctx_len, feat_dim, device=device, dtype=drafter.fc.weight.dtype)
        mb = prepare_micro_batch(ids, lm, num_anchors, dc, drafter.mask_token_id, gamma, "flex")
        t1 = time.perf_counter()
        sums = drafter_loss(drafter, embed_weight, head_weight, feats, mb.blocks, mb.attention, chunk_rows,
                            compiled_layers=compiled_layers)
        t2 = time.perf_counter()
        sums.weighted_ce.backward()
        drafter.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if optimizer is not None:
            optimizer.warm()
        log(f"{label}  bucket {ctx_len}: mask {t1 - t0:.1f}s, forward {t2 - t1:.1f}s, "
            f"backward {t3 - t2:.1f}s" + (f", optimizer {time.perf_counter() - t3:.1f}s" if optimizer else ""))

    lock = Path(cache_dir) / "compile.lock" if serialized else None  # FSDP: the forward needs every rank
    return warm_up(probe, list(buckets), lock, log=log, label=label)
