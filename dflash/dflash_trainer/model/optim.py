"""AdamW over fp32 master weights for bf16 training, and warmup-then-cosine learning rate.

The model keeps bf16 parameters (fast matmuls, half the memory); the optimizer keeps an fp32
copy of each, steps it, and copies the result back. Small updates that bf16 would round away
accumulate in fp32. Gradients arrive as un-normalised sums: `step` divides by the step's total
loss weight, so the loss is normalised over the whole step (every micro-batch and every rank).

The step is memory-bound (a 1B-parameter drafter's state is ~17 GB), so what counts is how many
bytes it moves. On GPUs each tensor's update is one compiled kernel (`ONE_PASS_UPDATE`): it reads
the bf16 gradient, the fp32 master and both moments once and writes the moments, the master and
the bf16 parameter -- 28 bytes per parameter, against 40 for a cast into fp32 gradient buffers,
torch's fused AdamW and a copy back (which also needs 4 bytes per parameter of buffers).
`moments_dtype=torch.bfloat16` (train.moments_dtype) stores both moments in bf16 -- 20 bytes per
parameter and half their memory -- with the arithmetic still in fp32 and the fp32 masters as they
are (DeepSeek-V3 trains this way). Only the one-pass update can: torch's AdamW keeps its moments
in the masters' dtype.
"""

from __future__ import annotations

import math

import torch


