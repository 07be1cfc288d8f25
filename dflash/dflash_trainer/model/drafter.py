"""The DFlash drafter: L Qwen3 decoder layers conditioned on a frozen target by KV injection.

Two kinds, by `architectures`: DFlash (z-lab's DFlashDraftModel) and DFlash 2 (DFlash2DraftModel: every layer
gets grouped dynamic causal convolutions around attention and the MLP, and a candidate selector re-ranks the
top-k tokens of each block position by the token drafted before it; model/dflash2/), and DSpark
(speculators' DSparkDraftModel: a low-rank Markov logit bias by the token drafted before each position, and a
confidence head predicting each position's acceptance; model/dspark/).

Parameter names and the saved directory match the published z-lab drafters, so the checkpoints
load in z-lab's ``dflash`` package, SGLang and vLLM. The drafter owns no embedding and no LM head:
it borrows the target's (frozen) ones, and returns normalised hidden states.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from ..infra import storage
from ..target.frozen import borrowed_scales, drafter_rope, text_config
from . import modeling_dflash
from .dflash2.modules import CandidateSelector, GroupedDynamicCausalConv
from .dspark.modules import MARKOV_HEAD_TYPES as DSPARK_MARKOV_TYPES
from .dspark.modules import ConfidenceHead, MarkovHead
from .sampling import race, temperature_probs

# The attention kernel is injected: (q [b,h,Q,d], k [b,kv,S+Q,d], v) -> [b,h,Q,d].
# Training passes the compiled flex_attention with the DFlash BlockMask, inference and the
# dense reference pass SDPA. Keeping it out of the model keeps the model file readable.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ARCHITECTURE = "DFlashDraftModel"
# drafter.kind -> the serving class z-lab's package picks by `architectures`.
# (DSpark: our directory's name for it; dflash-export --format speculators writes speculators' DSpark directory.)
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}
# DFlash 2's settings, with z-lab's and speculators' defaults; saved in dflash_config under these names.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# DSpark's, with speculators' defaults and names (DSparkSpeculatorConfig); saved in dflash_config.
DSPARK_DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "confidence_head_with_markov": True}


def drafter_kind(config) -> str:
    """dflash, dflash2 or dspark, from a drafter config's architectures."""
    names = list(getattr(config, "architectures", None) or [ARCHITECTURE])
    return next((kind for kind in ("dflash2", "dspark") if ARCHITECTURES[kind] in names), "dflash")
# What `AutoModel.from_pretrained(dir, trust_remote_code=True)` builds, per kind: the class in the modelling file
# that save_pretrained writes beside the weights (z-lab's published drafters name theirs the same way). DSpark has
# none there: speculators' DSparkDraftModel serves it, from dflash-export --format speculators.
MODELING_FILE = Path(modeling_dflash.__file__).name
AUTO_MAP = {kind: {"AutoModel": f"{Path(MODELING_FILE).stem}.{ARCHITECTURES[kind]}"} for kind in ("dflash", "dflash2")}


def build_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """The published rule: ``num_ids`` layers evenly spaced from 1 to T-3 (one id: the middle)."""
    if num_ids < 1:
        raise ValueError(f"need at least one target layer id, got {num_ids}")
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(
            f"target has {num_target_layers} layers; the rule spaces ids over 1..T-3, so it needs at least 4"
        )
    return [round(start + i * (end - start) / (num_ids - 1)) for i in range(num_ids)]


@dataclass(frozen=True)
class DrafterShape:
    """What a drafter needs beyond its target's shape."""

    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] | None = None  # None: the published rule with num_layers ids
    intermediate_size: int | None = None  # None: the target's
    kind: str = "dflash"  # a key of ARCHITECTURES
    conv_kernel_size: int = DFLASH2_DEFAULTS["conv_kernel_size"]  # dflash2 only, as the three below
    conv_group_size: int = DFLASH2_DEFAULTS["conv_group_size"]
    selector_rank: int = DFLASH2_DEFAULTS["selector_rank"]
    selector_top_k: int = DFLASH2_DEFAULTS["selector_top_k"]
    markov_rank: int = DSPARK_DEFAULTS["markov_rank"]  # dspark only, as the two below
    markov_head_type: str = DSPARK_DEFAULTS["markov_head_type"]
    confidence_head_with_markov: bool = DSPARK_DEFAULTS["confidence_head_with_markov"]


