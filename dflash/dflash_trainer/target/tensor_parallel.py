"""Tensor-parallel target groups (`parallel.target_tp = N`): one frozen target sharded across N GPUs.

Built on torch's own tensor parallelism (torch.distributed.tensor.parallel: DTensor parameters on a
one-dimensional device mesh of the group's ranks). The plan is the model config's own
`base_model_tp_plan` (transformers ships one for most families: q/k/v and gate/up column-wise, o and down
row-wise), translated into torch's ColwiseParallel / RowwiseParallel styles, or, for a config without one,
that same column-/row-wise plan for the attention and MLP projections. Every sharded projection returns a
plain local tensor (use_local_output): between the column-wise q/k/v and the row-wise o the attention runs on
the group's share of the heads; the row-wise outputs are all-reduced, so each rank of the group holds the
whole hidden state after every layer and the features are the same on every rank of the group.

What a plan shards is decided per sub-module (self_attn, mlp): a sub-module is sharded whole or not at all.
One with a style torch has no equivalent for (MoE experts, packed projections, attention sinks), or with
parameters of its own besides its projections (gpt-oss's per-head sinks), stays replicated on every rank of
the group, which is exact, only not smaller.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn

from ..config import ConfigError
from .fp8 import Float8Linear
from .frozen import decoder_layers, meta_skeleton, text_config


# transformers' plan styles with an exact torch equivalent (a factory: torch's styles hold state per module).
def _torch_style(style: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }.get(style)


# For a config that ships no plan: the Megatron split of a Llama-style decoder layer.
FALLBACK_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}
LAYER_PREFIX = "layers.*."


def config_plan(config) -> dict[str, str]:
    """The plan of one decoder layer (module path inside the layer -> transformers style): the config's
    base_model_tp_plan entries under layers.*, or FALLBACK_PLAN's where it ships none."""
    plan = getattr(text_config(config), "base_model_tp_plan", None) or {}
    layer_plan = {k[len(LAYER_PREFIX):]: v for k, v in plan.items() if k.startswith(LAYER_PREFIX)}
    return layer_plan or {k[len(LAYER_PREFIX):]: v for k, v in FALLBACK_PLAN.items()}


def _groups(layer_plan: dict[str, str]) -> dict[str, dict[str, str]]:
    """The plan by sub-module: "self_attn" -> {"q_proj": "colwise", ...}. An entry for a sub-module's
    descendant (mlp.experts.down_proj) belongs to the sub-module (mlp), so a style torch cannot express
    anywhere below it keeps the whole sub-module replicated."""
    grouped: dict[str, dict[str, str]] = defaultdict(dict)
    for path, style in layer_plan.items():
        head, _, rest = path.partition(".")
        grouped[head][rest] = style
    return grouped


def _shardable(module: nn.Module, entries: dict[str, str]) -> dict | None:
    """torch's styles for `module`'s children, or None where the sub-module must stay replicated."""
    if any(True for _ in module.parameters(recurse=False)):  # e.g. per-head attention sinks
        return None
    styles = {}
    for path, style in entries.items():
        if style.startswith("replicated"):  # a norm kept whole on every rank: nothing to do without training
            continue
        factory = _torch_style(style)
        # torch's styles shard nn.Linear alone (not fused experts, not a checkpoint's own layers)
        if factory is None or type(_get_submodule_or_none(module, path)) is not nn.Linear:
            return None
        styles[path] = factory()
    return styles or None