def adamw_one_pass_(param, grad, master, exp_avg, exp_avg_sq, step, lr, coef,
                    beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's update of one tensor, fed the low-precision gradient times `coef`, writing
    the fp32 master and the low-precision parameter. `step` is the step count after this step and
    `lr`, `coef` are 0-d tensors, so one compiled graph serves every step and every tensor.
    The moments may be stored in bf16: they are read into fp32, updated and used there, and
    written back rounded, so only their storage differs. fp32 moments are updated in place, the
    graph as before (Inductor lowers an in-place addcmul_ to an FMA, an out-of-place one not).
    """
    g = grad.float() * coef
    m, v = exp_avg.float(), exp_avg_sq.float()  # fp32 moments: the state tensors themselves
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias1 = 1 - torch.pow(beta1, step)
    bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    denom = v.sqrt() / bias2_sqrt + eps
    updated = master * (1 - lr * weight_decay) - (lr / bias1) * m / denom
    if exp_avg.dtype != torch.float32:  # fixed per graph: bf16 storage gets the fp32 results, rounded
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    master.copy_(updated)
    param.copy_(updated)


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state tensors that moments_dtype stores
MOMENTS_DTYPES = (torch.float32, torch.bfloat16)

# One compiled object per process over flattened tensors (dynamic sizes: one graph for all of them),
# compiled in the serialized compile step (MasterWeightAdamW.precompile) like the drafter's graphs.
ONE_PASS_UPDATE = torch.compile(adamw_one_pass_, dynamic=True, fullgraph=True)


class MasterWeightAdamW:
    def __init__(
        self,
        params,
        lr: float,
        betas=(0.9, 0.95),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        max_grad_norm: float = 1.0,
        one_pass: bool | None = None,
        moments_dtype: torch.dtype = torch.float32,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.master = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True) for p in self.params
        ]
        self.fused = all(m.is_cuda for m in self.master)
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps,
                                     fused=self.fused or None)
        self.max_grad_norm = max_grad_norm
        # One-pass mode (default on GPUs) needs every parameter in one low-precision dtype with its own
        # master (an fp32 parameter would be a second graph) and flat views of them; FSDP's DTensors
        # take the fused-AdamW path. On CPUs it runs the same update eagerly (tests).
        eligible = bool(self.params) and not _is_dtensor(self.params[0]) and all(
            m is not p and p.is_contiguous() and p.dtype == self.params[0].dtype
            for p, m in zip(self.params, self.master))
        if moments_dtype not in MOMENTS_DTYPES:
            raise ValueError(f"moments_dtype {moments_dtype}: use one of {', '.join(map(str, MOMENTS_DTYPES))}")
        self.moments_dtype = moments_dtype
        low_moments = moments_dtype != torch.float32  # only the one-pass update keeps them so
        if low_moments and (one_pass is False or not eligible):
            raise ValueError(f"moments_dtype {moments_dtype} needs the one-pass update (contiguous, non-sharded "
                             "low-precision parameters of one dtype): torch's AdamW keeps the moments in the "
                             "masters' fp32")
        if one_pass and not eligible:
            raise ValueError("one_pass needs contiguous, non-sharded low-precision parameters of one dtype")
        self.one_pass = low_moments or (eligible and (self.fused if one_pass is None else one_pass))
        self._lr = torch.zeros((), device=self.master[0].device) if self.one_pass else None
        self._kernel = ONE_PASS_UPDATE if self.fused else adamw_one_pass_  # CPUs: the same update, eagerly
        self._compiled = False

    def precompile(self) -> None:
        """Compile the one-pass update now, on scratch tensors (the serialized compile step calls it;
        once is enough, since one graph serves every tensor of two elements or more)."""
        if not self.one_pass or self._compiled:
            return
        self._compiled = True
        device, low = self.master[0].device, self.params[0].dtype
        # As large as the largest parameter: Inductor times its candidate kernel configs on this first
        # call, and on a few thousand elements the choice is noise (the update took 7.3 ms in one H200
        # run and 10.9 ms in another with the same code, compiled on 4,096 elements).
        # A one-element tensor (a DSpark confidence head's bias) gets a graph of its own: dynamic shapes
        # specialise sizes 0 and 1, so the graph compiled on a larger size would recompile at step 1.
        sizes = {max(p.numel() for p in self.params)} | {p.numel() for p in self.params if p.numel() < 2}
        step, coef = torch.ones((), device=device), torch.ones((), device=device)  # distinct: aliasing is guarded
        for size in sorted(sizes, reverse=True):
            scratch = [torch.zeros(size, device=device, dtype=dt)
                       for dt in (low, low, torch.float32, self.moments_dtype, self.moments_dtype)]
            with torch.no_grad():
                self._update(*scratch, step, self._lr, coef)

    @torch.no_grad()
    def step(self, grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Scale the summed gradients, clip, step the fp32 masters, copy back. Returns the grad norm.

        Each pass over the parameters counts: the norm is read from the gradients in their own dtype
        and the scale and clip factor ride along in the update (one multiplier, `coef`). One-pass
        mode runs one compiled kernel per tensor; otherwise the gradients are cast into persistent
        fp32 buffers in one multi-tensor copy and torch's AdamW steps them (fused on GPUs, where the
        factor goes in through its grad_scale input).
        """
        live = [(p, m) for p, m in zip(self.params, self.master) if p.grad is not None]
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                m.grad = None
        if not live:
            return torch.zeros(())
        grads = [p.grad for p, _ in live]
        sharded = _is_dtensor(grads[0])
        norm = _grad_norm(grads, sharded) * grad_scale
        # torch.nn.utils.clip_grad_norm_'s rule, folded with the scale: one multiplier per step.
        coef = grad_scale * torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        if self.one_pass:
            self._one_pass_step(live, coef)
        else:
            self._torch_step(live, coef, sharded)
        return norm

    def _one_pass_step(self, live: list[tuple[torch.Tensor, torch.Tensor]], coef: torch.Tensor) -> None:
        """One compiled update per tensor, straight from the low-precision gradient."""
        self._lr.fill_(self.opt.param_groups[0]["lr"])
        states = [self._state(m) for _, m in live]
        torch._foreach_add_([s["step"] for s in states], 1.0)
        for (p, m), s in zip(live, states):
            self._update(p, p.grad, m, s["exp_avg"], s["exp_avg_sq"], s["step"], self._lr, coef)
        # The mark torch's step wrapper leaves: the LR scheduler warns "lr_scheduler.step() before
        # optimizer.step()" on every run otherwise, since this path never calls self.opt.step().
        self.opt._opt_called = True

    def _torch_step(self, live: list[tuple[torch.Tensor, torch.Tensor]], coef: torch.Tensor, sharded: bool) -> None:
        """Gradients cast into fp32 buffers, torch's AdamW steps the masters, the result copied back."""
        cast = [(p, m) for p, m in live if m is not p]
        for p, m in cast:
            if m.grad is None:
                m.grad = torch.empty_like(m)
        if cast:
            torch._foreach_copy_([m.grad for _, m in cast], [p.grad for p, _ in cast])
        if self.fused and not sharded:
            # The fused kernel divides each gradient by grad_scale (the AMP unscale hook).
            self.opt.grad_scale = (1.0 / coef).reshape(1).float()
            try:
                self.opt.step()
            finally:
                self.opt.grad_scale = None
        else:
            master_grads = [m.grad.to_local() if sharded else m.grad for _, m in live]
            torch._foreach_mul_(master_grads, coef)
            self.opt.step()
        if cast:
            torch._foreach_copy_([p for p, _ in cast], [m for _, m in cast])

    def _state(self, master: torch.Tensor) -> dict:
        """torch.optim.AdamW's per-tensor state, created as its fused path does (checkpoints load either way),
        the moments in moments_dtype."""
        state = self.opt.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            for key in MOMENTS:
                state[key] = torch.zeros_like(master, dtype=self.moments_dtype, memory_format=torch.preserve_format)
        return state

    def _update(self, param, grad, master, exp_avg, exp_avg_sq, step, lr, coef) -> None:
        group = self.opt.param_groups[0]
        beta1, beta2 = group["betas"]
        # Flat aliases: view() is never a silent copy, and detach() after it leaves no requires_grad and
        # no view base for the compiled graph to guard on (a base's shape would mean a graph per shape).
        flat = [t.view(-1).detach() for t in (param, grad, master, exp_avg, exp_avg_sq)]
        self._kernel(*flat, step, lr, coef, beta1, beta2, group["eps"], group["weight_decay"])

    def zero_grad(self) -> None:
        """Drop the model's gradients; the masters' fp32 buffers are kept and overwritten next step."""
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"adamw": self.opt.state_dict(), "master": [m.detach().cpu() for m in self.master]}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)
        self.opt.load_state_dict(state["adamw"])
        # torch casts every floating state tensor to its parameter's dtype (the fp32 master): the moments go
        # back to the dtype this optimizer keeps, whichever one the checkpoint was written with.
        for saved in self.opt.state.values():
            for key in MOMENTS:
                if key in saved:
                    saved[key] = saved[key].to(self.moments_dtype)


def _grad_norm(grads: list[torch.Tensor], sharded: bool) -> torch.Tensor:
    """The L2 norm of all the gradients, read in their own dtype (under FSDP each rank holds a shard:
    the norm is the whole gradient's)."""
    if sharded:
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        return norm.full_tensor() if _is_dtensor(norm) else norm
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms))


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_ratio: float = 0.0):
    """Linear warmup to the base LR, then cosine decay to `min_ratio` of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