def _dflash2_settings(shape: DrafterShape, hidden_size: int, vocab: int) -> dict:
    """DFlash 2's dflash_config entries, refused where z-lab's modules could not be built from them."""
    if hidden_size % shape.conv_group_size:
        raise ValueError(f"conv_group_size {shape.conv_group_size} does not divide the hidden size {hidden_size}: "
                         "pick a divisor of it (16 divides every common one)")
    if shape.conv_kernel_size > shape.block_size:
        raise ValueError(f"conv_kernel_size {shape.conv_kernel_size} exceeds block_size {shape.block_size}: a "
                         "convolution never reaches past its block")
    if shape.selector_top_k > vocab:
        raise ValueError(f"selector_top_k {shape.selector_top_k} exceeds the target's vocabulary ({vocab} tokens)")
    return {name: int(getattr(shape, name)) for name in DFLASH2_DEFAULTS}


def _dspark_settings(shape: DrafterShape) -> dict:
    """DSpark's dflash_config entries, refused where speculators' heads could not be built from them."""
    if shape.markov_head_type not in DSPARK_MARKOV_TYPES:
        raise ValueError(f"markov_head_type {shape.markov_head_type!r} is not one of {DSPARK_MARKOV_TYPES}")
    if shape.markov_rank < 1:
        raise ValueError(f"markov_rank {shape.markov_rank} must be at least 1 (DSpark's Markov head)")
    return {"markov_rank": int(shape.markov_rank), "markov_head_type": shape.markov_head_type,
            "confidence_head_with_markov": bool(shape.confidence_head_with_markov)}


def _first_attr(config, names: tuple[str, ...], default=None):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


def drafter_config(target_config, shape: DrafterShape, borrowed: dict | None = None) -> Qwen3Config:
    """A Qwen3Config in the published drafters' format, derived from the target's config.

    borrowed: how the target scales what the drafter borrows (target.borrowed_scales; None: read from the
    target's model class). Values other than the identity go into dflash_config under z-lab's names, which
    the trainer trains with and z-lab's loop and dflash-eval serve with."""
    tc = text_config(target_config)
    num_target_layers = tc.num_hidden_layers
    layer_ids = list(shape.target_layer_ids or build_target_layer_ids(num_target_layers, shape.num_layers))
    if any(not 0 <= i < num_target_layers for i in layer_ids):
        raise ValueError(f"target_layer_ids {layer_ids} outside the target's {num_target_layers} layers")
    vocab = tc.vocab_size
    if not 0 <= shape.mask_token_id < vocab:
        raise ValueError(
            f"mask_token_id {shape.mask_token_id} is not a row of the target embedding (vocab {vocab}); "
            "pick a reserved or padded row of the target's vocabulary"
        )
    intermediate = shape.intermediate_size or _first_attr(tc, ("intermediate_size", "ffn_hidden_size", "ffn_dim", "n_inner"))
    if intermediate is None:
        raise ValueError(f"the target's config ({tc.model_type}) names no intermediate_size: set "
                         "drafter.intermediate_size")
    if borrowed is None:
        borrowed = borrowed_scales(target_config)
    if shape.kind not in ARCHITECTURES:
        raise ValueError(f"drafter kind {shape.kind!r} is not one of {sorted(ARCHITECTURES)}")
    kind_settings = (_dflash2_settings(shape, tc.hidden_size, vocab) if shape.kind == "dflash2"
                     else _dspark_settings(shape) if shape.kind == "dspark" else {})
    heads = tc.num_attention_heads
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        hidden_act=_first_attr(tc, ("hidden_activation", "hidden_act"), "silu"),
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=_first_attr(tc, ("rms_norm_eps", "layer_norm_eps", "norm_eps"), 1e-6),
        rope_parameters=drafter_rope(tc),
        attention_bias=getattr(tc, "attention_bias", False),
        tie_word_embeddings=False,
        layer_types=["full_attention"] * shape.num_layers,
        architectures=[ARCHITECTURES[shape.kind]],
        block_size=shape.block_size,
        num_target_layers=num_target_layers,
        target_model_type=tc.model_type,  # the family it drafts for: dflash-eval refuses a target of another
        dflash_config={"mask_token_id": shape.mask_token_id, "target_layer_ids": layer_ids,
                       **{k: v for k, v in borrowed.items() if v != IDENTITY_SCALES[k]}, **kind_settings},
    )
    if borrowed.get("output_multiplier", 1.0) != 1.0:
        # vLLM's DFlash model scales the draft logits by the top-level logit_scale, not by output_multiplier.
        config.logit_scale = borrowed["output_multiplier"]
    # Serving engines that predate transformers 5 read rope_theta at the top level.
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]
    return config


