"""Drafter model: published layer-id rule, HF directory format, round trip, z-lab's loader."""

import json

import pytest
import torch
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, build_target_layer_ids, drafter_config
from dflash_trainer.model.objective import sdpa_attention
from transformers import Qwen3Config

TINY_TARGET = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_layer_ids_follow_the_published_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B drafter
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B drafter
    assert build_target_layer_ids(36, 1) == [18]
    with pytest.raises(ValueError, match="at least 4"):
        build_target_layer_ids(3, 2)


def test_bad_mask_token_is_refused():
    with pytest.raises(ValueError, match="mask_token_id 300 is not a row"):
        drafter_config(TINY_TARGET, DrafterShape(num_layers=2, mask_token_id=300))


def _drafter(seed=0):
    torch.manual_seed(seed)
    return DFlashDrafter(drafter_config(TINY_TARGET, DrafterShape(num_layers=2, block_size=4, mask_token_id=7)))


def test_saved_directory_has_the_published_format(tmp_path):
    _drafter().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 5]}
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in keys)  # draft-only keys


def _inputs(b=2, ctx=10, q=4, h=64, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, ctx, k * h, generator=g)
    emb = torch.randn(b, q, h, generator=g)
    pos = torch.cat([torch.arange(ctx), torch.arange(ctx, ctx + q)]).expand(b, -1)
    return feats, emb, pos


def test_round_trip_gives_identical_outputs(tmp_path):
    model = _drafter()
    model.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    feats, emb, pos = _inputs()
    attn = sdpa_attention(None)
    torch.testing.assert_close(model(feats, emb, pos, attn), loaded(feats, emb, pos, attn), rtol=0, atol=0)


def test_loading_a_non_drafter_directory_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_zlab_dflash_package_loads_our_directory_and_agrees(tmp_path):
    """z-lab's `dflash` (PyPI) loads the directory; its forward equals ours (no import-name clash)."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is installed by `make venv`")
    import dflash_trainer

    assert dflash_trainer.__name__ != "dflash"
    model = _drafter()
    model.save_pretrained(tmp_path)
    theirs = zlab.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert theirs.target_layer_ids == [1, 5] and theirs.block_size == 4 and theirs.mask_token_id == 7
    feats, emb, pos = _inputs(b=1)
    ours = model(feats, emb, pos, sdpa_attention(None))
    torch.testing.assert_close(theirs(position_ids=pos, noise_embedding=emb, target_hidden=feats), ours,
                               rtol=1e-4, atol=1e-5)


def test_rope_stays_exact_float32_in_a_bf16_drafter(tmp_path):
    """Serving engines compute RoPE's inverse frequencies in float32 from rope_theta; a bf16 cast of the
    buffer rounded them by up to 0.4% (radians of phase at a distance of 500 tokens)."""
    import torch
    from transformers import Qwen3Config

    tc = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    config = drafter_config(tc, DrafterShape(num_layers=1, block_size=16, mask_token_id=1))
    exact = DFlashDrafter(config).rotary_emb.inv_freq.clone()
    drafter = DFlashDrafter.initialised(config, "cpu", 0).to(torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert torch.equal(drafter.rotary_emb.inv_freq, exact)
    drafter.save_pretrained(tmp_path / "d")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d", dtype=torch.bfloat16)
    assert torch.equal(loaded.rotary_emb.inv_freq, exact)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    cos, _ = loaded.rotary_emb(x, torch.tensor([[1000]]))
    want = torch.cos(1000 * exact).to(torch.bfloat16)
    assert torch.equal(cos[0, 0, :128], want)


def test_automodel_with_trust_remote_code_builds_the_drafter_and_gives_our_outputs(tmp_path):
    """A hub user's `AutoModel.from_pretrained(dir, trust_remote_code=True)` builds the drafter class shipped
    beside the weights (not a plain Qwen3Model), every weight loaded, our hidden states and logits, including
    a Gemma-like target's embedding scale, logit multiplier and softcap."""
    from transformers import AutoModel

    borrowed = {"input_embedding_scale": 8.0, "output_multiplier": 0.5, "final_logit_softcapping": 30.0}
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_config(TINY_TARGET, DrafterShape(num_layers=2, block_size=4, mask_token_id=7),
                                         borrowed))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model.float().save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"} and cfg["dtype"] == "float32"
    assert cfg["logit_scale"] == 0.5  # the key vLLM's DFlash model reads for the logit multiplier
    hub, info = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True, dtype="auto",
                                          output_loading_info=True)
    assert type(hub).__name__ == "DFlashDraftModel" and hub.dtype == torch.float32
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert hub.target_layer_ids == [1, 5] and hub.block_size == 4 and hub.mask_token_id == 7
    feats, emb, pos = _inputs()
    with torch.no_grad():
        ours = model(feats, emb, pos, sdpa_attention(None))
        theirs = hub(target_hidden=feats, noise_embedding=emb, position_ids=pos)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        head = torch.randn(300, 64)
        torch.testing.assert_close(hub.compute_logits(theirs, head), model.logits(ours, head), rtol=1e-5, atol=1e-5)


def test_published_weights_are_readable_by_other_users(tmp_path):
    import os

    _drafter().save_pretrained(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "model.safetensors", "modeling_dflash.py"):
        assert oct((tmp_path / name).stat().st_mode & 0o777) == oct(0o666 & ~umask), name


@pytest.mark.parametrize("setting, scale", [("target", 32 ** 0.5), ("none", 1.0)])
def test_drafter_embedding_scale_follows_the_target_or_none(setting, scale):
    """drafter.embedding_scale = none: the block's embeddings unscaled (as vLLM and SGLang serve a drafter), the
    logit scales still the target's; target: Gemma's sqrt(hidden), written to the drafter's config."""
    from dflash_trainer.config import RunConfig
    from dflash_trainer.run.loading import drafter_config_for
    from transformers import Gemma3TextConfig

    target = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              final_logit_softcapping=30.0)
    cfg = RunConfig()
    cfg.drafter.num_layers, cfg.drafter.block_size, cfg.drafter.mask_token_id = 1, 4, 3
    cfg.drafter.embedding_scale = setting
    dconfig = drafter_config_for(cfg, target, tokenizer=None)
    drafter = DFlashDrafter(dconfig)
    assert drafter.input_embedding_scale == pytest.approx(scale)
    assert ("input_embedding_scale" in dconfig.dflash_config) == (setting == "target")
    assert dconfig.dflash_config["final_logit_softcapping"] == 30.0
