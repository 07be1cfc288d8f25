"""MasterWeightAdamW: the same update as clip_grad_norm_ + AdamW on fp32 copies, without the extra passes."""

import pytest
import torch
from dflash_trainer.optim import MasterWeightAdamW


def reference_step(params_fp32, grads, scale, max_norm, opt):
    for p, g in zip(params_fp32, grads):
        p.grad = g.float() * scale
    norm = torch.nn.utils.clip_grad_norm_(params_fp32, max_norm)
    opt.step()
    return norm


@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["clipped", "not-clipped"])
def test_update_equals_clip_then_adamw_on_fp32_masters(max_norm):
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5)]
    init = [torch.randn(s, generator=g) for s in shapes]
    model = [torch.nn.Parameter(t.bfloat16()) for t in init]
    model.append(torch.nn.Parameter(torch.randn(6, generator=g)))  # an fp32 parameter is its own master
    ref = [t.bfloat16().float().clone().requires_grad_() for t in init] + [model[-1].detach().clone().requires_grad_()]
    opt = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, max_grad_norm=max_norm)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) * 10 for p in model]
        for p, gr in zip(model, grads):
            p.grad = gr.clone()
        scale = torch.tensor(0.25 * (step + 1))
        norm = opt.step(scale)
        opt.zero_grad()
        ref_norm = reference_step(ref, grads, scale, max_norm, ref_opt)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-3, atol=1e-6)
        for m, r in zip(opt.master, ref):
            torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-6)
        for p, m in zip(model, opt.master):
            assert p.dtype in (torch.bfloat16, torch.float32) and torch.equal(p.detach(), m.detach().to(p.dtype))
        assert all(p.grad is None for p in model)


def test_parameters_without_gradients_are_left_alone():
    a, b = torch.nn.Parameter(torch.ones(3).bfloat16()), torch.nn.Parameter(torch.ones(2).bfloat16())
    opt = MasterWeightAdamW([a, b], lr=0.1)
    a.grad = torch.ones(3).bfloat16()
    opt.step()
    assert not torch.equal(a.detach(), torch.ones(3).bfloat16()) and torch.equal(b.detach(), torch.ones(2).bfloat16())
    opt.zero_grad()
    assert opt.step().item() == 0.0  # nothing to do