# z-lab's names for how the target scales its embedding and logits, with the values that change nothing.
IDENTITY_SCALES = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def shape_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The target's logit transform on the LM head's output, as z-lab's compute_logits applies it."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class DrafterAttention(nn.Module):
    """Queries from block tokens; keys and values from [fused context ; block tokens] (KV injection)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, attention: AttentionFn):
        b, q_len, _ = x.shape
        ctx_len = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        # Project context and block separately, then concatenate: cheaper than projecting the concat.
        k = torch.cat([self.k_proj(context), self.k_proj(x)], dim=1)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], dim=1)
        k = self.k_norm(k.view(b, ctx_len + q_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, ctx_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # Keys are rotated with every position (context then block); queries with the block's only.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[:, :, ctx_len:] + rotate_half(q) * sin[:, :, ctx_len:]
        k = k * cos + rotate_half(k) * sin
        out = attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


def _convolutions(config: Qwen3Config) -> tuple[GroupedDynamicCausalConv, GroupedDynamicCausalConv] | None:
    """DFlash 2's two convolutions of a layer (around attention, around the MLP); None for DFlash."""
    if drafter_kind(config) != "dflash2":
        return None
    dflash = config.dflash_config
    return tuple(GroupedDynamicCausalConv(config.hidden_size, int(dflash["conv_kernel_size"]),
                                          int(dflash["conv_group_size"]), int(config.block_size)) for _ in range(2))


class DrafterLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        convs = _convolutions(config)
        self.attention_conv, self.mlp_conv = convs if convs else (None, None)

    def forward(self, x, context, cos, sin, attention: AttentionFn):
        # The context is not normalised by this layer's input norm: it was fused once by hidden_norm.
        x = x + self.attention_part(x, lambda h: self.self_attn(h, context, cos, sin, attention))
        return x + self.mlp_part(x)

    def attention_part(self, x, attend):
        """The attention sublayer's output, before the residual add (attend: normalised x -> attention output,
        so that decoding can attend to its cached context). DFlash 2 convolves its input and output (z-lab's
        prepare / finish)."""
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            return attend(h)
        h, kernel = self.attention_conv.prepare(h)
        return self.attention_conv.finish(attend(h), kernel)

    def mlp_part(self, x):
        """The MLP sublayer's output, before the residual add (DFlash 2: convolved as attention's)."""
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            return self.mlp(h)
        h, kernel = self.mlp_conv.prepare(h)
        return self.mlp_conv.finish(self.mlp(h), kernel)


