"""The trainer's evaluation: tau by real speculative decoding (decoding/speculative.py, the loop dflash-eval runs too)
and per-slot teacher-forced accuracy on held-out data, before and after training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..decoding.fast import FastDecoding
from ..decoding.speculative import AcceptanceStats, SpecResult, speculative_generate, stop_token_ids
from ..infra import storage
from ..infra.console import console
from ..infra.dtypes import DTYPES
from ..model.drafter import DFlashDrafter
from ..model.objective import drafter_loss, prepare_micro_batch
from .loading import new_drafter

__all__ = ["AcceptanceStats", "SpecResult", "evaluate", "evaluate_before", "evaluate_saved", "evaluate_tau", "record_eval_prompts",
           "speculative_generate", "teacher_forced_accuracy"]

EVAL_PROMPTS_FILE = "eval_prompts.jsonl"


def evaluate_tau(drafter, target, prompts: list[list[int]], max_new_tokens: int,
                 stop_ids=frozenset(), batch_size: int = 1) -> AcceptanceStats:
    """tau by speculative decoding through fast_decode's loop (static cache; CUDA graphs on a GPU): the tokens
    and acceptance lengths of decoding/speculative.py's reference loop, at the speed dflash-eval and serving run."""
    was_training = drafter.training
    drafter.eval()
    stats = AcceptanceStats(drafter.block_size)
    loops = FastDecoding(target, drafter, batch_size, log=lambda line: console.print(line, markup=False))
    for prompt, r in zip(prompts, loops.speculative(prompts, max_new_tokens, stop_ids), strict=True):
        stats.add(r.accept_lengths, len(r.tokens) - len(prompt))
    drafter.train(was_training)
    return stats


def record_eval_prompts(out_dir: Path, prompts: list[list[int]]) -> Path:
    """The prompts tau was measured on, as rows dflash-eval reads (`dflash-eval --run OUTPUT`)."""
    path = Path(out_dir) / EVAL_PROMPTS_FILE
    storage.write_text_atomic(path, "".join(json.dumps({"id": str(i), "prompt_ids": p}) + "\n"
                                            for i, p in enumerate(prompts)))
    return path


# ---- evaluation during and after training (where the target is) ----------------------------------
@torch.no_grad()
def teacher_forced_accuracy(cfg, drafter, target, eval_stream, batches: int = 4, features=None,
                            seed_offset: int = 7) -> list[float]:
    """Per-slot accuracy on held-out data, the training objective's view (no target in the loop).

    features(batch) -> [b, S, K*H]: where the target features come from (default: the trainer's own,
    target.features on the padded micro-batch); seed_offset picks the anchors (the same offset, the same)."""
    block, device, dtype = drafter.block_size, target.embed_weight.device, drafter.fc.weight.dtype
    # The drafter's dtype (a no-op unless the target's differs, e.g. an fp32 target and a bf16 drafter).
    embed, head = target.embed_weight.to(dtype), target.head_weight.to(dtype)
    correct = torch.zeros(block, device=device)
    count = torch.zeros(block, device=device)
    g = torch.Generator(device=device).manual_seed(cfg.train.seed + seed_offset)
    for i in range(min(batches, eval_stream.per_epoch)):
        batch = eval_stream.batch(i).to(device)
        feats = (features(batch) if features else target.features(batch.input_ids, batch.attention_mask)).to(dtype)
        # The dense reference: no compiled variant is needed for this no-grad pass.
        mb = prepare_micro_batch(batch.input_ids, batch.loss_mask, cfg.train.num_anchors, drafter.config,
                                 drafter.mask_token_id, None, "sdpa", g)
        sums = drafter_loss(drafter, embed, head, feats, mb.blocks, mb.attention)
        correct += sums.slot_correct
        count += sums.slot_count
    return (correct[1:] / count[1:].clamp(min=1)).tolist()


