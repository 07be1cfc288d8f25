"""SpecForge 0.2.0's DFlash drafter, trained by SpecForge's own modules on our dumped features.

Install (its sglang, yunchang, wandb, ... are not used by the modules below, so not needed):

    pip install --no-deps specforge==0.2.0

SpecForge's: the draft model (specforge/modeling/draft/dflash.py DFlashDraftModel, its weight init), the
training wrapper with its anchor sampling, mask, block inputs, labels and loss (algorithms/common/
dflash_family_model.py OnlineDFlashModel, loss_type "dflash": CE on the data tokens, weights
exp(-(k-1)/gamma)), the target's embedding and LM head as it reads them (modeling/target/target_utils.py
TargetEmbeddingsAndHead), the step (training/strategies/base.py DFlashTrainStrategy, training/controller.py
TrainerCore with its accumulation window and loss normalisation, training/backend.py FSDPTrainingBackend, here
unwrapped: one process) and the optimizer (optimizer.py BF16Optimizer: clipped AdamW, torch's betas, over fp32
masters of the train.dtype draft).

Ours: the features (our trainer's dump, read in our trainer's order), the draft's shape (our drafter config, as
SpecForge's draft_model_config JSON gives it), and the learning-rate schedule (ours replaces BF16Optimizer's).
gamma is drafter.gamma, else ours by block size (7 for 16), the value SpecForge's DFlash recipes set
(training.loss_decay_gamma; its schema's default, None, trains without the decay). Attention: SpecForge's
flex_attention on GPUs, its eager path on CPUs (its flex mask has no backward there; its eager path is the
one that zeroes padding blocks).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

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

NAME, DIST, VERSION = "specforge", "specforge", "0.2.0"
INSTALL = "pip install --no-deps specforge==0.2.0"
MODULES = ("specforge.modeling.draft.dflash", "specforge.algorithms.common.dflash_family_model",
           "specforge.modeling.target.target_utils", "specforge.training.strategies.base",
           "specforge.training.controller", "specforge.training.backend", "specforge.optimizer",
           "specforge.runtime.contracts")


def modules():
    return import_peer(DIST, VERSION, INSTALL, *MODULES)


@dataclass
class SpecForgeRun:
    draft: torch.nn.Module  # SpecForge's DFlashDraftModel
    model: torch.nn.Module  # its OnlineDFlashModel around it
    strategy: object
    core: object  # its TrainerCore
    optimizer: object  # its BF16Optimizer


def attention_backend(device: torch.device) -> str:
    return "flex_attention" if device.type == "cuda" else "eager"


def build(inputs: PeerInputs) -> SpecForgeRun:
    draft_mod, family, target_utils, strategies, controller, backend_mod, optim, _ = modules()
    cfg, device, dtype = inputs.cfg, inputs.device, inputs.dtype
    config = copy.deepcopy(inputs.drafter_config)
    config._attn_implementation = attention_backend(device)
    torch.manual_seed(cfg.train.seed)
    draft = draft_mod.DFlashDraftModel(config).to(device=device, dtype=dtype)
    check_architecture(draft)
    parts = target_utils.TargetEmbeddingsAndHead.from_pretrained(cfg.target.path, device=device.type, dtype=dtype,
                                                                 trust_remote_code=cfg.target.trust_remote_code)
    model = family.OnlineDFlashModel(
        draft_model=draft, target_lm_head=parts.lm_head, target_embed_tokens=parts.embed_tokens,
        mask_token_id=int(config.dflash_config["mask_token_id"]), block_size=int(config.block_size),
        attention_backend=config._attn_implementation, num_anchors=cfg.train.num_anchors,
        loss_decay_gamma=inputs.gamma, loss_type="dflash",
    ).to(device=device, dtype=dtype)
    train = cfg.train
    factory = partial(optim.BF16Optimizer, lr=train.lr, weight_decay=train.weight_decay,
                      max_grad_norm=train.max_grad_norm, total_steps=train.steps, warmup_ratio=train.warmup_ratio)
    backend = backend_mod.FSDPTrainingBackend(backend_mod.ParallelConfig(), optimizer_factory=factory)
    backend.prepare_model(model, wrap=False, optimizer_target=draft)
    backend.optimizer.scheduler = our_schedule(backend.optimizer.optimizer, cfg)  # the same schedule as ours
    strategy = strategies.DFlashTrainStrategy(model)
    core = controller.TrainerCore(strategy, backend, accumulation_steps=inputs.per_step)
    return SpecForgeRun(draft, model, strategy, core, backend.optimizer)


def check_architecture(draft) -> None:
    """SpecForge's DFlash variants our format cannot hold, refused (our config asks for none of them; a newer
    SpecForge might change what its class builds)."""
    if set(draft.layer_types) != {"full_attention"}:
        raise PeerRefused(f"SpecForge's draft has {sorted(set(draft.layer_types))} layers; our format holds full "
                          "attention only")
    variants = {"projector_type": draft.projector_type, "shift_label": draft.shift_label,
                "pure_draft_prefix_len": draft.pure_draft_prefix_len}
    if any(variants.values()):
        raise PeerRefused(f"SpecForge's draft is a variant ({variants}) our format does not hold")


def train_step(run: SpecForgeRun, micro_batches: list[dict[str, torch.Tensor]]) -> float:
    """One optimizer step: SpecForge's TrainerCore over the step's micro-batches (its accumulation window)."""
    (contracts,) = import_peer(DIST, VERSION, INSTALL, "specforge.runtime.contracts")
    result = None
    for mb in micro_batches:
        batch = contracts.TrainBatch(
            sample_ids=[str(i) for i in range(mb["input_ids"].shape[0])], strategy="dflash",
            tensors={"input_ids": mb["input_ids"], "hidden_states": mb["features"], "loss_mask": mb["loss_mask"]})
        result = run.core.train_step(batch)
    if not result.optimizer_stepped:
        raise RuntimeError("SpecForge's TrainerCore did not step at the end of the accumulation window")
    return float(result.loss)


def state_dict(run: SpecForgeRun) -> dict[str, torch.Tensor]:
    """The draft's weights as SpecForge saves them (its strategy's checkpoint filter)."""
    return run.strategy.checkpoint_state_filter(run.model.state_dict())


def train(inputs: PeerInputs, out: Path) -> dict:
    run = build(inputs)
    clock, losses, tokens = TrainClock(inputs.device), [], []
    for step, (micro_batches, flops) in enumerate(step_micro_batches(inputs), 1):
        with clock:
            losses.append(train_step(run, micro_batches))
        clock.step_flops.append(flops)
        tokens.append(int(sum(mb["attention_mask"].sum() for mb in micro_batches)))
        say_step(inputs.cfg, step, losses[-1], clock)
    publish(out, inputs.drafter_config, state_dict(run), NAME, inputs.dtype)
    summary = summary_of(NAME, DIST, inputs, losses, clock, tokens, out,
                         objective="dflash: CE on the data tokens, weights exp(-(k-1)/gamma)",
                         gamma=inputs.gamma, attention=attention_backend(inputs.device),
                         optimizer="BF16Optimizer (AdamW, betas 0.9/0.999, fp32 masters)",
                         max_grad_norm=inputs.cfg.train.max_grad_norm)
    write_summary(out, summary)
    return summary
