"""The frozen target: any Hugging Face causal LM, run without grad, tapped at K decoder layers.

The feature of layer l is the *output* of decoder layer l (HF `hidden_states[l + 1]`), the
convention z-lab, SGLang and vLLM use when they feed a DFlash drafter. The forward stops after the
last tapped layer: the layers above it, the final norm and the LM head (3.8 TFLOP per 3,072-token
sample on Qwen3-8B) are never run for training, unless the loss compares the drafter with the target's
distribution (`features_and_final`: every layer and the final norm, for the target's logits).

Two ways to run it, same features:
- the tapped forward (Llama-family backbones: embed_tokens, rotary_emb, layers, all full attention,
  SDPA): embeddings, rotary, then the decoder layers up to the last tapped one, each through one
  compiled function (`COMPILED_TARGET_LAYER`, compiled per context bucket like the drafter's graphs,
  on GPUs), with no attention mask: the training batches are right-padded, so a causal mask alone is
  exact for every real token, and SDPA then takes its flash/cuDNN kernels.
- otherwise, the model's own forward with hooks that capture the K outputs and stop it after the last.

quantization="fp8" (target.quantization, opt-in) replaces the linears of every decoder layer with
FP8-dynamic GEMMs (target/fp8.py; the embedding and LM head stay as they are, as in an FP8-dynamic checkpoint):
the features, and in a colocated run's evaluation the verifying target, of an FP8-served target.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from .fp8 import Float8Linear, check_fp8_device, check_not_prequantized, quantize_linears


class _StopForward(Exception):
    pass


def call_target_layer(layer, hidden, position_embeddings, position_ids):
    out = layer(hidden, attention_mask=None, position_embeddings=position_embeddings, position_ids=position_ids)
    return out[0] if isinstance(out, tuple) else out


def _tensor_parallel_hook(hook) -> bool:
    """A hook torch's tensor parallelism installed (target/tensor_parallel.py): a sharded projection's output conversion,
    the row-wise all-reduce among them. Part of the forward, and traceable."""
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("torch.distributed")


@contextmanager
def hooks_suspended(module: nn.Module):
    """Run `module` without its forward hooks, but tensor parallelism's. transformers installs
    output-capturing hooks on a model's submodules at its first forward; outside a capturing forward they
    do nothing, but they read a ContextVar, which torch.compile cannot trace. Suspended on every compiled
    call alike, so the compiled graph's guards always see the same hooks."""
    saved = [(m, m._forward_hooks) for m in module.modules() if m._forward_hooks]
    for m, hooks in saved:
        m._forward_hooks = OrderedDict((k, h) for k, h in hooks.items() if _tensor_parallel_hook(h))
    try:
        yield
    finally:
        for m, hooks in saved:
            m._forward_hooks = hooks


# One compiled object per process, like the drafter's (objective.COMPILED_LAYER): the decoder layers
# share its graph (their parameters are graph inputs); one graph per context bucket.
COMPILED_TARGET_LAYER = torch.compile(call_target_layer, dynamic=False, fullgraph=True)


# Families whose decoder layers run exactly as their own forward runs them, given the embedding module's
# output, the rotary embedding and a causal mask (tests/test_families.py checks each against
# output_hidden_states). Others, or these with sliding-window layers, take the hooked forward.
TAPPED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2"})


def text_config(config):
    """The decoder's config: a multimodal wrapper's text tower (get_text_config), else the config itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def drafter_rope(tc) -> dict | None:
    """The drafter's RoPE: the target's full-attention parameters (a per-layer-type `rope_parameters`, as
    Gemma 3 and gpt-oss-style configs have, holds one entry per attention type). The drafter rotates whole
    heads, as the published drafters do, so a partial rotary factor is not carried over."""
    rope = getattr(tc, "rope_parameters", None)
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    if not rope:
        return None
    return {k: v for k, v in rope.items() if k != "partial_rotary_factor"}


def tapped_forward_supported(model: nn.Module, backbone: nn.Module) -> bool:
    """The backbone can be run layer by layer with only a causal mask: a family known to allow it, every
    layer full attention (no sliding window), SDPA."""
    config = text_config(model.config)
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (config.model_type in TAPPED_FAMILIES
            and all(hasattr(backbone, name) for name in ("embed_tokens", "rotary_emb", "layers"))
            and types == {"full_attention"} and getattr(config, "_attn_implementation", None) == "sdpa"
            and not getattr(config, "use_sliding_window", False) and not getattr(config, "sliding_window", None))


def meta_skeleton(config, trust_remote_code: bool = False) -> nn.Module:
    """The target's model class built on the meta device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def attention_implementation(skeleton: nn.Module) -> str:
    """SDPA where the model class supports it (its flash / cuDNN kernels), else eager: the families whose
    attention SDPA cannot express (Gemma 2's soft-capped scores, gpt-oss's attention sinks) refuse SDPA."""
    return "sdpa" if getattr(type(skeleton), "_supports_sdpa", False) else "eager"


