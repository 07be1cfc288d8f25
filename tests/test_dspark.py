"""DSpark (drafter.kind = "dspark"): the Markov and confidence heads, their export in speculators' DSpark format
loaded by speculators' own DSparkDraftModel with equal logits, Markov bias and confidence, and drafting along
the block with the token drafted before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dflash_trainer.export.cli import main as export_main
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.objective import sdpa_attention
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.test_export import SPECULATORS

TARGET = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def dspark(head_type="vanilla", with_markov=True, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_config(TARGET, DrafterShape(
        num_layers=2, block_size=4, mask_token_id=7, kind="dspark", markov_rank=8, markov_head_type=head_type,
        confidence_head_with_markov=with_markov)))
    with torch.no_grad():  # a Markov bias large enough to change the drafts
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
        drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
    return drafter


@pytest.fixture(scope="session")
def speculators_dspark(tmp_path_factory):
    """speculators installed into a directory of this test session only, from the configured package index."""
    where = tmp_path_factory.mktemp("speculators")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(where),
                           *SPECULATORS], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        pytest.skip(f"speculators could not be installed ({done.stderr.strip()[-300:]})")
    sys.path.append(str(where))
    try:
        from speculators.models.dspark import DSparkDraftModel
    except ImportError as exc:
        pytest.skip(f"speculators 0.9.0 does not import here ({exc})")
    return DSparkDraftModel


@pytest.mark.slow
@pytest.mark.parametrize(("head_type", "with_markov"), [("vanilla", True), ("gated", False), ("rnn", True)])
def test_speculators_dspark_loads_the_export_with_equal_outputs(tmp_path, speculators_dspark, head_type,
                                                                 with_markov):
    ours = dspark(head_type, with_markov).eval()
    Qwen3ForCausalLM(TARGET).save_pretrained(tmp_path / "target")
    ours.save_pretrained(tmp_path / "drafter")
    assert export_main(["--format", "speculators", str(tmp_path / "drafter"), str(tmp_path / "out"),
                        "--target", str(tmp_path / "target")]) == 0
    theirs = speculators_dspark.from_pretrained(str(tmp_path / "out")).eval()
    assert type(theirs).__name__ == "DSparkDraftModel" and not theirs.config.sample_from_anchor
    assert theirs.config.markov_head_type == head_type and theirs.markov_head.markov_rank == 8
    theirs.config.transformer_layer_config._attn_implementation = "sdpa"  # CPU: no flex attention
    target = Qwen3ForCausalLM.from_pretrained(tmp_path / "target").eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 10, 2 * 64, generator=g)
    block = torch.tensor([[42, 7, 7, 7]])
    previous = torch.tensor([[42, 42, 11, 12]])  # each slot's previous block token (slot 1: the anchor)
    pos = torch.arange(14)[None]
    with torch.no_grad():
        hidden = ours(feats, target.get_input_embeddings()(block), pos, sdpa_attention(None))
        want_logits, want_confidence = ours.block_outputs(hidden, previous, target.lm_head.weight)
        x = theirs.embed_tokens(block)
        context = theirs.hidden_norm(theirs.fc(feats))
        rope = theirs.rotary_emb(feats, pos)
        for layer in theirs.layers:
            x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_ids=pos,
                      position_embeddings=rope)
        their_hidden = theirs.norm(x)
        bias = theirs.markov_head.block_bias(prev_token_ids=previous, hidden_states=their_hidden)
        got_logits = theirs.lm_head(their_hidden) + bias
        prev_emb = theirs.markov_head.prev_embeddings(previous)
        got_confidence = theirs.confidence_head(torch.cat([their_hidden, prev_emb], -1) if with_markov
                                                else their_hidden)
    torch.testing.assert_close(their_hidden, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias, want_logits - ours.logits(hidden, target.lm_head.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_confidence, want_confidence, rtol=1e-5, atol=1e-5)


def test_the_export_is_speculators_dspark_config_with_every_weight(tmp_path):
    ours = dspark("gated")
    Qwen3ForCausalLM(TARGET).save_pretrained(tmp_path / "target")
    ours.save_pretrained(tmp_path / "drafter")
    assert export_main(["--format", "speculators", str(tmp_path / "drafter"), str(tmp_path / "out"),
                        "--target", str(tmp_path / "target")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkDraftModel"]
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["confidence_head_with_markov"]) == (8, "gated", True)
    assert cfg["sample_from_anchor"] is False and cfg["speculators_config"]["algorithm"] == "dspark"
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(ours.state_dict())


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_propose_biases_each_slot_by_the_token_drafted_before(tmp_path, head_type):
    drafter = dspark(head_type).eval()
    drafter.save_pretrained(tmp_path / "d")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d")
    assert loaded.kind == "dspark" and loaded.markov_head.head_type == head_type
    g = torch.Generator().manual_seed(2)
    hidden, head = torch.randn(2, 3, 64, generator=g), torch.randn(300, 64, generator=g) * 0.1
    anchors = torch.tensor([5, 9])
    with torch.no_grad():
        tokens, q = loaded.propose(hidden, anchors, head)
        # Teacher-forced with its own drafts as the previous tokens, the block's logits pick the same drafts.
        previous = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
        logits, _ = loaded.block_outputs(hidden, previous, head)
        plain = loaded.logits(hidden, head).argmax(-1)
        noise = torch.empty(2, 3, 300).exponential_(generator=g)
        sampled, probs = loaded.propose(hidden, anchors, head, torch.tensor(0.7), noise)
    assert q is None and torch.equal(tokens, logits.argmax(-1))
    assert not torch.equal(tokens, plain)  # the bias changed some draft
    previous = torch.cat([anchors[:, None], sampled[:, :-1]], 1)
    torch.testing.assert_close(probs, torch.softmax(loaded.block_outputs(hidden, previous, head)[0] / 0.7, -1))
    assert torch.equal(sampled, (probs / noise).argmax(-1))
