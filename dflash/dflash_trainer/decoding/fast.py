"""Speculative and target-only decoding (greedy, or sampled at a temperature) run the way serving engines run them.

The same decoding as decoding/speculative.py's reference loops (the same tokens, the same acceptance lengths), on
fixed shapes: the target's KV cache is a static buffer of `length` slots, the drafter keeps the K/V of its
fused context per layer in slots beside it, and every tensor a step reads is allocated once per batch shape.
On a GPU one speculative step (drafter block, target verify, acceptance, drafter context update) and one
target-only step are each recorded once as a CUDA graph and replayed; the host reads back only each step's
target tokens and acceptance lengths. On a CPU the same steps run eagerly. Sampled decoding (speculative.Sampling)
draws its noise into fixed buffers before each step, from the seeded generator outside the recorded step, in
the reference loop's order and shapes: at batch 1 both loops consume the same random numbers.

Slots: every verify writes its B tokens to the slots [w, w + B) of every row; `slot_pos[row, slot]` holds the
true position of the token a slot holds, or INVALID. The attention masks are built from these positions (a
causal mask, and a window on sliding-window layers), so a rejected draft is rolled back on every layer kind by
marking its slots INVALID: nothing is copied. Rows of a batch accept different numbers of tokens; the write
pointer advances by the largest, and a row that accepted fewer leaves INVALID holes that the masks skip.
When the slots run out the valid ones are packed to the front (rare: see `cache_length`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from ..model.drafter import DFlashDrafter
from ..model.sampling import race, temperature_probs
from ..target.frozen import FrozenTarget, text_config
from .buckets import bucket
from .speculative import Sampling, SpecResult, cache_argument, rejection_sample

INVALID = -1  # slot_pos of a slot that holds no token a query may see


class SlotLayer(CacheLayerMixin):
    """One layer's static K/V: written at the owner's current slots, read whole (the masks select)."""

    is_compileable = True
    is_sliding = False  # every layer keeps all its slots: the sliding window is in the mask

    def __init__(self, owner: SlotCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states) -> None:
        shape = (*key_states.shape[:2], self.owner.length)
        self.keys = key_states.new_zeros(*shape, key_states.shape[-1])
        self.values = value_states.new_zeros(value_states.shape[0], value_states.shape[1], self.owner.length,
                                             value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.owner.slots, key_states)
        self.values.index_copy_(2, self.owner.slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.owner.length, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0  # positions and masks always come from the caller

    def get_max_length(self) -> int:
        return self.owner.length

    def get_max_cache_shape(self) -> int:
        return self.owner.length


class SlotCache(Cache):
    """The target's static KV cache; `slots` ([n] long) says where the next forward's n tokens go."""

    def __init__(self, num_layers: int, length: int, device):
        self.length = length
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values)]


def layer_kinds(config) -> list[str]:
    """The attention kinds of the target's layers (full_attention, sliding_attention), as its masks name them."""
    tc = text_config(config)
    kinds = getattr(tc, "layer_types", None)
    if kinds:
        return sorted(set(kinds))
    return ["sliding_attention" if getattr(tc, "sliding_window", None) else "full_attention"]


