"""Offline mode: target features dumped once to sharded safetensors files, read back by drafters.

For users with one GPU (run the target, then the drafter, in turn) and for many epochs over the
same data: anchors are drawn anew every step, so each epoch over the same features still trains on
new blocks. One file per micro-batch (`mb-00000042.safetensors`) plus `meta.json` naming the
target and its tapped layers, checked against the drafter before training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..infra import storage

META = "meta.json"
# The shard key of the target's final normed hidden states, [b, S, H]: dumped only for a loss that reads the
# target's distribution (train.loss_kl, train.loss_tv); meta.json says whether a dump holds them.
TARGET_HIDDEN = "target_hidden"


def shard_path(root: Path, index: int) -> Path:
    return Path(root) / f"mb-{index:08d}.safetensors"


# What identifies the target whose features a dump holds (its path may move): checked before training on them.
TARGET_FINGERPRINT = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")


def target_fingerprint(text_config) -> dict:
    return {k: getattr(text_config, k, None) for k in TARGET_FINGERPRINT}


def write_meta(root: Path, target: str, layer_ids: list[int], count: int, micro_batch: int,
               quantization: str = "none", fingerprint: dict | None = None, target_hidden: bool = False) -> None:
    meta = {"target": target, "target_layer_ids": layer_ids, "micro_batches": count, "micro_batch": micro_batch,
            "target_quantization": quantization, "target_config": fingerprint, TARGET_HIDDEN: target_hidden}
    with _explained(root):
        root.mkdir(parents=True, exist_ok=True)
        storage.write_text_atomic(root / META, json.dumps(meta, indent=2))


def write_shard(root: Path, index: int, batch: dict[str, torch.Tensor]) -> None:
    tensors = {k: v.contiguous().cpu() for k, v in batch.items()}
    with _explained(root):
        Path(root).mkdir(parents=True, exist_ok=True)
        # a reader never sees half a shard, and a failed write leaves none behind
        storage.publish_file(shard_path(root, index), lambda tmp: save_file(tensors, str(tmp)))


def _explained(root: Path):
    return storage.explained(f"writing features to {root}", Path(root),
                             "Free space (or give another --dump-features directory) and dump again")


class FeatureShards:
    """Micro-batch i of the training stream is shard i mod count (epochs over the same features)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        meta_path = self.root / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} not found: dump features first with --dump-features {root}")
        self.meta = json.loads(meta_path.read_text())
        self.count = int(self.meta["micro_batches"])
        missing = [i for i in range(self.count) if not shard_path(self.root, i).is_file()]
        if missing:
            raise FileNotFoundError(f"{root}: {len(missing)} of {self.count} shards missing (first: "
                                    f"{shard_path(self.root, missing[0]).name}); the dump did not finish")

    @property
    def has_target_hidden(self) -> bool:
        """The shards hold the target's final hidden states (TARGET_HIDDEN)."""
        return bool(self.meta.get(TARGET_HIDDEN))

    def shapes(self) -> set[tuple[int, int, int]]:
        """The (rows, context length, feature width) of every micro-batch, from the shards' headers (no tensor
        is read): the shapes a drafter step takes on these features."""
        shapes = set()
        for i in range(self.count):
            with safe_open(shard_path(self.root, i), "pt") as f:
                rows, length, width = f.get_slice("features").get_shape()
                shapes.add((int(rows), int(length), int(width)))
        return shapes

    def load(self, index: int, device) -> dict[str, torch.Tensor]:
        tensors = load_file(shard_path(self.root, index % self.count))
        if torch.device(device).type == "cuda":  # a copy from pageable memory would wait for the GPU
            tensors = {k: v.pin_memory() for k, v in tensors.items()}
        return {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
