"""What an export reads: a published drafter directory and its target's config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig


class ExportError(ValueError):
    """The input cannot be exported as asked: the message names the problem and the fix (exit 2)."""


@dataclass(frozen=True)
class Drafter:
    """A published drafter directory (model/drafter.py's format) read back: config.json and its weights file."""

    directory: Path
    config: dict
    weights: Path


def read_drafter(directory: Path) -> Drafter:
    config_file, weights = directory / "config.json", directory / "model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise ExportError(f"{directory} has no config.json and model.safetensors: give a drafter directory, a "
                          "training run's OUTPUT/drafter or a checkpoint OUTPUT/checkpoints/step-N")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ExportError(f"{config_file} cannot be read ({exc}): copy it again from where it came from") from None
    dflash = config.get("dflash_config") if isinstance(config, dict) else None
    if not isinstance(dflash, dict) or dflash.get("target_layer_ids") is None or config.get("block_size") is None:
        raise ExportError(f"{config_file} is not a DFlash drafter's (it needs dflash_config.target_layer_ids and "
                          "block_size): give the drafter directory, not the target or the run directory")
    return Drafter(directory, config, weights)


def target_config(target: str) -> dict:
    """The target's config.json as a dict (a local directory or a hub id)."""
    try:
        config, _ = PretrainedConfig.get_config_dict(target)
    except (OSError, ValueError) as exc:
        raise ExportError(f"--target {target}: no config.json could be read there ({exc}). Give the target's "
                          "directory or hub id, the one the drafter was trained against") from None
    return config.get("text_config") or config
