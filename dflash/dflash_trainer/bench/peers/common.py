"""What both peer adapters share, and what is ours in a peer's run: the run config our trainer reads, the dumped
micro-batches in our trainer's order, our learning-rate schedule, the drafter published in our format, and
summary.json.

A peer is imported from its installed package at run time and never is a dependency of this project: a missing
one is PeerMissing (exit 2) with the exact install command; another version than the adapter was written
against is a warning.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import ConfigError, RunConfig
from ...data.features import FeatureShards
from ...infra import storage
from ...infra.console import console
from ...infra.dtypes import DTYPES
from ...model.anchors import default_gamma, sample_anchors
from ...model.drafter import IDENTITY_SCALES, DFlashDrafter
from ...model.flops import drafter_step_flops, peak_flops, visible_pairs
from ...model.optim import warmup_cosine
from ...run.loading import drafter_config_for, feature_buckets, load_tokenizer, target_config
from ...run.step import anchor_generator
from ...run.summary import steady_mfu, steady_step_ms


class PeerMissing(RuntimeError):
    """The peer's package (or a module it imports) is not installed: the message holds the install command."""


class PeerRefused(ValueError):
    """The peer's drafter differs from ours in a way our format cannot hold (or the target is one the peer's
    model does not serve as ours does): refused with the reason, never converted."""


def import_peer(dist: str, version: str, install: str, *modules: str) -> list:
    """The peer's modules, imported from its installed package; PeerMissing naming what is missing and the
    install command. Another installed version than `version` is said, not refused."""
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise PeerMissing(f"{dist} is not installed: install it (without its dependencies, which this run does "
                          f"not use) with: {install}") from None
    try:
        loaded = [importlib.import_module(name) for name in modules]
    except ImportError as exc:
        raise PeerMissing(f"{dist} {installed} is installed, but importing its modules failed ({exc}): install "
                          f"what they import with: {install}") from None
    if installed != version:
        console.print(f"warning: {dist} {installed} is installed; this adapter was written against {dist} {version} "
                      f"(its modules may have changed: {install})", markup=False, soft_wrap=True)
    return loaded


@dataclass
class PeerInputs:
    """What a peer's run reads: our run config, the dumped features, the target and our drafter's config."""

    cfg: RunConfig
    shards: FeatureShards
    target_config: object  # the target's transformers config
    drafter_config: object  # ours (a Qwen3Config in the published drafters' format): the shape every trainer trains
    device: torch.device
    dtype: torch.dtype  # train.dtype

    @property
    def per_step(self) -> int:
        """Micro-batches per optimizer step: what our run's drafter ranks take together (grad_accum each), here
        in one process: the same rows per step, the loss normalised over all of them as ours is."""
        return self.cfg.train.grad_accum * self.cfg.parallel.drafter_ranks

    @property
    def gamma(self) -> float:
        return self.cfg.drafter.gamma or default_gamma(self.cfg.drafter.block_size)


def load_inputs(cfg: RunConfig, device: torch.device) -> PeerInputs:
    """cfg with target.path and data.features_dir set. ConfigError (exit 2) where the dump does not fit the config,
    as our trainer refuses it (another target, other tapped layers, another micro-batch size)."""
    try:
        shards = FeatureShards(cfg.data.features_dir)
    except FileNotFoundError as exc:
        raise ConfigError(f"--features: {exc}") from None
    tconfig = target_config(cfg)
    tokenizer = load_tokenizer(cfg) if cfg.drafter.mask_token_id is None else None
    dconfig = drafter_config_for(cfg, tconfig, tokenizer)
    feature_buckets(cfg, shards, tconfig, dconfig.dflash_config["target_layer_ids"], lead=False, compiles=False)
    if cfg.train.epochs is not None:  # as our trainer derives them from dumped features (train.steps_from_epochs)
        cfg.train.steps = max(1, math.ceil(cfg.train.epochs * shards.count
                                           / (cfg.train.grad_accum * cfg.parallel.drafter_ranks)))
        console.print(f"train.epochs = {cfg.train.epochs:g}: {cfg.train.steps} steps ({shards.count} dumped "
                      "micro-batches)", soft_wrap=True)
    scales = {k: v for k, v in dconfig.dflash_config.items() if k in IDENTITY_SCALES}
    if scales:
        # Both peers embed the block with the target's embedding weights and compute logits with its head as plain
        # lookups and products (as their servers run the drafter): a target that scales them (Gemma's embedding
        # scale) trains the peer's drafter without the scale, so it is published without it.
        console.print(f"target {cfg.target.path} scales what the drafter borrows ({scales}); the peers' models apply "
                      "no such scale, so their drafters are trained and published without it", soft_wrap=True)
        dconfig.dflash_config = {k: v for k, v in dconfig.dflash_config.items() if k not in IDENTITY_SCALES}
    return PeerInputs(cfg, shards, tconfig, dconfig, device, DTYPES[cfg.train.dtype])