def target_masks(config, slot_pos: torch.Tensor, query_pos: torch.Tensor, dtype: torch.dtype):
    """Additive masks [b, 1, Q, L] by slot positions: one tensor, or {kind: mask} for a model of several kinds."""
    seen = (slot_pos[:, None, :] >= 0) & (slot_pos[:, None, :] <= query_pos[:, :, None])
    masks = {}
    for kind in layer_kinds(config):
        allowed = seen
        if kind == "sliding_attention":
            allowed = seen & (query_pos[:, :, None] - slot_pos[:, None, :] < text_config(config).sliding_window)
        masks[kind] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _rotate(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class DrafterContext:
    """Per drafter layer, the K/V of the fused context by slot (the reference loop recomputes them each step)."""

    def __init__(self, drafter: DFlashDrafter, batch: int, length: int, device, dtype):
        c = drafter.config
        shape = (batch, c.num_key_value_heads, length, c.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in drafter.layers]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in drafter.layers]

    def tensors(self) -> list[torch.Tensor]:
        return self.keys + self.values

    def write(self, drafter: DFlashDrafter, fused, positions, slots) -> None:
        """fused [b, n, H] (drafter.fuse of the target features), positions [b, n], slots [n]."""
        b, n, _ = fused.shape
        cos, sin = drafter.rotary_emb(fused, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer, keys, values in zip(drafter.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(fused).view(b, n, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(fused).view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            keys.index_copy_(2, slots, _rotate(k, cos, sin))
            values.index_copy_(2, slots, v)


def _drafter_layer(layer, x, keys, values, cos, sin, mask):
    """DrafterLayer.forward with the context's K/V read from the slots instead of recomputed."""
    attn = layer.self_attn
    b, q_len, _ = x.shape

    def attend(h):
        q = attn.q_norm(attn.q_proj(h).view(b, q_len, attn.num_heads, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(b, q_len, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(h).view(b, q_len, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, torch.cat([keys, k], 2), torch.cat([values, v], 2), attn_mask=mask,
                                             enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(b, q_len, attn.num_heads * attn.head_dim))

    x = x + layer.attention_part(x, attend)
    return x + layer.mlp_part(x)


class Graphed:
    """fn() (it reads and writes only tensors allocated before) replayed as a CUDA graph; called plainly on a
    CPU, or when the model cannot be captured (a mixture of experts routes on the host): then it says so."""

    def __init__(self, fn: Callable, device: torch.device, log: Callable[[str], None] = print):
        self.fn, self.graph, self.out = fn, None, None
        if device.type != "cuda":
            return
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # kernels chosen and workspaces allocated before the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.out = fn()
        except RuntimeError as exc:
            # The capture's end reports only that something failed inside it: the first error says what.
            first = exc.__context__ if isinstance(exc.__context__, Exception) else exc
            log(f"fast decoding: the step cannot be recorded as a CUDA graph ({type(first).__name__}: "
                f"{str(first).splitlines()[0] if str(first) else ''}); it runs eagerly on the static cache")
            torch.cuda.synchronize(device)
            return
        self.graph = graph

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


def cache_length(prompt_width: int, max_new_tokens: int, block: int, batch: int) -> int:
    """Slots per row: the prompt, the answer and two blocks; at batch > 1 half an answer more for the holes
    rows that accept less leave (packed away when they fill it). Rounded up to a few shapes (few graphs)."""
    return bucket(prompt_width + max_new_tokens + 2 * block + (max_new_tokens // 2 if batch > 1 else 0))


def _cut(new: list[int], stop_ids: set[int], room: int) -> tuple[list[int], bool]:
    """new cut after its first stop token and to the room left: (kept, the row is done)."""
    stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
    kept = (new if stop is None else new[: stop + 1])[:room]
    return kept, stop is not None or len(kept) >= room


class StaticDecoder:
    """One batch shape (rows, slots): the static state, the recorded steps, and the host loops over them.

    drafter None: target-only decoding only."""

    def __init__(self, target: FrozenTarget, drafter: DFlashDrafter | None, batch: int, length: int,
                 log: Callable[[str], None] = print, sampled: bool = False):
        """sampled: the steps sample (a Sampling is given with each call) instead of taking the argmax."""
        self.target, self.drafter, self.model = target, drafter, target.model
        self.batch, self.length = batch, length
        self.device = target.embed_weight.device
        self.dtype = target.embed_weight.dtype
        self.cache_arg = cache_argument(self.model)
        self.block = drafter.block_size if drafter is not None else 1
        long = {"dtype": torch.long, "device": self.device}
        self.slot_pos = torch.full((batch, length), INVALID, **long)
        self.anchor = torch.zeros(batch, **long)  # the last verified token of each row
        self.anchor_pos = torch.zeros(batch, **long)  # its position
        self.limit_pos = torch.zeros(batch, **long)  # the row's prompt length + max_new_tokens
        self.base = torch.zeros((), **long)  # the write pointer w
        self.offsets = torch.arange(self.block, **long)
        self.cache = SlotCache(text_config(self.model.config).num_hidden_layers, length, self.device)
        self.step_slots = torch.zeros(self.block, **long)
        self.greedy_slots = torch.zeros(1, **long)
        self.context = None
        if drafter is not None:
            self.context = DrafterContext(drafter, batch, length, self.device, drafter.fc.weight.dtype)
        # Sampled steps read the temperature and their noise from these buffers (Sampling fills them per step).
        self.sampled, self.sampling = sampled, None
        vocab = target.head_weight.shape[0]
        floats = {"dtype": torch.float32, "device": self.device}
        self.temperature = torch.ones((), **floats)
        if sampled:
            self.step_noise = torch.ones(batch, vocab, **floats)  # the replacement, bonus or target-only token
            self.draft_noise = torch.ones(batch, self.block - 1, vocab, **floats)
            self.uniforms = torch.zeros(batch, self.block - 1, **floats)
        self.written = 0  # the host's copy of the write pointer
        self.packs = 0  # times the valid slots were packed to the front (_make_room)
        self._warm_cache()
        # A decoder serves one kind of decoding: only its step is recorded.
        self.spec_step = Graphed(self._spec_step, self.device, log) if drafter is not None else None
        self.greedy_step = Graphed(self._greedy_step, self.device, log) if drafter is None else None

    # ---- device steps (fixed shapes, no host reads) ---------------------------------------------
    def _forward(self, ids, positions, hidden: bool, **extra):
        masks = target_masks(self.model.config, self.slot_pos, positions, self.dtype)
        return self.model(ids, position_ids=positions, attention_mask=masks, use_cache=True,
                          output_hidden_states=hidden, **{self.cache_arg: self.cache}, **extra)

    def _warm_cache(self) -> None:
        """The cache's buffers allocated (a forward at slot 0) before any step is recorded."""
        self.cache.slots = self.greedy_slots
        self._forward(self.anchor[:, None], self.anchor_pos[:, None], hidden=False)

    def _greedy_step(self) -> torch.Tensor:
        self.cache.slots = self.greedy_slots
        torch.add(self.offsets[:1], self.base, out=self.greedy_slots)
        positions = self.anchor_pos[:, None]
        self.slot_pos.index_copy_(1, self.greedy_slots, positions)
        logits = self._forward(self.anchor[:, None], positions, hidden=False).logits[:, -1]
        token = race(temperature_probs(logits, self.temperature), self.step_noise) if self.sampled else logits.argmax(-1)
        self.anchor.copy_(token)
        self.anchor_pos.add_(1)
        return token

    def _draft(self, positions, in_block) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The drafter's guesses for the block's slots 1..B-1 [b, B-1] (DFlash 2: its selector's path; DSpark:
        its Markov head's), when sampling their distribution q [b, B-1, V], and DSpark's predicted acceptance of
        each slot [b, B-1]."""
        drafter, embed = self.drafter, self.target.embed_weight
        ids = torch.full_like(positions, drafter.mask_token_id)
        ids[:, 0] = self.anchor
        embeds = F.embedding(ids, embed).to(drafter.fc.weight.dtype)
        cos, sin = drafter.rotary_emb(embeds, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = embeds * drafter.input_embedding_scale if drafter.input_embedding_scale != 1.0 else embeds
        # The drafter sees the verified context (not the block's own slots, written this step) and its block.
        context = (self.slot_pos >= 0) & (self.slot_pos < self.anchor_pos[:, None])
        mask = torch.cat([context, in_block], 1)[:, None, None, :]
        for layer, keys, values in zip(drafter.layers, self.context.keys, self.context.values, strict=True):
            x = _drafter_layer(layer, x, keys, values, cos, sin, mask)
        sampled = (self.temperature, self.draft_noise) if self.sampled else (None, None)
        hidden = drafter.norm(x)[:, 1:]
        drafts, probs = drafter.propose(hidden, self.anchor, self.target.head_weight, *sampled)
        return drafts, probs, drafter.predicted_acceptance(hidden, self.anchor, drafts)

    def _spec_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft, verify, accept, update the drafter's context: (tokens [b, B], accepted [b], DSpark's predicted
        acceptance [b, B-1] or None); a row keeps its first accepted + 1 tokens (the accepted drafts, then the
        target's next token)."""
        drafter = self.drafter
        self.cache.slots = self.step_slots
        torch.add(self.offsets, self.base, out=self.step_slots)
        positions = self.anchor_pos[:, None] + self.offsets
        self.slot_pos.index_copy_(1, self.step_slots, positions)
        # The reference loop's last block is cut to the tokens left: slots past it are hidden from the drafter.
        in_block = self.offsets < (self.limit_pos - self.anchor_pos)[:, None]
        drafts, draft_probs, confidence = self._draft(positions, in_block)
        out = self._forward(torch.cat([self.anchor[:, None], drafts], 1), positions, hidden=True)
        if self.sampled:
            accepted, following = rejection_sample(draft_probs, temperature_probs(out.logits, self.temperature),
                                                   drafts, self.uniforms, self.step_noise, in_block[:, 1:].sum(1))
            posterior = torch.cat([drafts, following[:, None]], 1).scatter(1, accepted[:, None], following[:, None])
        else:
            posterior = out.logits.argmax(-1)
            agree = (drafts == posterior[:, :-1]) & in_block[:, 1:]
            accepted = agree.long().cumprod(1).sum(1)
        features = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        self.context.write(drafter, drafter.fuse(features.to(drafter.fc.weight.dtype)), positions, self.step_slots)
        # The rejected drafts' slots are rolled back on every layer; a finished row (at its token limit, or
        # stopped: the host set its limit to 0) keeps nothing, so its slots do not grow while others go on.
        live = self.anchor_pos < self.limit_pos
        keep = (self.offsets <= accepted[:, None]) & live[:, None]
        self.slot_pos.index_copy_(1, self.step_slots, torch.where(keep, positions, INVALID))
        self.anchor.copy_(posterior.gather(1, accepted[:, None])[:, 0])
        self.anchor_pos.add_(accepted + 1)
        return posterior, accepted, confidence

    # ---- host side ------------------------------------------------------------------------------
    def _prefill(self, prompts: list[list[int]], max_new_tokens: int, hidden: bool) -> list[int]:
        """The prompts left-aligned to their end in slots [0, width), eagerly: each row's first token."""
        if not prompts or any(not p for p in prompts):
            raise ValueError("empty prompt: a prompt needs at least one token")
        width = max(map(len, prompts))
        rows = prompts + [prompts[0]] * (self.batch - len(prompts))  # a short last batch: copies, ignored
        ids = torch.zeros(self.batch, width, dtype=torch.long)
        positions = torch.zeros_like(ids)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
            positions[i, width - len(p):] = torch.arange(len(p))
        ids, positions = ids.to(self.device), positions.to(self.device)
        lengths = torch.tensor([len(p) for p in rows], device=self.device)
        pad = torch.arange(width, device=self.device) < (width - lengths)[:, None]
        self.slot_pos.fill_(INVALID)
        self.slot_pos[:, :width] = positions.masked_fill(pad, INVALID)
        self.cache.slots = torch.arange(width, device=self.device)
        out = self._forward(ids, positions, hidden=hidden, logits_to_keep=1)
        if hidden:
            drafter = self.drafter
            features = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
            self.context.write(drafter, drafter.fuse(features.to(drafter.fc.weight.dtype)), positions,
                               self.cache.slots)
        last = out.logits[:, -1]
        if self.sampled:  # the first token, sampled as the reference loop samples it
            last = race(self.sampling.probs(last), self.sampling.noise(self.batch, last.shape[-1], device=self.device))
        else:
            last = last.argmax(-1)
        self.anchor.copy_(last)
        self.anchor_pos.copy_(lengths)
        self.limit_pos.copy_(lengths + max_new_tokens)
        self._set_pointer(width)
        return self.anchor.tolist()[: len(prompts)]

    def _set_pointer(self, written: int) -> None:
        self.written = written
        self.base.fill_(written)

    def _make_room(self) -> None:
        """Pack every row's valid slots to the front (in slot order) when the next block would not fit."""
        if self.written + self.block <= self.length:
            return
        order = torch.sort((self.slot_pos < 0).to(torch.int8), dim=1, stable=True).indices
        self.slot_pos.copy_(self.slot_pos.gather(1, order))
        tensors = self.cache.tensors() + (self.context.tensors() if self.context is not None else [])
        for t in tensors:  # [b, heads, slots, d], rewritten in place: the recorded steps read these addresses
            t.copy_(t.gather(2, order[:, None, :, None].expand_as(t)))
        used = int((self.slot_pos >= 0).sum(1).max())
        if used + self.block > self.length:
            raise RuntimeError(f"fast decoding: {used} tokens and a block of {self.block} exceed the {self.length} "
                               "slots of the static cache")
        self._set_pointer(used)
        self.packs += 1

    def _use(self, sampling: Sampling | None) -> None:
        if (sampling is not None) != self.sampled:
            raise ValueError("this decoder was built for " + ("sampled" if self.sampled else "greedy") + " decoding")
        self.sampling = sampling
        if sampling is not None:
            self.temperature.fill_(sampling.temperature)

    def _draw(self, *buffers: torch.Tensor) -> None:
        """The next step's noise, in the reference loop's order: Exp(1) noise, and uniforms for acceptance."""
        for buffer in buffers:
            if buffer is self.uniforms:
                self.sampling.uniform_(buffer)
            else:
                self.sampling.exponential_(buffer)

    def speculative(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                    sampling: Sampling | None = None) -> list[SpecResult]:
        self._use(sampling)
        first = self._prefill(prompts, max_new_tokens, hidden=True)
        results = [SpecResult(tokens=list(p) + [t]) for p, t in zip(prompts, first, strict=True)]
        limits = [len(p) + max_new_tokens for p in prompts]
        active = [len(r.tokens) < n and r.tokens[-1] not in stop_ids for r, n in zip(results, limits, strict=True)]
        finished = [i for i, a in enumerate(active) if not a]
        while any(active):
            if finished:  # stopped rows draft and keep nothing more (see _spec_step)
                self.limit_pos[finished] = 0
                finished.clear()
            self._make_room()
            if self.sampled:
                self._draw(self.draft_noise, self.uniforms, self.step_noise)
            posterior, accepted, confidence = self.spec_step()
            rows = torch.cat([posterior, accepted[:, None]], 1).tolist()  # the step's one read (DSpark: two)
            predicted = confidence.tolist() if confidence is not None else None
            grown = 0
            for i, row in enumerate(rows[: len(prompts)]):
                if not active[i]:
                    continue
                r = results[i]
                if predicted is not None:  # the slots this step drafted: the block is cut at the token limit
                    r.confidence.append((predicted[i][: min(self.block - 1, limits[i] - len(r.tokens))], row[-1]))
                new, done = _cut(row[: row[-1] + 1], stop_ids, limits[i] - len(r.tokens))
                r.tokens.extend(new)
                r.accept_lengths.append(len(new))
                active[i] = not done
                if done:
                    finished.append(i)
                grown = max(grown, row[-1] + 1)
            self._set_pointer(self.written + grown)
        return results

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
               sampling: Sampling | None = None) -> list[list[int]]:
        """Target-only decoding: greedy, or sampled (sampling)."""
        self._use(sampling)
        first = self._prefill(prompts, max_new_tokens, hidden=False)
        seqs = [list(p) + [t] for p, t in zip(prompts, first, strict=True)]
        limits = [len(p) + max_new_tokens for p in prompts]
        active = [len(s) < n and s[-1] not in stop_ids for s, n in zip(seqs, limits, strict=True)]
        while any(active):
            if self.sampled:
                self._draw(self.step_noise)
            tokens = self.greedy_step().tolist()
            self._set_pointer(self.written + 1)
            for i, token in enumerate(tokens[: len(prompts)]):
                if active[i]:
                    seqs[i].append(token)
                    active[i] = len(seqs[i]) < limits[i] and token not in stop_ids
        return seqs


class FastDecoding:
    """Speculative and target-only decoding (greedy, or sampled with a speculative.Sampling) for many prompts,
    `batch_size` at a time, on static shapes (one StaticDecoder, so one recording of each step, per batch size,
    slot count and kind: greedy or sampled, any temperature)."""

    def __init__(self, target: FrozenTarget, drafter: DFlashDrafter | None = None, batch_size: int = 1,
                 log: Callable[[str], None] = print):
        self.target, self.drafter, self.batch_size, self.log = target, drafter, batch_size, log
        # (speculative, sampled) -> the last decoder of that kind, with its shape
        self._decoders: dict[tuple[bool, bool], tuple[tuple[int, int], StaticDecoder]] = {}
        self.setup_s = 0.0  # time spent building decoders (allocating, recording the steps): not decoding

    def decoder(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool, batch: int,
                sampled: bool = False) -> StaticDecoder:
        """The decoder of this shape, kept while shapes repeat; one per kind, so a new shape frees the old."""
        block = self.drafter.block_size if speculative else 1
        shape = (batch, cache_length(max(map(len, prompts)), max_new_tokens, block, batch))
        kind = (speculative, sampled)
        kept = self._decoders.get(kind)
        if kept is None or kept[0] != shape:
            self._decoders.pop(kind, None)
            if self.target.embed_weight.is_cuda:
                torch.cuda.empty_cache()
            drafter = self.drafter if speculative else None
            started = time.perf_counter()
            self._decoders[kind] = (shape, StaticDecoder(self.target, drafter, *shape, log=self.log, sampled=sampled))
            if self.target.embed_weight.is_cuda:
                torch.cuda.synchronize(self.target.embed_weight.device)
            self.setup_s += time.perf_counter() - started
        return self._decoders[kind][1]

    def describe(self) -> str:
        """How the steps ran, for the report: replayed CUDA graphs, or eagerly on the static cache."""
        steps = [step for _, d in self._decoders.values() for step in (d.spec_step, d.greedy_step) if step is not None]
        if steps and all(step.graph is not None for step in steps):
            return f"static cache, CUDA graphs, batch {self.batch_size}"
        return f"static cache, eager steps, batch {self.batch_size}"

    def batches(self, prompts: list[list[int]]) -> Iterable[list[list[int]]]:
        for start in range(0, len(prompts), self.batch_size):
            yield prompts[start : start + self.batch_size]

    @torch.inference_mode()
    def speculative(self, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: Iterable[int] = frozenset(), sampling: Sampling | None = None) -> list[SpecResult]:
        """sampling: speculative sampling at its temperature, from its generator; None: greedy."""
        if self.drafter is None:
            raise ValueError("speculative decoding needs a drafter: FastDecoding(target, drafter)")
        out, rows = [], min(self.batch_size, len(prompts))
        for batch in self.batches(prompts):
            decoder = self.decoder(batch, max_new_tokens, True, rows, sampled=sampling is not None)
            out += decoder.speculative(batch, max_new_tokens, set(stop_ids), sampling)
        return out

    @torch.inference_mode()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int,
               stop_ids: Iterable[int] = frozenset(), sampling: Sampling | None = None) -> list[list[int]]:
        """Target-only decoding: greedy, or sampled at sampling's temperature."""
        out, rows = [], min(self.batch_size, len(prompts))
        for batch in self.batches(prompts):
            decoder = self.decoder(batch, max_new_tokens, False, rows, sampled=sampling is not None)
            out += decoder.greedy(batch, max_new_tokens, set(stop_ids), sampling)
        return out
