"""The frozen target's features: the tapped forward (layer by layer, causal mask only) equals the model's
own forward with an attention mask, on right-padded batches, and equals HF's hidden_states[l + 1]."""

import pytest
import torch
from dflash_trainer.target.frozen import FrozenTarget, tapped_forward_supported
from transformers import AutoModelForCausalLM


def test_tapped_forward_matches_the_hooked_forward_and_hf_hidden_states(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], attn_implementation="sdpa")
    ids = [1, 4, 3]  # not sorted: features follow the given order, the forward stops after layer 4
    target = FrozenTarget(model, ids)
    assert target.tapped and not target.compile_layers  # CPU: the layers run eagerly
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(model.config.vocab_size, (2, 40), generator=gen)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0  # the second row is right-padded, as data.collate pads
    tapped = target.features(input_ids, mask)
    hooked, _ = target._hooked_features(input_ids, mask, False)  # (features, no final state)
    torch.testing.assert_close(tapped[0], hooked[0])
    torch.testing.assert_close(tapped[1, :25], hooked[1, :25])  # real tokens; padding is never read
    with torch.no_grad():
        hidden = model(input_ids[:1], output_hidden_states=True).hidden_states
    torch.testing.assert_close(tapped[:1], torch.cat([hidden[i + 1] for i in ids], dim=-1))


def test_eager_attention_or_sliding_windows_take_the_hooked_forward(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], attn_implementation="eager")
    assert not tapped_forward_supported(model, model.model)  # no mask would mean no causal mask at all
    assert not FrozenTarget(model, [1]).tapped
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_target["target"], attn_implementation="sdpa")
    sdpa.config.layer_types = ["sliding_attention"] + sdpa.config.layer_types[1:]
    assert not tapped_forward_supported(sdpa, sdpa.model)


def test_compiled_layers_trace_after_transformers_installed_its_capture_hooks(tiny_target):
    """transformers hooks every submodule at the first forward that captures outputs (evaluation asks
    for hidden_states); those hooks cannot be traced, so the tapped forward suspends them."""
    import torch._dynamo
    from dflash_trainer.target.frozen import call_target_layer, hooks_suspended

    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], attn_implementation="sdpa")
    ids = torch.randint(model.config.vocab_size, (1, 16))
    with torch.no_grad():
        model(ids, output_hidden_states=True)  # installs the capture hooks
    layer = model.model.layers[0]
    assert any(m._forward_hooks for m in layer.modules())
    hidden = model.model.embed_tokens(ids)
    position_ids = torch.arange(16).unsqueeze(0)
    rope = model.model.rotary_emb(hidden, position_ids)
    torch._dynamo.reset()
    compiled = torch.compile(call_target_layer, backend="eager", fullgraph=True)
    with torch.no_grad(), hooks_suspended(layer):
        out = compiled(layer, hidden, rope, position_ids)
    assert any(m._forward_hooks for m in layer.modules())  # restored
    with torch.no_grad():
        torch.testing.assert_close(out, call_target_layer(layer, hidden, rope, position_ids))


def test_the_embedding_and_head_are_read_in_the_background_and_equal_the_target(tiny_target, tmp_path):
    """A drafter rank's borrowed weights: the tensors exist at once, hold the target's values after wait()
    (cast to the asked dtype); tied embeddings give one tensor; a missing tensor fails before any read."""
    import json
    import shutil

    from dflash_trainer.config import ConfigError
    from dflash_trainer.target.frozen import load_embed_and_head
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"])
    borrowed = load_embed_and_head(tiny_target["target"], "cpu", torch.bfloat16)
    assert borrowed.embed.dtype == torch.bfloat16 and borrowed.embed.shape == model.model.embed_tokens.weight.shape
    borrowed.wait()
    assert torch.equal(borrowed.embed, model.model.embed_tokens.weight.detach().bfloat16())
    assert torch.equal(borrowed.head, model.lm_head.weight.detach().bfloat16())

    tied = tmp_path / "tied"
    shutil.copytree(tiny_target["target"], tied)
    state = load_file(tied / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tied / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    borrowed = load_embed_and_head(str(tied), "cpu", torch.float32)
    borrowed.wait()
    assert borrowed.head is borrowed.embed
    assert torch.equal(borrowed.embed, model.model.embed_tokens.weight.detach())

    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ConfigError, match="lm_head.weight"):
        load_embed_and_head(str(tied), "cpu", torch.float32)
    (tied / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="model.safetensors.index.json is damaged"):
        load_embed_and_head(str(tied), "cpu", torch.float32)


def test_a_failed_background_read_is_raised_by_wait(tmp_path):
    from dflash_trainer.target.frozen import BorrowedWeights

    t = torch.empty(4)
    borrowed = BorrowedWeights(t, t, [(t, str(tmp_path / "gone.safetensors"), "w")])
    with pytest.raises(RuntimeError, match="embedding and LM head"):
        borrowed.wait()
