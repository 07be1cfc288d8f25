"""Shared pytest fixtures."""

import pytest


# --- Proxmox VE test host (tests/pve_testhost, issue 5) -----------------------------------------
@pytest.fixture(scope="session")
def pve_host(tmp_path_factory):
    """A PVE node stand-in: HTTPS API, real LXC containers, SSH with pct (see tests/pve_testhost/README.md)."""
    from tests.pve_testhost.fixture import pve_host_session

    yield from pve_host_session(tmp_path_factory.mktemp("pve-testhost"))


# --- Trainer (dflash/) ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random Qwen3 target with the project's tokenizer, and chat JSONL from the bundled corpus."""
    import json

    import torch
    from dflash_trainer.tiny import TARGET_SHAPE, build_tokenizer, read_corpus
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("tiny-target")
    conversations = read_corpus()
    tokenizer = build_tokenizer([m["content"] for c in conversations for m in c])
    torch.manual_seed(0)
    shape = dict(TARGET_SHAPE, hidden_size=64, intermediate_size=128, head_dim=16)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), **shape))
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    for name, rows in (("train", conversations[:96]), ("eval", conversations[96:104])):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"messages": c}) + "\n" for c in rows)
    return {"target": str(root / "target"), "train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl")}
