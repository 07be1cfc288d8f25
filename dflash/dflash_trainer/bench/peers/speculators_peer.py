"""vLLM speculators 0.9.0's DFlash drafter, trained by speculators' own modules on our dumped features.

Install (speculators and hs-connectors without their dependencies: they would move torch and pull its vLLM client;
pydantic-settings, loguru and openai, which its modules below import, with theirs: openai's HTTP client):

    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 && pip install pydantic-settings python-dotenv loguru openai

speculators': the settings (speculators/train/config/schema.py TrainConfig with speculator_type "dflash": its
resolved defaults, the objective among them), the draft model built as its CLI builds one from a draft config
(speculators/models/dflash/core.py DFlashDraftModel.from_training_args: weight init, the frozen embedding, LM head
and final norm read from the target), its anchor selection, mask, block inputs and targets, its loss
(models/dflash/metrics.py over speculators/losses: "ce" against the target's argmax, D-PACE position weights;
the fused Triton loss on GPUs, its eager twin on CPUs), its optimizers (train/optimizers.py build_optimizers:
Muon for the matrices, AdamW for the rest, its weight decays), and its step as speculators/train/trainer.py
Trainer.train_epoch runs it: fp32 master weights, the forward under autocast to the hidden-state dtype (bf16 for
train.dtype bfloat16), backward, gradients clipped to norm 1.0, every optimizer, then every scheduler. The step
is restated here (six lines) because that method also owns speculators' data loader, checkpoints and logging.

Ours: the features (our trainer's dump, in our trainer's order), the draft's shape (our drafter config, as
speculators' --draft-config gives it), and the learning-rate schedule (ours, one per optimizer as speculators
keeps them; lr and Muon's lr both train.lr, as speculators sets Muon's by default).

Where speculators differs in what it reads:
- it trains on packed sequences (one [1, T] row per step, document ids): the step's micro-batches are packed row
  by row (each row's real tokens, positions from 0 per row, padding as document -1), and max_anchors is
  train.num_anchors times the step's rows: the same anchors per step as ours draws.
- its targets are the target's own next-token logits (verifier_norm + verifier_lm_head over the target's last
  hidden state). Our dump lacks that hidden state: it is computed here by the target (target.path) as vLLM
  captures it for speculators (--include-last-layer: the output of the last decoder layer, before the final
  norm), once per micro-batch, outside the timed training steps.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ...run.loading import load_target
from ...target.frozen import text_config
from .common import (
    PeerInputs,
    PeerRefused,
    TrainClock,
    import_peer,
    our_schedule,
    publish,
    say_step,
    step_micro_batches,
    summary_of,
    write_summary,
)

NAME, DIST, VERSION = "speculators", "speculators", "0.9.0"
INSTALL = "pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 && pip install pydantic-settings python-dotenv loguru openai"
MODULES = ("speculators.models.dflash", "speculators.train.config.schema", "speculators.train.optimizers",
           "speculators.utils.loading")
CLIP = 1.0  # speculators/train/trainer.py Trainer.train_epoch: clip_grad_norm_(model.parameters(), 1.0)


def modules():
    return import_peer(DIST, VERSION, INSTALL, *MODULES)


@dataclass
class SpeculatorsRun:
    model: torch.nn.Module  # speculators' DFlashDraftModel (its draft, and the frozen target parts it holds)
    optimizers: list
    schedulers: list
    call_kwargs: dict  # its train_call_kwargs: loss, gamma, anchors, position weighting
    settings: dict  # its flattened, resolved TrainConfig
    hidden_dtype: torch.dtype  # its hidden_states_dtype: the features' dtype and autocast's


def attention_implementation(device: torch.device) -> str:
    return "simple_flex_attention" if device.type == "cuda" else "sdpa"


def settings(inputs: PeerInputs) -> dict:
    """speculators' own TrainConfig for a DFlash run, resolved (its defaults for all that this run does not set)
    and flattened as its CLI hands it to the model classes."""
    _, schema, _, _ = modules()
    cfg, dconfig = inputs.cfg, inputs.drafter_config
    rows = cfg.train.micro_batch * inputs.per_step
    on_gpu = inputs.device.type == "cuda"
    resolved = schema.TrainConfig(
        speculator_type="dflash", seed=cfg.train.seed,
        verifier={"verifier_name_or_path": cfg.target.path, "trust_remote_code": cfg.target.trust_remote_code},
        draft={"num_layers": dconfig.num_hidden_layers, "mask_token_id": int(dconfig.dflash_config["mask_token_id"]),
               "target_layer_ids": list(dconfig.dflash_config["target_layer_ids"]),
               "draft_vocab_size": dconfig.vocab_size, "draft_attn_impl": attention_implementation(inputs.device)},
        data={"max_anchors": cfg.train.num_anchors * rows, "hidden_states_dtype": cfg.train.dtype},
        loss={"loss_implementation": "fused" if on_gpu else "eager"},
        dflash={"block_size": int(dconfig.block_size)},
        optimizer={"lr": cfg.train.lr, "muon_lr": cfg.train.lr},
    )
    return resolved.flatten()


def build(inputs: PeerInputs) -> SpeculatorsRun:
    dflash, _, optimizers_mod, _ = modules()
    if inputs.cfg.train.dtype == "float16":  # its schema refuses float16 hidden states (no gradient scaling)
        raise PeerRefused("speculators trains in bfloat16 or float32 only: set train.dtype = bfloat16 or float32")
    flat = settings(inputs)
    torch.manual_seed(inputs.cfg.train.seed)  # speculators' CLI: set_seed(args.seed) before building the draft
    layer_config = copy.deepcopy(inputs.drafter_config)  # what its --draft-config gives
    model = dflash.DFlashDraftModel.from_training_args(verifier_config=layer_config, t2d=None, d2t=None, **flat)
    model = model.to(inputs.device)  # fp32 master weights, as its trainer keeps them
    check_architecture(model)
    optimizers = optimizers_mod.build_optimizers(model, SimpleNamespace(**flat))
    schedulers = [our_schedule(opt, inputs.cfg) for opt in optimizers]
    call_kwargs, _ = dflash.DFlashDraftModel.get_trainer_kwargs(**flat)
    return SpeculatorsRun(model, optimizers, schedulers, call_kwargs, flat, getattr(torch, flat["hidden_states_dtype"]))


def check_architecture(model) -> None:
    """speculators' DFlash variants our format cannot hold, refused."""
    if model.use_draft_vocab:
        raise PeerRefused(f"speculators' draft has a reduced vocabulary ({model.draft_vocab_size} of "
                          f"{model.verifier_vocab_size}) and its own LM head; our drafter borrows the target's")
    if model.config.sample_from_anchor:
        raise PeerRefused("speculators' draft samples from the anchor slot (sample_from_anchor); ours drafts the "
                          "block_size - 1 slots after it")
    if model.uses_sliding_window_attn:
        raise PeerRefused("speculators' draft has sliding-window layers; our format holds full attention only")


