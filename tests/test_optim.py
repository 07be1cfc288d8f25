"""MasterWeightAdamW: the same update as clip_grad_norm_ + AdamW on fp32 copies, without the extra passes."""

import pytest
import torch
from dflash_trainer.model.optim import MasterWeightAdamW


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


@pytest.mark.parametrize("moments_dtype", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
def test_precompile_compiles_the_one_graph_every_parameter_uses(moments_dtype):
    """After precompile() (scratch tensors) the real parameters -- 1-D and 2-D, gradients that are views
    into a bucket as under DDP -- must hit the same graph: a recompile would fail the run after the
    compile step. The scratch moments are in the optimizer's moments dtype (a graph is per dtype)."""
    from dflash_trainer.compile.guard import leave_run_phase
    from dflash_trainer.model.optim import adamw_one_pass_

    torch._dynamo.reset()
    # (1,): a one-element parameter (DSpark's confidence bias), which dynamic shapes specialise
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in [(64, 32), (128,), (1,), (30, 60)]]
    opt = MasterWeightAdamW(params, lr=1e-2, one_pass=True, moments_dtype=moments_dtype)
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
    assert [s["step"].item() for s in opt.opt.state.values()] == [2.0] * 4
    assert {s["exp_avg_sq"].dtype for s in opt.opt.state.values()} == {moments_dtype}


def test_the_schedule_after_a_one_pass_step_does_not_warn_of_a_skipped_step():
    """The one-pass path never calls torch's AdamW.step(), which the LR scheduler watches: without the
    mark it leaves, every GPU run printed "lr_scheduler.step() before optimizer.step()"."""
    import warnings

    from dflash_trainer.model.optim import warmup_cosine

    params = [torch.nn.Parameter(torch.randn(8, 4).bfloat16())]
    opt = MasterWeightAdamW(params, lr=1e-2, one_pass=True)
    schedule = warmup_cosine(opt.opt, total_steps=4, warmup_steps=1)
    params[0].grad = torch.ones(8, 4, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        schedule.step()
    assert opt.opt.state[opt.master[0]]["step"].item() == 1.0


# ---- train.moments_dtype: AdamW's moments stored in bf16 ---------------------------------------

def _adamw_one_pass_before_(param, grad, master, exp_avg, exp_avg_sq, step, lr, coef, beta1, beta2, eps,
                            weight_decay):
    """The one-pass update as it was before moments_dtype, verbatim: the fp32 default must still be it."""
    g = grad.float() * coef
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias1 = 1 - torch.pow(beta1, step)
    bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    denom = exp_avg_sq.sqrt() / bias2_sqrt + eps
    updated = master * (1 - lr * weight_decay) - (lr / bias1) * exp_avg / denom
    master.copy_(updated)
    param.copy_(updated)


def _bf16_model(seed, shapes=((64, 32), (128,), (30, 60))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes], g


def _steps(opt, model, grads, scales):
    for gr, scale in zip(grads, scales):
        for p, x in zip(model, gr):
            p.grad = x.clone()
        opt.step(scale)
        opt.zero_grad()


# Inductor builds two C++ kernels (13-40 s on 2 cores with a cold compile cache): test-fast keeps the eager case.
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "inductor"])
def test_default_fp32_moments_update_is_bit_identical_to_the_update_before(compiled):
    """The kernel now reads the moments into fp32 and writes them back; with fp32 moments (the default) that
    is the old in-place update value for value, eagerly (CPUs) and through Inductor (GPUs compile it)."""
    from dflash_trainer.model.optim import adamw_one_pass_

    g = torch.Generator().manual_seed(3)
    n = 4099
    init = [torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g)]
    grads = [torch.randn(n, generator=g).bfloat16() * 10 for _ in range(5)]
    new, old = (adamw_one_pass_, _adamw_one_pass_before_)
    if compiled:
        torch._dynamo.reset()
        new, old = (torch.compile(f, dynamic=True, fullgraph=True) for f in (new, old))
    results = []
    for kernel in (new, old):
        param, master = init[0].clone(), init[1].clone()
        exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
        for i, grad in enumerate(grads):
            kernel(param, grad, master, exp_avg, exp_avg_sq, torch.tensor(float(i + 1)), torch.tensor(1e-2),
                   torch.tensor(0.3), 0.9, 0.95, 1e-8, 0.1)
        results.append((param, master, exp_avg, exp_avg_sq))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert not torch.equal(results[0][1], init[1])  # it did step


