"""dflash-export: a published drafter in speculators' format, loaded by speculators' own model class (installed
for the test only), giving our logits; bad input refused with exit 2 and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dflash_trainer.export.cli import main
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.objective import sdpa_attention
from transformers import Qwen3Config, Qwen3ForCausalLM

TARGET = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# speculators 0.9.0 without its dependencies (the trainer's environment has torch, transformers, pydantic,
# datasets); what it imports that this environment lacks comes beside it.
SPECULATORS = ["speculators==0.9.0", "hs-connectors==0.9.0", "loguru==0.7.3"]


@pytest.fixture(scope="session")
def speculators(tmp_path_factory):
    """speculators installed into a directory of this test session only, from the configured package index."""
    where = tmp_path_factory.mktemp("speculators")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(where),
                           *SPECULATORS], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        pytest.skip(f"speculators could not be installed ({done.stderr.strip()[-300:]})")
    sys.path.append(str(where))  # after the environment's packages: it adds, never replaces, one of them
    try:
        from speculators.models.dflash import DFlashDraftModel
    except ImportError as exc:
        pytest.skip(f"speculators 0.9.0 does not import here ({exc})")
    return DFlashDraftModel


@pytest.fixture
def trained(tmp_path):
    """A target directory and a drafter directory against it (random weights)."""
    torch.manual_seed(0)
    Qwen3ForCausalLM(TARGET).save_pretrained(tmp_path / "target")
    drafter = DFlashDrafter(drafter_config(TARGET, DrafterShape(num_layers=2, block_size=4, mask_token_id=7)))
    drafter.save_pretrained(tmp_path / "drafter")
    return tmp_path, drafter


@pytest.mark.slow
def test_speculators_loads_the_export_and_gives_our_logits(trained, speculators):
    root, ours = trained
    assert main(["--format", "speculators", str(root / "drafter"), str(root / "out"),
                 "--target", str(root / "target")]) == 0
    theirs = speculators.from_pretrained(str(root / "out")).eval()
    assert type(theirs).__name__ == "DFlashDraftModel" and theirs.block_size == 4 and theirs.mask_token_id == 7
    assert theirs.target_layer_ids == [2, 6]  # speculators index hidden_states: our ids [1, 5] + 1
    theirs.config.transformer_layer_config._attn_implementation = "sdpa"  # CPU: no flex attention
    target = Qwen3ForCausalLM.from_pretrained(root / "target").eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 10, 2 * 64, generator=g)
    block = torch.tensor([[42, 7, 7, 7]])
    pos = torch.arange(14)[None]
    with torch.no_grad():
        embeds = target.get_input_embeddings()(block)
        want = ours.logits(ours(feats, embeds, pos, sdpa_attention(None)), target.lm_head.weight)
        hidden = theirs.embed_tokens(block)
        context = theirs.hidden_norm(theirs.fc(feats))
        rope = theirs.rotary_emb(feats, pos)
        for layer in theirs.layers:
            hidden = layer(hidden_states=hidden, target_hidden=context, attention_mask=None, position_ids=pos,
                           position_embeddings=rope)
        got = theirs.lm_head(theirs.norm(hidden))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_export_is_speculators_config_with_the_body_weights(trained):
    root, _ = trained
    assert main(["--format", "speculators", str(root / "drafter"), str(root / "out"),
                 "--target", str(root / "target")]) == 0
    cfg = json.loads((root / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [2, 6]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": str(root / "target"),
                                                     "architectures": ["Qwen3ForCausalLM"]}
    assert sorted(p.name for p in (root / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_a_run_drafter_exports_against_the_runs_target(trained):
    root, _ = trained
    (root / "config.json").write_text(json.dumps({"target": {"path": "target"}}))  # a run's stored config
    assert main(["--format", "speculators", str(root / "drafter"), str(root / "out")]) == 0
    cfg = json.loads((root / "out" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(root / "target")


@pytest.mark.parametrize("problem", ["no-target", "not-a-drafter", "scaled", "other-target", "bad-format", "dflash2"])
def test_bad_input_is_refused_and_nothing_written(trained, problem, capsys):
    root, _ = trained
    args = ["--format", "speculators", str(root / "drafter"), str(root / "out"), "--target", str(root / "target")]
    expect = {"no-target": "give --target", "not-a-drafter": "not a DFlash drafter",
              "scaled": "no key for", "other-target": "differs from --target", "bad-format": "invalid choice",
              "dflash2": "is a DFlash 2 drafter"}[problem]
    if problem == "no-target":
        args = args[:4]
    elif problem == "not-a-drafter":
        args[2] = str(root / "target")
    elif problem == "scaled":
        scaled = drafter_config(TARGET, DrafterShape(num_layers=2, block_size=4, mask_token_id=7),
                                {"input_embedding_scale": 8.0, "output_multiplier": 1.0,
                                 "final_logit_softcapping": None})
        DFlashDrafter(scaled).save_pretrained(root / "drafter")
    elif problem == "other-target":
        Qwen3Config(**{**TARGET.to_dict(), "hidden_size": 32}).save_pretrained(root / "t2")
        args[-1] = str(root / "t2")
    elif problem == "dflash2":
        DFlashDrafter(drafter_config(TARGET, DrafterShape(num_layers=2, block_size=4, mask_token_id=7, kind="dflash2",
                                                          selector_rank=8, selector_top_k=5))).save_pretrained(
            root / "drafter")
    else:
        args[1] = "dspark"
    assert main(args) == 2
    assert expect in " ".join(capsys.readouterr().err.split())
    assert not (root / "out").exists()