def borrowed_scales(config, skeleton: nn.Module | None = None, trust_remote_code: bool = False) -> dict:
    """How the target transforms the embedding rows and LM-head logits the drafter borrows, under z-lab's
    names: Gemma's embedding modules scale by sqrt(hidden) (`scalar_embed_scale`), Granite multiplies its
    embeddings and divides its logits, Cohere scales its logits, Gemma 2 soft-caps them."""
    tc = text_config(config)
    if skeleton is None:
        skeleton = meta_skeleton(config, trust_remote_code)
    embed_scale = float(getattr(skeleton.get_input_embeddings(), "scalar_embed_scale", 1.0))
    embed_scale *= float(getattr(tc, "embedding_multiplier", None) or 1.0)
    multiplier = float(getattr(tc, "logit_scale", None) or 1.0) / float(getattr(tc, "logits_scaling", None) or 1.0)
    softcap = getattr(tc, "final_logit_softcapping", None)
    return {"input_embedding_scale": embed_scale, "output_multiplier": multiplier,
            "final_logit_softcapping": float(softcap) if softcap else None}


SUPPORTED_FAMILIES = ("Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, OLMo 2, gpt-oss, "
                      "Granite, Granite-MoE, Cohere, StarCoder2, GPT-NeoX, Falcon and DeepSeek-V3 causal LMs, "
                      "and Gemma 3's multimodal checkpoint")


def check_supported_target(config, where: str, trust_remote_code: bool = False) -> nn.Module:
    """One refusal, before any weight or data is read, for a target the trainer cannot tap or draft for:
    it names the family, what is missing, and what to give instead. Returns the meta-device skeleton."""
    from ..config import ConfigError
    tc = text_config(config)
    family = getattr(tc, "model_type", None) or type(config).__name__
    # What kind of model it is first (an encoder, an encoder-decoder), then what its config lacks.
    try:
        skeleton = meta_skeleton(config, trust_remote_code)
    except (ValueError, KeyError, ImportError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where}: transformers builds no causal LM for the {family} family ({first_line}); give a "
                          f"decoder-only causal LM ({SUPPORTED_FAMILIES} are tested), or a multimodal model's "
                          "text tower saved on its own") from None
    try:
        decoder_layers(skeleton)
    except TypeError:
        raise ConfigError(f"{where}: {type(skeleton).__name__} (the {family} family) has no decoder layer list the "
                          "trainer can read (model.model.layers, whose outputs the drafter learns from): an encoder, "
                          f"or a layout it does not know; give a decoder-only causal LM ({SUPPORTED_FAMILIES} are "
                          "tested)") from None
    missing = [n for n in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "max_position_embeddings") if getattr(tc, n, None) is None]
    if missing:
        raise ConfigError(f"{where}: the {family} config names no {', '.join(missing)}, which the drafter's shape "
                          f"is derived from; give a decoder-only causal LM ({SUPPORTED_FAMILIES} are tested)")
    for what, module in (("input embedding", skeleton.get_input_embeddings()),
                         ("LM head", skeleton.get_output_embeddings())):
        if getattr(module, "weight", None) is None:
            raise ConfigError(f"{where}: {type(skeleton).__name__} ({family}) has no {what} matrix, which the "
                              "drafter borrows; give the family's causal-LM checkpoint (the ...ForCausalLM one)")
    if getattr(skeleton.get_output_embeddings(), "bias", None) is not None:
        # The drafter borrows the head's weight; a serving engine applies the whole head, bias included, to the
        # drafter's hidden states, so a drafter trained without the bias would be served with another head.
        raise ConfigError(f"{where}: the LM head of {type(skeleton).__name__} ({family}) has a bias, which the drafter's "
                          f"loss does not apply and serving would: give a model whose head has none "
                          f"({SUPPORTED_FAMILIES} are tested)")
    kv = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    if tc.num_attention_heads % kv:
        raise ConfigError(f"{where}: {tc.num_attention_heads} attention heads are not a multiple of {kv} KV heads "
                          f"({family}); the drafter copies the target's grouped-query layout, which needs that")
    _check_rope(drafter_rope(tc), where, family)
    return skeleton


def _check_rope(rope: dict | None, where: str, family: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ..config import ConfigError

    kind = (rope or {}).get("rope_type", "default")
    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"{where}: RoPE type {kind!r} ({family}) is not one transformers' rotary embedding "
                          f"computes ({', '.join(sorted(ROPE_INIT_FUNCTIONS))}, or default), which the drafter uses")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    for path in ("model.layers", "model.language_model.layers", "transformer.h", "gpt_neox.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}; expected model.model.layers")


