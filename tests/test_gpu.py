"""GPU checks (run through the device tool; skipped without CUDA): flex == dense reference with
gradients, and the embedded default trained with compiled flex after the serialized compile step."""

import json

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_flex_equals_dense_reference_forward_and_backward_on_gpu():
    from dflash_trainer.anchors import build_blocks, sample_anchors
    from dflash_trainer.mask import dflash_block_mask
    from dflash_trainer.model import DFlashDrafter, DrafterShape, drafter_config
    from dflash_trainer.objective import block_attention
    from transformers import Qwen3Config

    torch.manual_seed(0)
    dev = torch.device("cuda")
    tc = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = DFlashDrafter(drafter_config(tc, DrafterShape(num_layers=2, block_size=16, mask_token_id=3))).to(dev)
    S = 384  # not a multiple of the 128 tile once the blocks are appended (384 + 24*16)
    lm = (torch.rand(2, S, device=dev) < 0.8).to(torch.uint8)
    anchors, keep = sample_anchors(lm, 24)
    ids = torch.randint(256, (2, S), device=dev)
    blocks = build_blocks(ids, lm, anchors, keep, 16, 3)
    feats = torch.randn(2, S, 2 * 128, device=dev)
    x = F.embedding(blocks.token_ids, torch.randn(256, 128, device=dev))
    pos = torch.cat([torch.arange(S, device=dev).expand(2, -1), blocks.position_ids], 1)
    grads = []
    outs = []
    for backend in ("sdpa", "flex"):
        model.zero_grad()
        attn = block_attention(backend, blocks, S, 16, model.config,
                               lambda a, k, s: dflash_block_mask(a, k, 16, s))
        out = model(feats, x, pos, attn)
        (out.float().square() * blocks.weights.unsqueeze(-1)).sum().backward()
        outs.append(out.detach())
        grads.append(model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-3)


def test_embedded_default_trains_with_compiled_flex(tmp_path):
    from dflash_trainer.config import load_config
    from dflash_trainer.train import run

    cfg = load_config("embedded", [f"output_dir={tmp_path}", "train.steps=40", "train.dtype=bfloat16",
                                   "target.dtype=bfloat16"])
    summary = run(cfg)
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["tau_after"] > summary["tau_before"]
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}))
