"""Test helpers for regeneration: the embedded default's trained tiny target, source files, shard readers,
and the reference every engine must match (`model.generate` on each prompt alone)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from filelock import FileLock

CORPUS = Path(__file__).resolve().parents[2] / "dflash" / "dflash_trainer" / "assets" / "tiny_chat.jsonl"


def chat_target(tmp_path_factory) -> dict:
    """The embedded default's target (trained on the corpus, so its answers end at <|im_end|>), built once
    per session and shared by the test modules that need it."""
    from dflash_trainer.embedded import build_embedded

    # DFLASH_TEST_CHAT_TARGET: a directory to keep it in across sessions (local reruns; CI builds it fresh)
    root = Path(os.environ.get("DFLASH_TEST_CHAT_TARGET") or tmp_path_factory.getbasetemp() / "regen-chat-target")
    with FileLock(str(root) + ".lock"):
        return build_embedded(root)


def corpus_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines()[:n]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shard_rows(out: Path) -> list[dict]:
    rows = []
    for shard in sorted(Path(out).glob("part-*.jsonl")):
        rows += [json.loads(line) for line in shard.read_text().splitlines()]
    return rows


def shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(out).glob("part-*.jsonl"))}


def split_row(row: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a single-answer row."""
    first = row["loss_mask"].index(1)
    assert all(row["loss_mask"][first:]), "one answer: the mask is 1 from its first token to the end"
    return row["input_ids"][:first], row["input_ids"][first:]


@torch.no_grad()
def greedy_alone(model, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """The target's own greedy answer to one prompt (no batch, no padding, its dynamic cache)."""
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stop_ids, pad_token_id=stop_ids[0])
    answer = out[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(answer) if t in stop_ids), None)
    return answer if cut is None else answer[: cut + 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def regenerate_cli(args: list[str], timeout: int = 600, env: dict | None = None,
                   torchrun: int | None = None) -> subprocess.CompletedProcess:
    """dflash-regenerate in a process of its own (python -m, or torchrun with `torchrun` processes)."""
    cmd = [sys.executable, "-m"]
    if torchrun:
        cmd += ["torch.distributed.run", f"--nproc-per-node={torchrun}", f"--master-port={free_port()}", "-m"]
    cmd += ["dflash_trainer.regenerate", *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False)