class FrozenTarget:
    def __init__(self, model: nn.Module, layer_ids: list[int], compile_layers: bool | None = None,
                 sdpa_backends: list | None = None, quantization: str = "none"):
        """compile_layers: run the tapped forward's layers compiled (default: on CUDA, where supported).
        sdpa_backends: SDPA kernels to prefer, in order, for the tapped forward (torch.nn.attention
        SDPBackend; None: torch's own choice). quantization: "none", or "fp8" (target/fp8.py)."""
        self.model = model.eval().requires_grad_(False)
        self.layers = decoder_layers(model)
        # Run the backbone (no LM head); get_decoder() is the HF accessor for it.
        self.backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        if any(not 0 <= i < len(self.layers) for i in layer_ids):
            raise ValueError(f"target layer ids {layer_ids} outside the target's {len(self.layers)} layers")
        self.layer_ids = list(layer_ids)
        self.quantization, self.quantized_linears = quantization, 0
        if quantization == "fp8":
            check_fp8_device(next(model.parameters()).device)
            check_not_prequantized(model.config, "the target")
            quantize_linears(list(self.layers))
            # every FP8 GEMM of the layers, a tensor-parallel group's FP8 shares (target/tensor_parallel.py) included
            self.quantized_linears = sum(isinstance(m, Float8Linear) for m in self.layers.modules())
            if not self.quantized_linears:
                raise ValueError("target.quantization = 'fp8': none of the decoder layers' linears has dimensions "
                                 "divisible by 16, which FP8 GEMMs need; set target.quantization = 'none'")
        elif quantization != "none":
            raise ValueError(f"target quantization {quantization!r}: use 'none' or 'fp8'")
        self.tapped = tapped_forward_supported(model, self.backbone)
        on_cuda = next(model.parameters()).is_cuda
        self.compile_layers = self.tapped and (on_cuda if compile_layers is None else compile_layers)
        self.sdpa_backends = sdpa_backends

    @property
    def config(self):
        return self.model.config

    @property
    def attention(self) -> str:
        """The attention implementation the target runs with (loading chose it: SDPA, else eager)."""
        return str(getattr(text_config(self.model.config), "_attn_implementation", None))

    def describe(self) -> str:
        """One line for the log: the family, its attention, how the features are taken."""
        family = text_config(self.model.config).model_type
        how = "tapped forward" if self.tapped else "its own forward, hooked"
        return f"{type(self.model).__name__} ({family}), attention {self.attention}, features from {how}"

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[b, S, K*H]: the outputs of the tapped layers, concatenated in layer-id order.

        attention_mask marks real tokens; they must come first in each row (right padding), as
        data.collate pads them, for the tapped forward (it uses the causal mask alone)."""
        return self._forward(input_ids, attention_mask, to_the_end=False)[0]

    @torch.no_grad()
    def features_and_final(self, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The features, and [b, S, H]: the final normed hidden state (what the LM head reads), for a loss
        against the target's distribution. It runs every layer and the final norm, where features() stops
        after the last tapped layer."""
        return self._forward(input_ids, attention_mask, to_the_end=True)

    def _forward(self, input_ids, attention_mask, to_the_end: bool):
        if self.tapped:
            return self._tapped_features(input_ids, to_the_end)
        return self._hooked_features(input_ids, attention_mask, to_the_end)

    def _tapped_features(self, input_ids: torch.Tensor, to_the_end: bool):
        backbone = self.backbone
        last = len(self.layers) - 1 if to_the_end else max(self.layer_ids)
        hidden = backbone.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_embeddings = backbone.rotary_emb(hidden, position_ids)
        call = COMPILED_TARGET_LAYER if self.compile_layers else call_target_layer
        captured = {}
        with sdpa_kernel(self.sdpa_backends, set_priority=True) if self.sdpa_backends else nullcontext():
            for i in range(last + 1):
                with hooks_suspended(self.layers[i]) if self.compile_layers else nullcontext():
                    hidden = call(self.layers[i], hidden, position_embeddings, position_ids)
                if i in self.layer_ids:
                    captured[i] = hidden
        final = backbone.norm(hidden) if to_the_end else None
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1), final

    def _hooked_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, to_the_end: bool):
        captured: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)

        def hook(idx):
            def fn(_module, _args, output):
                captured[idx] = output[0] if isinstance(output, tuple) else output
                if idx == last and not to_the_end:
                    raise _StopForward

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in set(self.layer_ids)]
        final = None
        try:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            final = out[0]  # last_hidden_state: after the final norm
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1), final


