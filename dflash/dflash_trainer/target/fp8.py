"""FP8 GEMMs for the frozen target's decoder layers (`target.quantization = "fp8"`, opt-in).

The scheme is FP8-dynamic: each weight row (output channel) scaled once at load, each activation row
(token) scaled on the fly, both to float8_e4m3fn, multiplied by `torch._scaled_mm` into bf16. It is
the scheme of the `*-FP8-dynamic` checkpoints llm-compressor writes and vLLM serves, so a team that
serves its target that way trains the drafter on the features it will meet. It is a numerics change:
the features differ from the bf16 target's (README "The trainer" has the measured difference). What it
buys: the Hopper tensor cores' FP8 rate (1.3-1.8x bf16's on the target's GEMMs, measured on an H200) and
half the weights' memory, for the one-GPU run, where the target's forward is a third of every step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """[rows, 1] fp32: each row's absolute maximum maps to FP8's largest value (zero rows get a tiny scale)."""
    return (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Float8Linear(nn.Module):
    """A frozen nn.Linear with its weight in FP8 (per output channel) and its input quantized per token."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        scale = _row_scales(weight)
        self.register_buffer("weight", _to_fp8(weight, scale))  # [out, in], row-major: .t() is column-major
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        scale = _row_scales(rows)  # compiled with the layer, this fuses into the norm or SwiGLU before it
        out = fp8_matmul(_to_fp8(rows, scale), scale, self.weight, self.weight_scale, self.bias, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per-channel x per-token"


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, dtype: torch.dtype, emulate: bool | None = None) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale^T)^T + bias in `dtype`: FP8 tensor cores on a GPU; elsewhere (emulate)
    the same product dequantized in fp32 (products of FP8 values are exact in fp32: what the kernels
    accumulate), since torch's CPU _scaled_mm takes only per-tensor scales before torch 2.14."""
    if not (xq.device.type != "cuda" if emulate is None else emulate):
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=dtype)
    out = (xq.float() * x_scale) @ (wq.float() * w_scale.t()).t()
    return (out if bias is None else out + bias.float()).to(dtype)


def quantizable(linear: nn.Linear) -> bool:
    # _scaled_mm's FP8 kernels need both matrix dimensions divisible by 16
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def quantize_linears(modules: list[nn.Module]) -> int:
    """Replace every nn.Linear inside `modules` with a Float8Linear, in place, one at a time (the bf16
    weight is freed as its FP8 copy is made, so memory never holds both for more than one matrix).
    Returns how many were replaced; linears whose shape FP8 GEMMs cannot take stay as they are."""
    replaced = 0
    for module in modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                # plain linears only: a subclass (a checkpoint's own FP8 or int4 layer) holds other weights
                if type(child) is nn.Linear and quantizable(child):
                    setattr(parent, name, Float8Linear(child))
                    replaced += 1
    return replaced


# How the refusals below name the setting and its way out; dflash-eval passes its flag's.
TRAINER_SETTING = ("target.quantization = 'fp8'", "set target.quantization = 'none'")


def check_fp8_device(device: torch.device, capability: tuple[int, int] | None = None,
                     setting: tuple[str, str] = TRAINER_SETTING) -> None:
    """FP8 GEMMs need FP8 tensor cores (compute capability 8.9: L40S/Ada, 9.0: H100/H200, 10.x: Blackwell);
    CPUs emulate them (slowly: the tests use that). Raises ConfigError naming the GPU and the fix."""
    if device.type != "cuda":
        return
    capability = capability or torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        asked, instead = setting
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
        raise ConfigError(f"{asked} needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: L40S, "
                          f"H100, H200, B200); {name} is {capability[0]}.{capability[1]}. "
                          f"{instead[0].upper()}{instead[1:]} (the bf16 target).")


def check_not_prequantized(config, where: str, setting: tuple[str, str] = TRAINER_SETTING) -> None:
    """A checkpoint quantized already (Qwen's *-FP8, llm-compressor's *-FP8-dynamic, AWQ, GPTQ ...) brings
    its own layers and kernels; quantizing those again would read their packed weights as plain ones."""
    quantized = getattr(config, "quantization_config", None)
    if quantized:
        asked, instead = setting
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else \
            getattr(quantized, "quant_method", "?")
        raise ConfigError(f"{asked}, but {where} is quantized already (its config.json has a "
                          f"quantization_config, quant_method {method}): {instead} to run it as it is, or "
                          "give the bf16 checkpoint to have this trainer quantize it")