class DFlashDrafter(nn.Module):
    """fc + hidden_norm fuse K target features; L layers; final norm. Returns normalised hidden states."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        dflash = config.dflash_config
        self.block_size = int(config.block_size)
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = list(dflash["target_layer_ids"])
        # What the target applies to the embedding and logits the drafter borrows (drafter_config); read as
        # z-lab's loop reads them: dflash_config first, then the config's top level.
        def value(name):
            return dflash.get(name, getattr(config, name, IDENTITY_SCALES[name]))

        self.input_embedding_scale = float(value("input_embedding_scale"))
        self.output_multiplier = float(value("output_multiplier"))
        softcap = value("final_logit_softcapping")
        self.final_logit_softcapping = float(softcap) if softcap else None
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.kind = drafter_kind(config)
        self.candidate_selector = None
        if self.kind == "dflash2":
            self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size,
                                                        int(dflash["selector_rank"]), int(dflash["selector_top_k"]))
        self.markov_head = self.confidence_head = None
        if self.kind == "dspark":
            rank = int(dflash["markov_rank"])
            self.markov_head = MarkovHead(config.vocab_size, config.hidden_size, rank, dflash["markov_head_type"])
            self.confidence_with_markov = bool(dflash["confidence_head_with_markov"])
            self.confidence_head = ConfidenceHead(config.hidden_size + (rank if self.confidence_with_markov else 0))
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        std = getattr(self.config, "initializer_range", 0.02) if std is None else std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():  # DFlash 2: convolutions start as the identity, as speculators starts them
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_parameters()
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(std)
        if self.markov_head is not None:
            self.markov_head.reset_parameters()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[b, S, K*H] target features -> [b, S, H] context: per token, so decoding fuses each token once."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        features: torch.Tensor | None,  # [b, S, K*H] target features of the context
        block_embeds: torch.Tensor,  # [b, Q, H] rows of the target's embedding matrix for the block tokens
        position_ids: torch.Tensor,  # [b, S + Q] context positions, then block positions
        attention: AttentionFn,
        layer_fn: Callable | None = None,  # (layer, x, context, cos, sin, attention) -> x, e.g. compiled
        context: torch.Tensor | None = None,  # fuse(features), when the caller keeps it (decoding)
        fuse_fn: Callable | None = None,  # (fc, hidden_norm, features) -> context, e.g. compiled
        norm_fn: Callable | None = None,  # (norm, x) -> x, e.g. compiled
    ) -> torch.Tensor:
        if context is None:
            context = fuse_fn(self.fc, self.hidden_norm, features) if fuse_fn else self.fuse(features)
        cos, sin = self.rotary_emb(block_embeds, position_ids)
        # The target's own embedding scale (Gemma's sqrt(hidden)), as z-lab's loop applies it when serving.
        x = block_embeds * self.input_embedding_scale if self.input_embedding_scale != 1.0 else block_embeds
        for layer in self.layers:
            x = layer_fn(layer, x, context, cos, sin, attention) if layer_fn else layer(x, context, cos, sin, attention)
        return norm_fn(self.norm, x) if norm_fn else self.norm(x)

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Logits through the target's LM head and its logit transform (z-lab's compute_logits)."""
        return shape_logits(F.linear(hidden, head_weight), self.output_multiplier, self.final_logit_softcapping)

    def markov_logits(self, hidden: torch.Tensor, previous: torch.Tensor, head_weight: torch.Tensor,
                      codes: torch.Tensor | None = None) -> torch.Tensor:
        """DSpark's logits: the LM head's plus the Markov bias of each position's previous token (previous [...],
        hidden [..., H]; codes: the Markov head's low-rank codes when the caller has them, e.g. the rnn's)."""
        if codes is None:
            codes = self.markov_head.step(previous, hidden)[0]
        return self.logits(hidden.to(head_weight.dtype), head_weight) + self.markov_head.markov_w2(codes).to(
            head_weight.dtype)

    def block_outputs(self, hidden: torch.Tensor, previous: torch.Tensor,
                      head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark teacher-forced over whole blocks, as speculators trains and its model computes: hidden [N, B, H],
        previous [N, B] each position's true previous token -> (logits [N, B, V], confidence logits [N, B])."""
        codes = self.markov_head.block_codes(previous, hidden)
        return self.markov_logits(hidden, previous, head_weight, codes), self.confidence(hidden, previous)

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """DSpark's confidence logits [...]: hidden [..., H] and each position's previous token [...]."""
        features = hidden
        if self.confidence_with_markov:
            embedding = self.markov_head.markov_w1(previous.long())
            features = torch.cat([hidden, embedding.to(hidden.dtype)], dim=-1)
        return self.confidence_head(features.to(self.confidence_head.proj.weight.dtype))

    def predicted_acceptance(self, hidden: torch.Tensor, anchors: torch.Tensor,
                             drafts: torch.Tensor) -> torch.Tensor | None:
        """DSpark's confidence head on a drafted block: each slot's predicted chance of acceptance [b, n] (hidden
        [b, n, H] of slots 1..n, anchors [b], drafts [b, n]: each slot's previous token is the one drafted
        before it); None for the other kinds."""
        if self.confidence_head is None:
            return None
        previous = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)
        return torch.sigmoid(self.confidence(hidden, previous).float())

    def _markov_path(self, hidden, anchors, head_weight, temperature, noise):
        """DSpark's drafts along the block: each position's logits biased by the token drafted before it."""
        previous, state, path, q_rows = anchors, None, [], []
        for position in range(hidden.shape[1]):
            code, state = self.markov_head.step(previous, hidden[:, position], state)
            logits = self.markov_logits(hidden[:, position], previous, head_weight, code)
            if temperature is None:
                previous = logits.argmax(-1)
            else:
                q = temperature_probs(logits, temperature)
                previous = race(q, noise[:, position])
                q_rows.append(q)
            path.append(previous)
        return torch.stack(path, dim=1), (torch.stack(q_rows, dim=1) if q_rows else None)

    def propose(self, hidden: torch.Tensor, anchors: torch.Tensor, head_weight: torch.Tensor,
                temperature: torch.Tensor | None = None,
                noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [b, n] for the block's positions 1..n (hidden [b, n, H], anchors [b] the block's first token),
        as z-lab serves them, and the distribution q [b, n, V] they were drawn from (None when greedy).

        temperature None: greedy (the logits' argmax, or DFlash 2's candidate selector along the block). A 0-dim
        fp32 temperature > 0 with Exp(1) noise [b, n, V]: sampled by the exponential race (model/sampling.py),
        each slot from softmax(logits / T), or DFlash 2's selector sampling along the block. DSpark: each
        position's logits biased by its Markov head with the token drafted before it, greedy or sampled."""
        if self.markov_head is not None:
            return self._markov_path(hidden, anchors, head_weight, temperature, noise)
        logits = self.logits(hidden.to(head_weight.dtype), head_weight)
        if self.candidate_selector is not None:
            return self.candidate_selector.select(hidden, logits, anchors, temperature, noise)
        if temperature is None:
            return logits.argmax(-1), None
        probs = temperature_probs(logits, temperature)
        return race(probs, noise), probs

    # ---- Hugging Face directory in the published drafters' format -------------------------------

    def save_pretrained(self, directory: str | Path, state_dict: dict | None = None) -> Path:
        """state_dict: the weights to write when this module holds only a shard of them (FSDP)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in (state_dict or self.state_dict()).items()}
        config = copy.deepcopy(self.config)
        if self.kind in AUTO_MAP:
            config.auto_map = dict(AUTO_MAP[self.kind])
        config.dtype = next(v.dtype for v in state.values() if v.is_floating_point())  # what dtype="auto" loads
        config.save_pretrained(directory)
        shutil.copyfile(modeling_dflash.__file__, directory / MODELING_FILE)
        storage.publish_file(directory / "model.safetensors",
                             lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{directory} has no config.json: not a drafter checkpoint directory")
        raw = json.loads(config_path.read_text())
        if not set(ARCHITECTURES.values()) & set(raw.get("architectures") or []):
            raise ValueError(f"{config_path}: architectures {raw.get('architectures')} names none of "
                             f"{sorted(ARCHITECTURES.values())}")
        config = Qwen3Config.from_pretrained(directory)
        with torch.device("meta"):
            model = cls(config)
        state = load_file(directory / "model.safetensors")
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"{directory}: checkpoint keys do not match (missing {missing}, unexpected {unexpected})")
        model.rotary_emb = Qwen3RotaryEmbedding(config)
        return model.to(dtype if dtype is not None else torch.get_default_dtype())

    @classmethod
    def initialised(cls, config: Qwen3Config, device, seed: int) -> DFlashDrafter:
        """A new drafter built straight on `device` (no CPU copy of 1 B parameters to fill and move):
        the same seed gives the same weights on the same kind of device."""
        model = cls.empty(config, device)
        torch.manual_seed(seed)
        model.reset_parameters()
        return model

    @classmethod
    def empty(cls, config: Qwen3Config, device) -> DFlashDrafter:
        """Allocated on `device`, weights uninitialised (they are about to be loaded)."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.rotary_emb = Qwen3RotaryEmbedding(config).to(device)  # its buffers are computed, not loaded
        return model

    def _apply(self, fn, recurse=True):
        # RoPE's inverse frequencies stay exact float32 whatever dtype the weights are cast to, as serving
        # engines compute them: a bf16 cast rounds them by up to 0.4%, a phase error of radians at a
        # distance of 500 tokens, and a bf16 drafter would learn positions no engine gives it.
        super()._apply(fn, recurse)
        rotary = self.__dict__.get("_modules", {}).get("rotary_emb")
        if rotary is not None and rotary.inv_freq.dtype != torch.float32:
            self.rotary_emb = Qwen3RotaryEmbedding(self.config).to(rotary.inv_freq.device)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