def test_default_moments_are_fp32():
    model, _ = _bf16_model(4)
    for one_pass in (True, False):
        opt = MasterWeightAdamW(model, lr=1e-2, one_pass=one_pass)
        for p in model:
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.moments_dtype == torch.float32
        assert {s[k].dtype for s in opt.opt.state.values() for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}


def test_bf16_moments_track_fp32_adamw_and_are_stored_in_bf16():
    """Only the moments' storage changes: the masters stay within the rounding that bf16 storage allows of
    torch.optim.AdamW on fp32 copies. Each stored moment is rounded to bf16's 8 significant bits (relative
    error <= 2^-9); the first moment's EMA carries past roundings at most 1/(1-beta1) = 10 steps deep, so m
    is off by at most ~10 * 2^-9 ~ 2% of its size and sqrt(v) by half of v's ~2^-9/(1-beta2) relative error:
    each step's update (|update| <~ lr for Adam) is off by well under 2^-5 = 3% of lr. After k steps the
    masters must agree within k * lr * 2^-5; a kernel that mishandled the moments (a lost moment, a wrong
    beta, moments not carried between steps) is off by a whole lr per step."""
    lr, steps = 1e-2, 8
    model, g = _bf16_model(5)
    ref = [p.detach().float().clone().requires_grad_() for p in model]
    opt = MasterWeightAdamW(model, lr=lr, weight_decay=0.1, max_grad_norm=1e3, moments_dtype=torch.bfloat16)
    assert opt.one_pass  # on CPUs too: only the one-pass update keeps bf16 moments
    ref_opt = torch.optim.AdamW(ref, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    worst = 0.0
    for k in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=g).bfloat16() * 10 for p in model]
        _steps(opt, model, [grads], [torch.tensor(0.5)])
        reference_step(ref, grads, torch.tensor(0.5), 1e3, ref_opt)
        for m, r in zip(opt.master, ref):
            assert m.dtype == torch.float32
            err = (m - r.detach()).abs().max().item()
            assert err <= k * lr * 2**-5, f"step {k}: masters off by {err}"
            worst = max(worst, err)
    for p, m in zip(model, opt.master):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.detach().bfloat16())
    for r, m in zip(ref, opt.master):
        state, ref_state = opt.opt.state[m], ref_opt.state[r]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.bfloat16 and state[key].shape == m.shape
            # rounding is relative to the moment's size over the last few steps, not to each element's
            # (m can cancel to near zero): bounded by the tensor's largest moment
            scale = ref_state[key].abs().max().item()
            torch.testing.assert_close(state[key].float(), ref_state[key], rtol=0, atol=2**-5 * scale)
        assert state["step"].dtype == torch.float32 and state["step"].item() == steps
    assert worst > 0  # bf16 storage does round (the comparison is not vacuous)


def test_bf16_moments_refuse_what_keeps_fp32_moments():
    """torch's AdamW (fp32 parameters, explicit one_pass=False, FSDP's DTensors) keeps the moments in the
    masters' dtype: asked for bf16 moments, the optimizer refuses instead of keeping fp32 ones silently."""
    fp32 = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="moments_dtype torch.bfloat16 needs the one-pass update"):
        MasterWeightAdamW(fp32, lr=0.1, moments_dtype=torch.bfloat16)
    model, _ = _bf16_model(6)
    with pytest.raises(ValueError, match="needs the one-pass update"):
        MasterWeightAdamW(model, lr=0.1, one_pass=False, moments_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="moments_dtype torch.float16: use one of"):
        MasterWeightAdamW(model, lr=0.1, moments_dtype=torch.float16)