def evaluate(cfg, drafter, target, tokenizer, eval_stream, prompts, label: str) -> dict:
    spec = evaluate_tau(drafter, target, prompts, cfg.eval.max_new_tokens, stop_token_ids(target.model, tokenizer))
    acc = teacher_forced_accuracy(cfg, drafter, target, eval_stream) if eval_stream is not None else []
    console.print(f"[bold]{label}[/]: {spec.summary()}; per-slot accuracy " + " ".join(f"{a:.2f}" for a in acc))
    return {"tau": spec.tau, "tau_per_request_mean": spec.tau_per_request_mean, "verify_steps": spec.verify_steps,
            "tokens": spec.tokens, "slot_acceptance": spec.slot_acceptance, "slot_accuracy": acc}


def slot_tau(slot_accuracy: list[float]) -> float:
    """tau a drafter of these per-slot accuracies would reach, slots taken as independent: a verify step
    adds one token plus the block's slots up to the first miss."""
    tau, all_right = 1.0, 1.0
    for accuracy in slot_accuracy:
        all_right *= accuracy
        tau += all_right
    return tau


BEFORE = "before training"
REBUILT = "before training (the run's initial drafter, rebuilt from its seed after training)"


def evaluate_before(cfg, drafter, target, tokenizer, eval_stream, prompts, label: str = BEFORE) -> dict:
    """tau before training as eval.before_training says: estimated by teacher forcing (the default: seconds),
    or decoded like the evaluation after training (minutes at real shapes). Its cost is said. label: REBUILT
    where it runs after training (a resumed run, a target rank), so its lines there say why."""
    started = time.perf_counter()
    if cfg.eval.before_training == "decode":
        result = evaluate(cfg, drafter, target, tokenizer, eval_stream, prompts, label)
    else:
        acc = teacher_forced_accuracy(cfg, drafter, target, eval_stream)
        result = {"tau": slot_tau(acc), "tau_method": "teacher-forced estimate", "slot_accuracy": acc}
        console.print(f"[bold]{label}[/]: tau {result['tau']:.2f} (teacher-forced estimate; "
                      'eval.before_training = "decode" decodes the prompts instead); per-slot accuracy '
                      + " ".join(f"{a:.2f}" for a in acc))
    console.print(f"evaluation {label}: {time.perf_counter() - started:.1f}s")
    return result


def evaluate_saved(cfg, target, tokenizer, eval_stream, prompts, drafter_dir: Path, device) -> tuple[dict, dict]:
    """tau of the initial drafter (same seed, rebuilt) and of the trained one saved in drafter_dir."""
    dtype = DTYPES[cfg.train.dtype]
    initial = new_drafter(cfg, target.config, tokenizer, device=device).to(dtype=dtype)  # as the run built it
    before = evaluate_before(cfg, initial, target, tokenizer, eval_stream, prompts, REBUILT)
    trained = DFlashDrafter.from_pretrained(drafter_dir).to(device=device, dtype=dtype)
    after = evaluate(cfg, trained, target, tokenizer, eval_stream, prompts, "after training")
    return before, after


def evaluation_scalars(summary: dict) -> dict[str, float]:
    """The end-of-run evaluation as tracker scalars: tau before and after, per-slot acceptance (decoding) and
    accuracy (teacher-forced) after training (slot k: the token k after the anchor), the serving check's gap."""
    values = {"eval/tau_before": summary["tau_before"], "eval/tau_after": summary["tau_after"]}
    for key, name in (("slot_acceptance_after", "slot_acceptance_after"), ("slot_accuracy_after", "slot_acc_after")):
        values.update({f"eval/{name}/{k:02d}": a for k, a in enumerate(summary.get(key) or [], start=1)})
    check = summary.get("serving_check")
    if isinstance(check, dict) and isinstance(check.get("mean_gap"), int | float):
        values["eval/serving_check_mean_gap"] = check["mean_gap"]
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