def step_micro_batches(inputs: PeerInputs) -> Iterator[tuple[list[dict[str, torch.Tensor]], float]]:
    """Per optimizer step, its micro-batches as our trainer reads them, and the model FLOPs our trainer counts
    for them: micro-batch i of the run is shard i mod count, step s takes i = s * P ... (s + 1) * P - 1
    (P = per_step: our drafter ranks share them out, rank r taking i = r mod ranks). The features come in
    train.dtype, as our trainer casts them."""
    per_step = inputs.per_step
    for step in range(inputs.cfg.train.steps):
        batches, flops = [], 0.0
        for i in range(step * per_step, (step + 1) * per_step):
            got = inputs.shards.load(i, inputs.device)
            got["features"] = got["features"].to(inputs.dtype)
            batches.append(got)
            flops += our_flops(inputs, got, i)
        yield batches, flops


def our_flops(inputs: PeerInputs, micro_batch: dict[str, torch.Tensor], index: int) -> float:
    """Model FLOPs of one micro-batch (forward and backward) as our trainer counts them (model/flops.py, the
    drafter's shape, the padded context), with the attention's visible pairs of the anchors our trainer draws
    for micro-batch `index`. A peer draws its own anchors by the same rule (the same count a row, kept where
    ours are kept), in other positions: its visible pairs differ by where the anchors fall, not by how many
    blocks there are (speculators spreads a step's anchors over the packed rows, not a fixed count a row)."""
    cfg, config = inputs.cfg, inputs.drafter_config
    loss_mask = micro_batch["loss_mask"]
    anchors, keep = sample_anchors(loss_mask, cfg.train.num_anchors,
                                   anchor_generator(cfg.train.seed, loss_mask.device, index))
    pairs = float(visible_pairs(anchors, keep, config.block_size))
    batch, ctx_len = micro_batch["features"].shape[:2]
    return drafter_step_flops(config, batch, ctx_len, cfg.train.num_anchors, pairs, config.vocab_size)


def our_schedule(optimizer: torch.optim.Optimizer, cfg: RunConfig):
    """Our trainer's schedule (model/optim.py: linear warm-up, cosine to min_lr_ratio), stepped after each
    optimizer step as ours is."""
    train = cfg.train
    return warmup_cosine(optimizer, train.steps, int(train.warmup_ratio * train.steps), train.min_lr_ratio)


def as_ours(drafter_config, state: dict[str, torch.Tensor], peer: str) -> DFlashDrafter:
    """The peer's trained parameters in our drafter: every name and shape must be one of ours and every one of ours
    must be there, else PeerRefused naming the difference (our format holds no other architecture)."""
    model = DFlashDrafter(drafter_config)
    ours = {k: v.shape for k, v in model.state_dict().items()}
    extra, missing = sorted(set(state) - set(ours)), sorted(set(ours) - set(state))
    shapes = [f"{k} {tuple(state[k].shape)} (ours {tuple(ours[k])})" for k in ours if k in state
              and state[k].shape != ours[k]]
    if extra or missing or shapes:
        raise PeerRefused(f"{peer}'s draft model differs from our format: " + "; ".join(
            part for part in (f"parameters our format has no place for: {extra}" if extra else "",
                              f"parameters it lacks: {missing}" if missing else "",
                              f"other shapes: {shapes}" if shapes else "") if part))
    model.load_state_dict({k: v.detach().float() for k, v in state.items()}, strict=True)
    return model


