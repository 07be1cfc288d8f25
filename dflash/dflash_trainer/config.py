"""Run configuration: TOML sections mapped onto dataclasses; unknown keys are errors.

`--config embedded` is the bundled default (configs/embedded.toml): a tiny target and data that
the trainer builds itself. `--set section.key=value` overrides any field from the command line.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    pass


@dataclass
class TargetConfig:
    path: str = ""  # HF directory or hub id of the target; "embedded" builds the tiny one
    dtype: str = "bfloat16"


@dataclass
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None  # None: the tokenizer's mask token
    target_layer_ids: list[int] | None = None  # None: the published rule
    intermediate_size: int | None = None
    gamma: float | None = None  # None: 7 for B=16 (paper)
    init_from: str | None = None  # an existing drafter directory to continue from


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    max_length: int = 3072
    context_buckets: list[int] = field(default_factory=lambda: [512, 1024, 2048, 3072])
    num_proc: int | None = None
    features_dir: str | None = None  # offline mode: features dumped with --dump-features


@dataclass
class ParallelConfig:
    target_ranks: int = 0  # processes running the frozen target (torchrun --nproc-per-node = T + D)
    drafter_ranks: int = 1  # processes training the drafter
    drafter_sharding: str = "ddp"  # ddp: a full copy per drafter rank; fsdp: split across them (sharding.py)
    prefetch: int = 2  # micro-batches in flight per target -> drafter pair
    isolate_gpus: bool = True  # each worker sees its GPU as cuda:0: one compile cache for all ranks


@dataclass
class TrainConfig:
    steps: int = 1000
    micro_batch: int = 1
    grad_accum: int = 1
    num_anchors: int = 512
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    dtype: str = "bfloat16"  # drafter parameters; the optimizer keeps fp32 masters
    attention: str = "auto"  # auto: flex on CUDA, sdpa on CPU (flex has no CPU backward)
    loss_chunk_rows: int = 2048
    compile_layers: bool = True  # flex backend: compile each drafter layer whole (fused norms/RoPE/SwiGLU)
    log_every: int = 10
    checkpoint_every: int = 500  # steps; 0 disables checkpoints (the final drafter is always saved)
    keep_last: int = 3
    compile_cache_dir: str | None = None
    wandb_project: str | None = None  # W&B logging when wandb is installed (or set WANDB_PROJECT)


@dataclass
class EvalConfig:
    prompts: int = 16
    max_new_tokens: int = 128


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output_dir: str = "runs/default"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, values: dict, where: str):
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{where}]; known: {sorted(names)}")
    kwargs = {}
    for key, value in values.items():
        default = getattr(cls(), key)
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"[{where}.{key}] must be a table")
            kwargs[key] = _build(type(default), value, f"{where}.{key}" if where else key)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # bare strings need no quotes
    return key.strip().split("."), value


def load_config(source: str, overrides: list[str] = ()) -> RunConfig:
    path = CONFIG_DIR / f"{source}.toml" if (CONFIG_DIR / f"{source}.toml").is_file() else Path(source)
    if not path.is_file():
        bundled = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise ConfigError(f"config {source!r} not found: give a TOML file or one of {bundled}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    for text in overrides:
        keys, value = _parse_override(text)
        node = values
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    config = _build(RunConfig, values, "")
    validate(config)
    return config


def validate(c: RunConfig) -> None:
    problems = []
    if not c.target.path:
        problems.append("target.path is empty: give the target model directory (or 'embedded')")
    if c.drafter.block_size < 2:
        problems.append("drafter.block_size must be >= 2")
    if c.train.steps < 1 or c.train.micro_batch < 1 or c.train.grad_accum < 1 or c.train.num_anchors < 1:
        problems.append("train.steps, micro_batch, grad_accum and num_anchors must be >= 1")
    if c.train.attention not in ("auto", "flex", "sdpa"):
        problems.append(f"train.attention {c.train.attention!r}: use auto, flex or sdpa")
    if sorted(c.data.context_buckets) != c.data.context_buckets or not c.data.context_buckets:
        problems.append("data.context_buckets must be a non-empty ascending list")
    elif c.data.max_length > c.data.context_buckets[-1]:
        problems.append(f"data.max_length {c.data.max_length} exceeds the largest context bucket")
    if c.parallel.target_ranks < 0 or c.parallel.drafter_ranks < 1 or c.parallel.prefetch < 1:
        problems.append("parallel: target_ranks >= 0, drafter_ranks >= 1 and prefetch >= 1")
    if c.parallel.drafter_sharding not in ("ddp", "fsdp"):
        problems.append(f"parallel.drafter_sharding {c.parallel.drafter_sharding!r}: use ddp or fsdp")
    if c.target.path != "embedded" and not c.data.train and not c.data.features_dir:
        problems.append("data.train is empty: list JSONL files (or a hub dataset name)")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