def _get_submodule_or_none(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def layer_styles(layer: nn.Module, layer_plan: dict[str, str]) -> dict:
    """torch's parallelize_module plan for one decoder layer: "self_attn.q_proj" -> ColwiseParallel(), ..."""
    styles = {}
    for head, entries in _groups(layer_plan).items():
        sub = _get_submodule_or_none(layer, head)
        chosen = _shardable(sub, entries) if sub is not None else None
        styles.update({f"{head}.{path}": style for path, style in (chosen or {}).items()})
    return styles


def shard_target(model: nn.Module, mesh) -> int:
    """Shard `model`'s decoder layers in place across `mesh` (every rank holds the whole model on entry and
    cuts its own share: no communication). Returns how many projections were sharded; ConfigError when the
    plan shards none (the group would only hold N copies)."""
    from torch.distributed.tensor.parallel import parallelize_module

    layer_plan = config_plan(model.config)
    sharded = 0
    for layer in decoder_layers(model):
        styles = layer_styles(layer, layer_plan)
        if styles:
            parallelize_module(layer, mesh, styles, src_data_rank=None)
            sharded += len(styles)
    if not sharded:
        family = text_config(model.config).model_type
        raise ConfigError(f"parallel.target_tp = {mesh.size()}: the {family} target's decoder layers have no "
                          "attention or MLP projections torch's column-/row-wise tensor parallelism can shard "
                          "(its config's tensor-parallel plan names none); set parallel.target_tp = 1")
    return sharded


def tp_mesh(group, device: torch.device):
    """The one-dimensional device mesh of this rank's target group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))


# ---- target.quantization = fp8 in a group ------------------------------------------------------------

class Float8Shard(Float8Linear):
    """A sharded projection's local share as an FP8-dynamic GEMM (fp8.Float8Linear). The column-/row-wise
    style's input and output hooks move over from the sharded nn.Linear, so the communication stays torch's:
    the GEMM takes the local input and hands back a DTensor of the style's placement (column-wise: this rank's
    slice of the output features; row-wise: a partial sum, all-reduced by the output hook).

    Column-wise shares quantize exactly as the whole matrix does (one scale per output row). Row-wise shares
    scale each weight row and each token over this rank's slice of the input features, finer than the whole
    target's FP8: the features differ from a single rank's FP8 ones by about FP8's own rounding."""

    def __init__(self, sharded: nn.Linear):
        from torch.distributed.tensor import Partial, Shard

        weight = sharded.weight
        self.mesh = weight.device_mesh
        self.placement = Shard(-1) if weight.placements[0] == Shard(0) else Partial()
        local = nn.Linear(weight.to_local().shape[1], weight.to_local().shape[0], bias=False,
                          device="meta", dtype=weight.dtype)
        local.weight = nn.Parameter(weight.to_local(), requires_grad=False)
        bias = sharded.bias
        if bias is not None and (isinstance(self.placement, Shard) or self.mesh.get_local_rank() == 0):
            local.bias = nn.Parameter(bias.to_local(), requires_grad=False)  # a partial sum adds it once
        super().__init__(local)
        for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            setattr(self, hooks, getattr(sharded, hooks))

    def forward(self, x):
        from torch.distributed.tensor import DTensor

        out = super().forward(x.to_local())
        return DTensor.from_local(out, self.mesh, [self.placement], run_check=False)


def quantize_shards(model: nn.Module) -> int:
    """Replace each sharded projection of the decoder layers with its FP8 share (Float8Shard), in place;
    returns how many. The replicated linears are left to FrozenTarget's own quantization."""
    from torch.distributed.tensor import DTensor

    replaced = 0
    for layer in decoder_layers(model):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and isinstance(child.weight, DTensor) and \
                        all(n % 16 == 0 for n in child.weight.to_local().shape):  # FP8 GEMMs' shape rule
                    setattr(parent, name, Float8Shard(child))
                    replaced += 1
    return replaced


# ---- what N may be: the heads, and the memory ----------------------------------------------------

def _split_sizes(config) -> dict[str, int]:
    tc = text_config(config)
    heads = tc.num_attention_heads
    sizes = {"attention heads": heads, "KV heads": getattr(tc, "num_key_value_heads", None) or heads}
    if getattr(tc, "intermediate_size", None):
        sizes["MLP width"] = tc.intermediate_size
    return sizes


def valid_tp_sizes(config, limit: int = 64) -> list[int]:
    """The group sizes that split every sharded dimension evenly (heads, KV heads, the MLP width)."""
    sizes = _split_sizes(config)
    return [n for n in range(1, limit + 1) if all(s % n == 0 for s in sizes.values())]


def check_tp_shape(config, tp: int, where: str) -> None:
    """ConfigError when N does not split the target's heads, KV heads or MLP width evenly."""
    if tp == 1:
        return
    bad = {name: size for name, size in _split_sizes(config).items() if size % tp}
    if bad:
        said = " and ".join(f"{size} {name}" for name, size in bad.items())
        fits = ", ".join(map(str, valid_tp_sizes(config)))
        raise ConfigError(f"parallel.target_tp = {tp} does not divide the {where} target's {said}; every rank of a "
                          f"target group holds an equal share of them: set parallel.target_tp to one of {fits} "
                          "(and --target-gpus to a multiple of it)")


def target_bytes(config, dtype_bytes: int, trust_remote_code: bool = False) -> tuple[int, int]:
    """(bytes of the decoder layers' projections the plan can shard, bytes of everything else), from the model
    class on the meta device (no weights read)."""
    skeleton = meta_skeleton(config, trust_remote_code)
    layer_plan = config_plan(config)
    shardable = 0
    for layer in decoder_layers(skeleton):
        for path in layer_styles(layer, layer_plan):
            shardable += sum(p.numel() for p in layer.get_submodule(path).parameters())
    total = sum(p.numel() for p in skeleton.parameters())
    return shardable * dtype_bytes, (total - shardable) * dtype_bytes