class BorrowedWeights:
    """The target's embedding and LM head, allocated on the device at once and filled by a thread.

    A drafter rank's next phase, the compile step, is seconds of Python (Dynamo tracing, cache loads)
    that leave the disk and the copy engine idle: the 2.5 GB read of Qwen3-8B's two matrices goes on
    beside it instead of before it. The compile step's probe may read the tensors half-filled: its
    results are thrown away (no weight, no optimizer state changes). `wait()` before the first real use.
    """

    def __init__(self, embed: torch.Tensor, head: torch.Tensor, sources: list[tuple[torch.Tensor, str, str]]):
        import threading

        self.embed, self.head = embed, head
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream(embed.device) if embed.is_cuda else None
        if self._stream is not None:  # the blocks may have served work still queued on the main stream
            self._stream.wait_stream(torch.cuda.current_stream(embed.device))
        self._thread = threading.Thread(target=self._fill, args=(sources,), name="embed-and-head", daemon=True)
        self._thread.start()

    def _fill(self, sources) -> None:
        from safetensors import safe_open

        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                for dst, file, key in sources:
                    with safe_open(file, "pt", device="cpu") as f:
                        dst.copy_(f.get_tensor(key))  # mmap -> device; the copy releases the GIL
        except BaseException as err:  # noqa: BLE001 - re-raised by wait() in the main thread
            self._error = err

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"reading the target's embedding and LM head failed: {self._error}") \
                from self._error
        if self._stream is not None:
            torch.cuda.current_stream(self.embed.device).wait_stream(self._stream)


def load_embed_and_head(path: str, device, dtype, config=None, trust_remote_code: bool = False) -> BorrowedWeights:
    """Only the target's embedding and LM head (what a drafter rank needs), read by key from safetensors,
    in the background (BorrowedWeights). Missing tensors are an error here, before anything is read.

    The parameter names come from the model class itself (built on the meta device, no memory), so
    any causal LM works, tied embeddings included. config: the target's, when the caller read it already.
    """
    import json
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig

    from ..config import ConfigError

    config = config if config is not None else AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    skeleton = meta_skeleton(config, trust_remote_code)
    # Every name of each parameter: a tied model's embedding and head are one parameter with two names,
    # and its checkpoint usually stores only one of them.
    names: dict[int, list[str]] = {}
    for n, p in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    embed_names = names[id(skeleton.get_input_embeddings().weight)]
    head_names = names[id(skeleton.get_output_embeddings().weight)]
    if getattr(config, "tie_word_embeddings", False):
        head_names = head_names + [n for n in embed_names if n not in head_names]
    root = Path(path)
    index = root / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"target.path {path}: {index.name} is damaged ({type(exc).__name__}: {exc}); "
                          "restore it from the model's source") from None

    stored = _stored_names(skeleton, root, weight_map)

    def locate(candidates: list[str]) -> tuple[str, str, list[int]]:  # (file, key, shape) from the headers only
        keys = [k for name in candidates for k in [name] + ([name.split(".", 1)[1]] if "." in name else [])]
        keys += [stored[name] for name in candidates if name in stored]
        for key in keys:
            file = root / (weight_map.get(key, "") if weight_map else "model.safetensors")
            if file.is_file():
                with safe_open(str(file), "pt", device="cpu") as f:
                    if key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                        return str(file), key, list(f.get_slice(key).get_shape())
        raise ConfigError(f"target.path {path}: no tensor {' or '.join(map(repr, candidates))} in its *.safetensors "
                          "files; drafter ranks read the embedding and LM head from safetensors: convert the "
                          "checkpoint (save_pretrained writes safetensors)")

    (e_file, e_key, e_shape), (h_file, h_key, h_shape) = locate(embed_names), locate(head_names)
    embed = torch.empty(e_shape, dtype=dtype, device=device)
    if (h_file, h_key) == (e_file, e_key):  # tied: one tensor
        return BorrowedWeights(embed, embed, [(embed, e_file, e_key)])
    head = torch.empty(h_shape, dtype=dtype, device=device)
    return BorrowedWeights(embed, head, [(embed, e_file, e_key), (head, h_file, h_key)])


def _stored_names(skeleton: nn.Module, root, weight_map: dict | None) -> dict[str, str]:
    """The model's parameter name -> the checkpoint's key, through transformers' own renamings: a multimodal
    wrapper's checkpoint stores `language_model.model.embed_tokens.weight` for the model's
    `model.language_model.embed_tokens.weight`. Empty where transformers has no such mapping."""
    from safetensors import safe_open

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # another transformers: the direct names only
        return {}
    renamings = [t for t in get_model_conversion_mapping(skeleton) if isinstance(t, WeightRenaming)]
    if not renamings:
        return {}
    if weight_map is not None:
        keys = list(weight_map)
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), "pt", device="cpu") as f:
            keys = list(f.keys())
    else:
        return {}
    return {apply_renamings(key, renamings): key for key in keys}
