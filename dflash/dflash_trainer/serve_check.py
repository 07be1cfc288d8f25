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

from .loading import console
from .model import DFlashDrafter
from .objective import drafter_loss, prepare_micro_batch

# Mean per-slot accuracy as trained minus as served above which the run is flagged: bf16 features and
# weights move single argmaxes, not the mean of thousands of them by a tenth.
GAP_FLAG = 0.1


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


@torch.no_grad()
def _slot_accuracy(cfg, drafter, target, batches, features_fn) -> list[float]:
    dtype = drafter.fc.weight.dtype
    embed, head = target.embed_weight.to(dtype), target.head_weight.to(dtype)
    device = embed.device
    correct = torch.zeros(drafter.block_size, device=device)
    count = torch.zeros(drafter.block_size, device=device)
    g = torch.Generator(device=device).manual_seed(cfg.train.seed + 11)  # the same anchors on both passes
    for batch in batches:
        feats = features_fn(batch).to(dtype)
        mb = prepare_micro_batch(batch.input_ids, batch.loss_mask, cfg.train.num_anchors, drafter.config,
                                 drafter.mask_token_id, None, "sdpa", g)
        sums = drafter_loss(drafter, embed, head, feats, mb.blocks, mb.attention)
        correct += sums.slot_correct
        count += sums.slot_count
    return (correct[1:] / count[1:].clamp(min=1)).tolist()


def check_published(cfg, drafter, drafter_dir, target, eval_stream, batches: int = 2) -> dict:
    """Per-slot accuracy as trained and as served, their mean gap, and whether it is flagged (logged)."""
    device = target.embed_weight.device
    rows = [eval_stream.batch(i).to(device) for i in range(min(batches, eval_stream.per_epoch))]
    was_training = drafter.training
    drafter.eval()
    trained = _slot_accuracy(cfg, drafter, target, rows, lambda b: target.features(b.input_ids, b.attention_mask))
    drafter.train(was_training)
    published = DFlashDrafter.from_pretrained(drafter_dir).to(device=device, dtype=drafter.fc.weight.dtype).eval()
    served = _slot_accuracy(cfg, published, target, rows, lambda b: serving_features(
        target, b.input_ids, b.attention_mask, published.target_layer_ids))
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