def _save_and_load(state, tmp_path):
    """Through safetensors + JSON, as a checkpoint holds it (run/train_state.py)."""
    from dflash_trainer.run import train_state

    train_state.write({"optimizer": state}, tmp_path)
    return train_state.read(tmp_path)["optimizer"]


def test_bf16_moments_resume_exactly_and_stay_bf16(tmp_path):
    """torch's load_state_dict casts the moments to the fp32 masters' dtype; the optimizer casts them back.
    bf16 -> fp32 -> bf16 is exact, so a resumed run continues exactly as an uninterrupted one."""
    model, g = _bf16_model(7)
    init = [p.detach().clone() for p in model]
    grads = [[torch.randn(p.shape, generator=g).bfloat16() for p in model] for _ in range(4)]
    scales = [torch.tensor(0.5)] * 4

    def fresh():
        with torch.no_grad():
            for p, x in zip(model, init):
                p.copy_(x)
        return MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, moments_dtype=torch.bfloat16)

    whole = fresh()
    _steps(whole, model, grads, scales)
    expected = [(m.clone(), {k: v.clone() for k, v in whole.opt.state[m].items()}) for m in whole.master]

    first = fresh()
    _steps(first, model, grads[:2], scales[:2])
    saved = _save_and_load(first.state_dict(), tmp_path)
    assert {s[k].dtype for s in saved["adamw"]["state"].values() for k in ("exp_avg", "exp_avg_sq")} == {
        torch.bfloat16}  # the checkpoint holds them as kept: half the bytes
    resumed = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, moments_dtype=torch.bfloat16)
    resumed.load_state_dict(saved)
    for m in resumed.master:
        assert {resumed.opt.state[m][k].dtype for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    _steps(resumed, model, grads[2:], scales[2:])
    for m, (want, want_state) in zip(resumed.master, expected):
        assert torch.equal(m, want)
        for key, value in want_state.items():
            assert resumed.opt.state[m][key].dtype == value.dtype and torch.equal(resumed.opt.state[m][key], value)


@pytest.mark.parametrize("saved_dtype,resumed_dtype", [(torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32)])
def test_a_resume_with_the_other_moments_dtype_casts_the_moments(tmp_path, saved_dtype, resumed_dtype):
    """train.moments_dtype may change on resume: the checkpoint's moments are cast to the new dtype (rounded
    to bf16, or widened exactly to fp32) and the run goes on in it."""
    model, g = _bf16_model(8)
    grads = [[torch.randn(p.shape, generator=g).bfloat16() for p in model] for _ in range(3)]
    opt = MasterWeightAdamW(model, lr=1e-2, one_pass=True, moments_dtype=saved_dtype)
    _steps(opt, model, grads[:2], [1.0, 1.0])
    before = [{k: opt.opt.state[m][k].clone() for k in ("exp_avg", "exp_avg_sq")} for m in opt.master]
    resumed = MasterWeightAdamW(model, lr=1e-2, one_pass=True, moments_dtype=resumed_dtype)
    resumed.load_state_dict(_save_and_load(opt.state_dict(), tmp_path))
    for m, old in zip(resumed.master, before):
        for key, value in old.items():
            assert resumed.opt.state[m][key].dtype == resumed_dtype
            assert torch.equal(resumed.opt.state[m][key], value.to(resumed_dtype))
    _steps(resumed, model, grads[2:], [1.0])
    assert {resumed.opt.state[m][k].dtype for m in resumed.master for k in ("exp_avg", "exp_avg_sq")} == {
        resumed_dtype}
    assert [s["step"].item() for s in resumed.opt.state.values()] == [3.0] * 3