# Room a GPU keeps beside the weights for the forward's activations and the transport's buffers.
HEADROOM = 0.15


def share_per_gpu(shardable: int, replicated: int, tp: int) -> int:
    return math.ceil(shardable / tp) + replicated


def check_target_fits(config, tp: int, dtype_bytes: int, free_bytes: int, trust_remote_code: bool = False) -> None:
    """Before loading: the target's share per GPU fits in this GPU's free memory (less HEADROOM); ConfigError
    naming the smallest group size that fits otherwise."""
    shardable, replicated = target_bytes(config, dtype_bytes, trust_remote_code)
    budget = free_bytes * (1 - HEADROOM)
    need = share_per_gpu(shardable, replicated, tp)
    if need <= budget:
        return
    gib = 1 << 30
    fits = [n for n in valid_tp_sizes(config) if n > tp and share_per_gpu(shardable, replicated, n) <= budget]
    fix = (f"set parallel.target_tp = {fits[0]} (its share is {share_per_gpu(shardable, replicated, fits[0]) / gib:.1f} "
           f"GiB) and --target-gpus to a multiple of it" if fits else
           f"even the largest group leaves {replicated / gib:.1f} GiB unsharded (embeddings, norms, experts) per "
           "GPU: use GPUs with more memory, or target.quantization = fp8 with target_tp = 1")
    raise ConfigError(f"the target needs {need / gib:.1f} GiB per GPU at parallel.target_tp = {tp} "
                      f"({shardable / gib:.1f} GiB split across the group, {replicated / gib:.1f} GiB on every "
                      f"rank), and this GPU has {free_bytes / gib:.1f} GiB free ({HEADROOM:.0%} kept for "
                      f"activations): {fix}")


# ---- loading a target group's share ---------------------------------------------------------------

def check_fits_before_loading(cfg, config, device: torch.device) -> None:
    """A target rank's memory check on a GPU, before a byte of weights is read (skipped on CPUs)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    dtype_bytes = torch.finfo(getattr(torch, cfg.target.dtype)).bits // 8
    check_target_fits(config, cfg.parallel.target_tp, dtype_bytes, free, cfg.target.trust_remote_code)


def _read_and_shard(cfg, config, device: torch.device, mesh) -> tuple[nn.Module, int]:
    from transformers import AutoModelForCausalLM

    from ..infra.dtypes import DTYPES
    from .frozen import attention_implementation

    trust = cfg.target.trust_remote_code
    attention = attention_implementation(meta_skeleton(config, trust))
    model = AutoModelForCausalLM.from_pretrained(cfg.target.path, dtype=DTYPES[cfg.target.dtype],
                                                 attn_implementation=attention, trust_remote_code=trust)
    sharded = shard_target(model, mesh)
    return model.to(device), sharded


def load_sharded_target(cfg, layer_ids: list[int], device: torch.device, group, config):
    """The target of this rank's group: read whole into host memory, each decoder layer cut to this rank's
    share on the device (parallelize_module), the rest (embeddings, norms, LM head) copied whole. The group's
    ranks read in turn, so host memory holds one whole copy per group at a time, not one per GPU."""
    import torch.distributed as dist

    from ..infra.console import console
    from .frozen import FrozenTarget

    mesh = tp_mesh(group, device)
    check_tp_shape(config, mesh.size(), cfg.target.path)  # again here: the embedded target is built after the start
    model, sharded = None, 0
    for turn in range(mesh.size()):
        if turn == mesh.get_local_rank():
            model, sharded = _read_and_shard(cfg, config, device, mesh)
        dist.barrier(group=group)
    fp8 = cfg.target.quantization == "fp8"
    if fp8:
        from .fp8 import check_fp8_device, check_not_prequantized

        check_fp8_device(device)
        check_not_prequantized(model.config, "the target")
    fp8_shards = quantize_shards(model) if fp8 else 0
    target = FrozenTarget(model, layer_ids, quantization=cfg.target.quantization)
    if mesh.get_local_rank() == 0:  # one line per group
        console.print(f"target: {target.describe()}; {sharded} projections of its decoder layers split across a "
                      f"group of {mesh.size()} (parallel.target_tp)"
                      + (f", {target.quantized_linears} linears as FP8-dynamic GEMMs ({fp8_shards} of them "
                         "sharded)" if fp8 else ""),
                      soft_wrap=True)
    return target