def publish(out: Path, drafter_config, state: dict[str, torch.Tensor], peer: str, dtype: torch.dtype) -> Path:
    """OUT/drafter: the peer's drafter in our format (what dflash-eval --drafter loads), in train.dtype."""
    return as_ours(drafter_config, state, peer).to(dtype).save_pretrained(out / "drafter")


class TrainClock:
    """Wall time of the training steps alone, step by step (a GPU's queued work waited for at each read), and
    the model FLOPs our trainer counts for each step (step_flops: what the adapter's loop appends)."""

    def __init__(self, device: torch.device):
        self.device, self.laps, self.step_flops = device, [], []

    @property
    def seconds(self) -> float:
        return sum(self.laps)

    def __enter__(self):
        self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.laps.append(time.perf_counter() - self._start)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def say_step(cfg: RunConfig, step: int, loss: float, clock: TrainClock) -> None:
    """A progress line every train.log_every steps and at the last, as our trainer prints them."""
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
        console.print(f"step {step}/{cfg.train.steps}: loss {loss:.4f}, {clock.laps[-1] * 1e3:.0f} ms", markup=False)


def write_summary(out: Path, summary: dict) -> Path:
    path = out / "summary.json"
    storage.write_text_atomic(path, json.dumps(summary, indent=2))
    return path


def summary_of(peer: str, dist: str, inputs: PeerInputs, losses: list[float], clock: TrainClock,
               tokens: list[int], out: Path, **settings) -> dict:
    """summary.json: the peer, its installed version, the run's shape and what it measured. tokens: the context
    tokens of each step; the steady rate leaves out the first step (its compiles and warm-up); the steady step
    time and MFU the first STEADY_AFTER steps, as our trainer's summary does (run/summary.py). MFU: our
    trainer's FLOP count for the same micro-batches (our_flops) over the peer's time, against the GPU's peak."""
    cfg, train_s = inputs.cfg, clock.seconds
    steady_s = sum(clock.laps[1:])
    peak = peak_flops(inputs.device)
    on_gpu = inputs.device.type == "cuda"
    return {
        "peer": peer, "package": dist, "package_version": importlib.metadata.version(dist),
        "steps": cfg.train.steps, "micro_batch": cfg.train.micro_batch, "micro_batches_per_step": inputs.per_step,
        "num_anchors": cfg.train.num_anchors, "block_size": cfg.drafter.block_size,
        "num_layers": cfg.drafter.num_layers, "lr": cfg.train.lr, "dtype": cfg.train.dtype, "seed": cfg.train.seed,
        "features_dir": str(cfg.data.features_dir), "target": cfg.target.path, "device": str(inputs.device),
        "train_s": round(train_s, 3), "first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
        "step_s": [round(t, 4) for t in clock.laps], "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / train_s if train_s > 0 else None,
        "steady_tokens_per_s": sum(tokens[1:]) / steady_s if steady_s > 0 else None,
        "model_flops": sum(clock.step_flops),  # our trainer's count for these micro-batches (our_flops)
        "mfu": sum(clock.step_flops) / train_s / peak if peak and train_s > 0 else None,
        "steady_step_ms": steady_step_ms(clock.laps),
        "steady_mfu": steady_mfu(clock.laps, clock.step_flops, peak),
        # after the training steps, as our trainer's summary reads it (None on a CPU)
        "peak_memory_gib": torch.cuda.max_memory_allocated(inputs.device) / 2**30 if on_gpu else None,
        "drafter_dir": str(out / "drafter"), **settings,
    }
