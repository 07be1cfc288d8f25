"""After training: does the drafter that is published score what the run measured?

Teacher-forced per-slot accuracy on the same held-out rows with the same anchors, twice:
- as trained: the in-memory drafter on the features the trainer computes (right-padded micro-batches,
  FrozenTarget.features: the tapped or hooked forward);
- as served: the published drafter, reloaded from its HF directory, on the features the target's own
  forward gives for one unpadded row at a time (what speculative decoding and serving engines feed it).
Both use the dense SDPA mask, so a gap is not attention-kernel noise. A drafter that reads a future token
in training (a leak in the features or the mask) or a publishing fault scores far lower as served; a flat
per-slot curve alone is no such sign (real drafters have them), so the flag rests on this gap.
"""

from __future__ import annotations

import torch

from ..infra.console import console
from ..model.drafter import DFlashDrafter
from .evaluate import teacher_forced_accuracy

# Mean per-slot accuracy as trained minus as served above which the run is flagged: bf16 features and
# weights move single argmaxes, not the mean of thousands of them by a tenth.
GAP_FLAG = 0.1
ANCHOR_SEED_OFFSET = 11  # the anchors of both passes (train.seed + this)


def serving_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids) -> torch.Tensor:
    """[b, S, K*H]: each row's tapped-layer outputs from the model's own forward over its real tokens only
    (HF hidden_states[l + 1]), zeros on padding (no block sees a padding position's feature)."""
    rows = []
    for r in range(input_ids.shape[0]):
        n = int(attention_mask[r].sum())
        out = target.model(input_ids[r:r + 1, :n], use_cache=False, output_hidden_states=True, logits_to_keep=1)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]
        rows.append(torch.nn.functional.pad(feats, (0, 0, 0, input_ids.shape[1] - n)))
    return torch.stack(rows)


def check_published(cfg, drafter, drafter_dir, target, eval_stream, batches: int = 2) -> dict:
    """Per-slot accuracy as trained and as served, their mean gap, and whether it is flagged (logged)."""
    device = target.embed_weight.device
    was_training = drafter.training
    drafter.eval()
    # The same rows and anchors (seed offset) for both; the trainer's features for the first.
    trained = teacher_forced_accuracy(cfg, drafter, target, eval_stream, batches, seed_offset=ANCHOR_SEED_OFFSET)
    drafter.train(was_training)
    published = DFlashDrafter.from_pretrained(drafter_dir).to(device=device, dtype=drafter.fc.weight.dtype).eval()
    served = teacher_forced_accuracy(cfg, published, target, eval_stream, batches, seed_offset=ANCHOR_SEED_OFFSET,
                                     features=lambda b: serving_features(target, b.input_ids, b.attention_mask,
                                                                         published.target_layer_ids))
    gap = sum(trained) / len(trained) - sum(served) / len(served)
    result = {"slot_accuracy_as_trained": trained, "slot_accuracy_as_served": served, "mean_gap": gap,
              "flagged": gap > GAP_FLAG}
    curve = lambda acc: " ".join(f"{a:.2f}" for a in acc)
    console.print(f"serving check: per-slot accuracy as trained {curve(trained)}; as served (published drafter, "
                  f"the target's own unpadded forward) {curve(served)}", soft_wrap=True)
    if result["flagged"]:
        console.print(f"[bold red]warning:[/] the published drafter scores {gap:.2f} lower (mean per-slot accuracy) "
                      "on the features serving computes than the run measured on its own: it probably learned "
                      "from something serving never shows it (a leak in the training features or mask, or a "
                      "publishing fault). Its tau in this run is not what serving will see; see the "
                      "troubleshooting table under evaluation", soft_wrap=True)
    return result
