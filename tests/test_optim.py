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


@pytest.mark.parametrize("one_pass", [False, True], ids=["cast-then-adamw", "one-pass"])
@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["clipped", "not-clipped"])
def test_update_equals_clip_then_adamw_on_fp32_masters(max_norm, one_pass):
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5)]
    init = [torch.randn(s, generator=g) for s in shapes]
    model = [torch.nn.Parameter(t.bfloat16()) for t in init]
    if not one_pass:  # one-pass mode takes one low-precision dtype only
        model.append(torch.nn.Parameter(torch.randn(6, generator=g)))  # an fp32 parameter is its own master
    ref = [t.bfloat16().float().clone().requires_grad_() for t in init] + [
        p.detach().clone().requires_grad_() for p in model[len(init):]]
    opt = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, max_grad_norm=max_norm, one_pass=one_pass)
    assert opt.one_pass == one_pass
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


def test_one_pass_state_is_torch_adamw_state():
    """Checkpoints move between the two modes: the one-pass state is AdamW's own, step for step."""
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g).bfloat16() for s in [(5, 3), (7,)]]
    grads = [[torch.randn(t.shape, generator=g).bfloat16() for t in init] for _ in range(4)]

    def run(modes):
        model = [torch.nn.Parameter(t.clone()) for t in init]
        opt = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, one_pass=modes[0])
        for i, gr in enumerate(grads):
            if i == 2:  # switch mode through a state_dict, as a resume on another machine would
                state = opt.state_dict()
                opt = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, one_pass=modes[1])
                opt.load_state_dict(state)
            for p, x in zip(model, gr):
                p.grad = x.clone()
            opt.step(0.5)
            opt.zero_grad()
        return opt

    one, other = run((True, False)), run((False, True))
    for a, b in zip(one.master, other.master):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert [s["step"].item() for s in other.opt.state.values()] == [4.0, 4.0]


def test_one_pass_refuses_what_it_cannot_step():
    with pytest.raises(ValueError, match="one_pass needs"):
        MasterWeightAdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, one_pass=True)  # fp32: its own master


def test_precompile_compiles_the_one_graph_every_parameter_uses():
    """After precompile() (scratch tensors) the real parameters -- 1-D and 2-D, gradients that are views
    into a bucket as under DDP -- must hit the same graph: a recompile would fail the run after the
    compile step."""
    from dflash_trainer.compile_guard import leave_run_phase
    from dflash_trainer.optim import adamw_one_pass_

    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in [(64, 32), (128,), (30, 60)]]
    opt = MasterWeightAdamW(params, lr=1e-2, one_pass=True)
    opt._kernel = torch.compile(adamw_one_pass_, dynamic=True, fullgraph=True, backend="aot_eager")
    opt.precompile()
    bucket = torch.zeros(sum(p.numel() for p in params) + 64, dtype=torch.bfloat16)
    torch.compiler.set_stance("fail_on_recompile")
    try:
        for _ in range(2):
            offset = 0
            for p in params:
                p.grad = bucket[offset:offset + p.numel()].view(p.shape)
                p.grad.normal_()
                offset += p.numel() + 16
            opt.step(0.5)
            opt.zero_grad()
    finally:
        leave_run_phase()
    assert [s["step"].item() for s in opt.opt.state.values()] == [2.0] * 3


def test_the_schedule_after_a_one_pass_step_does_not_warn_of_a_skipped_step():
    """The one-pass path never calls torch's AdamW.step(), which the LR scheduler watches: without the
    mark it leaves, every GPU run printed "lr_scheduler.step() before optimizer.step()"."""
    import warnings

    from dflash_trainer.optim import warmup_cosine

    params = [torch.nn.Parameter(torch.randn(8, 4).bfloat16())]
    opt = MasterWeightAdamW(params, lr=1e-2, one_pass=True)
    schedule = warmup_cosine(opt.opt, total_steps=4, warmup_steps=1)
    params[0].grad = torch.ones(8, 4, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        schedule.step()
    assert opt.opt.state[opt.master[0]]["step"].item() == 1.0