def pack(micro_batches: list[dict[str, torch.Tensor]], last_hidden: list[torch.Tensor],
         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The step's rows as one packed sequence in speculators' batch layout ([1, T] tensors with document ids):
    each row's real tokens in turn, positions from 0 per row, then padding (document -1) to the step's width."""
    rows = [(mb, hid, r) for mb, hid in zip(micro_batches, last_hidden) for r in range(mb["input_ids"].shape[0])]
    width = sum(mb["input_ids"].shape[1] for mb, _, _ in rows)
    first = micro_batches[0]
    device = first["input_ids"].device
    packed = {
        "input_ids": torch.zeros(1, width, dtype=first["input_ids"].dtype, device=device),
        "loss_mask": torch.zeros(1, width, dtype=first["loss_mask"].dtype, device=device),
        "document_ids": torch.full((1, width), -1, dtype=torch.long, device=device),
        "position_ids": torch.zeros(1, width, dtype=torch.long, device=device),
        "hidden_states": torch.zeros(1, width, first["features"].shape[-1], dtype=dtype, device=device),
        "verifier_last_hidden_states": torch.zeros(1, width, last_hidden[0].shape[-1], dtype=dtype, device=device),
    }
    at = 0
    for doc, (mb, hid, r) in enumerate(rows):
        n = int(mb["attention_mask"][r].sum())
        span = slice(at, at + n)
        packed["input_ids"][0, span] = mb["input_ids"][r, :n]
        packed["loss_mask"][0, span] = mb["loss_mask"][r, :n]
        packed["document_ids"][0, span] = doc
        packed["position_ids"][0, span] = torch.arange(n, device=device)
        packed["hidden_states"][0, span] = mb["features"][r, :n].to(dtype)
        packed["verifier_last_hidden_states"][0, span] = hid[r, :n].to(dtype)
        at += n
    return packed


def train_step(run: SpeculatorsRun, batch: dict[str, torch.Tensor]) -> float:
    """speculators/train/trainer.py Trainer.train_epoch's step, one batch per optimizer step."""
    model, device_type = run.model, batch["input_ids"].device.type
    model.train()
    with torch.autocast(device_type, dtype=run.hidden_dtype, enabled=run.hidden_dtype != torch.float32):
        _, loss, _ = model(**batch, **run.call_kwargs)
    for opt in run.optimizers:
        opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    for opt in run.optimizers:
        opt.step()
    for scheduler in run.schedulers:
        scheduler.step()
    return float(loss.detach())


def state_dict(run: SpeculatorsRun) -> dict[str, torch.Tensor]:
    """The draft's weights as speculators saves them: without what it reloads from the target on load (its
    instance's _keys_to_ignore_on_save: the embedding, the full-vocabulary LM head, verifier_lm_head and
    verifier_norm)."""
    ignored = set(run.model._keys_to_ignore_on_save)
    return {k: v for k, v in run.model.state_dict().items() if k not in ignored}


def last_hidden_target(inputs: PeerInputs):
    """The target tapped at its last decoder layer: the hidden state speculators' targets are computed from."""
    last = text_config(inputs.target_config).num_hidden_layers - 1
    return load_target(inputs.cfg, [last], inputs.device, inputs.target_config)


def resident_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def train(inputs: PeerInputs, out: Path) -> dict:
    run = build(inputs)
    before = resident_gib(inputs.device)
    target = last_hidden_target(inputs)
    target_gib = None if before is None else resident_gib(inputs.device) - before
    clock, losses, tokens = TrainClock(inputs.device), [], []
    for step, (micro_batches, flops) in enumerate(step_micro_batches(inputs), 1):
        last_hidden = [target.features(mb["input_ids"], mb["attention_mask"]) for mb in micro_batches]
        batch = pack(micro_batches, last_hidden, run.hidden_dtype)
        with clock:
            losses.append(train_step(run, batch))
        clock.step_flops.append(flops)
        tokens.append(int((batch["document_ids"] >= 0).sum()))
        say_step(inputs.cfg, step, losses[-1], clock)
    del target
    publish(out, inputs.drafter_config, state_dict(run), NAME, inputs.dtype)
    flat = run.settings
    summary = summary_of(NAME, DIST, inputs, losses, clock, tokens, out,
                         objective=f"{flat['loss_fn']} against the target's argmax, position weights "
                                   f"{flat['per_position_loss_weight']} (alpha {flat['dpace_alpha']})",
                         max_anchors=flat["max_anchors"], attention=flat["draft_attn_impl"],
                         loss_implementation=flat["loss_implementation"],
                         optimizer=f"{flat['optimizer']} (weight decay {flat['weight_decay']}, Muon's "
                                   f"{flat['muon_weight_decay']}), fp32 masters, autocast {flat['hidden_states_dtype']}",
                         max_grad_norm=CLIP,
                         # the target held for its last hidden states: in peak_memory_gib, not in our trainer's
                         target_memory_gib=target_gib)
    write_summary(out, summary)
    return summary
