"""AdamW over fp32 master weights for bf16 training, and warmup-then-cosine learning rate.

The model keeps bf16 parameters (fast matmuls, half the memory); the optimizer keeps an fp32
copy of each, steps it, and copies the result back. Small updates that bf16 would round away
accumulate in fp32. Gradients arrive as un-normalised sums: `step` divides by the step's total
loss weight, so the loss is normalised over the whole step (every micro-batch and every rank).
"""

from __future__ import annotations

import math

import torch


class MasterWeightAdamW:
    def __init__(
        self,
        params,
        lr: float,
        betas=(0.9, 0.95),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        max_grad_norm: float = 1.0,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.master = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True) for p in self.params
        ]
        self.fused = all(m.is_cuda for m in self.master)
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps,
                                     fused=self.fused or None)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Scale the summed gradients, clip, step the fp32 masters, copy back. Returns the grad norm.

        The step is memory-bound (a 1B-parameter drafter moves ~40 GB), so each pass over the
        parameters counts: the norm is read from the gradients in their own dtype, the gradients are
        cast into persistent fp32 buffers in one multi-tensor copy, and on GPUs the scale and the clip
        factor are applied inside the fused AdamW kernel (its grad_scale input) rather than in a pass
        of their own.
        """
        live = [(p, m) for p, m in zip(self.params, self.master) if p.grad is not None]
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                m.grad = None
        if not live:
            return torch.zeros(())
        grads = [p.grad for p, _ in live]
        sharded = _is_dtensor(grads[0])
        if sharded:  # FSDP: each rank holds a shard; the norm is the whole gradient's
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
            norm = (norm.full_tensor() if _is_dtensor(norm) else norm) * grad_scale
        else:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            norm = torch.linalg.vector_norm(torch.stack(norms)) * grad_scale
        # torch.nn.utils.clip_grad_norm_'s rule, folded with the scale: one multiplier per step.
        coef = grad_scale * torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
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
        return norm

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
