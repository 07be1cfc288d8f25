"""The serving check after training: a drafter trained on leaky features is flagged, an honest one is not.

The leak is built in: "features" whose position t carries the embedding of token t + 2, so a block whose
anchor is a reads its slot-1 label (token a + 1) from the context position a - 1 it is allowed to see. Such
a drafter scores well on the features it trained on and badly on the target's own forward.
"""

import torch
from dflash_trainer.config import load_config
from dflash_trainer.data.rows import Batch
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.optim import MasterWeightAdamW
from dflash_trainer.run.serve_check import GAP_FLAG, check_published, serving_features
from dflash_trainer.target.frozen import FrozenTarget
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.training import sdpa_step

BLOCK = 4


class LeakyTarget(FrozenTarget):
    def features(self, input_ids, attention_mask=None):
        honest = super().features(input_ids, attention_mask)
        ahead = torch.roll(input_ids, -2, dims=1)  # position t holds token t + 2
        leak = self.embed_weight[ahead].repeat(1, 1, honest.shape[-1] // self.embed_weight.shape[1])
        return 30 * leak


class Stream:
    """The two members of data.MicroBatches that check_published uses."""

    def __init__(self, batches):
        self.batches, self.per_epoch = batches, len(batches)

    def batch(self, i):
        return self.batches[i]


def rows(tokenizer, count=8, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, len(tokenizer), (count, length), generator=g)
    attention = torch.ones_like(ids)
    attention[count // 2:, length - 9:] = 0  # right padding on half the rows
    loss_mask = attention.to(torch.uint8)
    loss_mask[:, :4] = 0  # a short "prompt"
    return Batch(ids, loss_mask, attention, 0)


def trained_drafter(target, tokenizer, batch, steps):
    config = drafter_config(target.config, DrafterShape(num_layers=1, block_size=BLOCK,
                                                        mask_token_id=tokenizer.mask_token_id))
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    opt = MasterWeightAdamW(drafter.parameters(), lr=3e-3, max_grad_norm=1.0)
    feats = target.features(batch.input_ids, batch.attention_mask)
    for step in range(steps):
        sdpa_step(drafter, opt, target, batch.input_ids, batch.loss_mask, feats, 16, step)
    return drafter


def run_check(tiny_target, tmp_path, target_cls, steps):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], dtype=torch.float32)
    layer_ids = drafter_config(model.config, DrafterShape(num_layers=1, block_size=BLOCK,
                                                          mask_token_id=0)).dflash_config["target_layer_ids"]
    target = target_cls(model, layer_ids)
    batch = rows(tokenizer)
    drafter = trained_drafter(target, tokenizer, batch, steps)
    drafter.save_pretrained(tmp_path / "drafter")
    cfg = load_config("embedded", ["train.num_anchors=16"])
    return check_published(cfg, drafter, tmp_path / "drafter", target, Stream([batch]))


def test_serving_features_are_the_targets_own_forward_per_row(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target["target"])
    batch = rows(tokenizer)
    target = FrozenTarget(model, [0, 1])
    served = serving_features(target, batch.input_ids, batch.attention_mask, [0, 1])
    trained = target.features(batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(served[real], trained[real], rtol=1e-4, atol=1e-4)
    assert served[~real].abs().max() == 0


def test_a_drafter_that_learned_a_leak_is_flagged(tiny_target, tmp_path, capsys):
    result = run_check(tiny_target, tmp_path, LeakyTarget, steps=80)
    trained, served = result["slot_accuracy_as_trained"], result["slot_accuracy_as_served"]
    assert len(trained) == len(served) == BLOCK - 1
    assert trained[0] > 0.5  # slot 1 read straight from the leak
    assert result["flagged"] and result["mean_gap"] > GAP_FLAG
    assert "probably learned from something serving never shows it" in capsys.readouterr().err.replace("\n", " ")


def test_an_honest_drafter_is_not_flagged(tiny_target, tmp_path, capsys):
    result = run_check(tiny_target, tmp_path, FrozenTarget, steps=20)
    assert not result["flagged"]
    assert abs(result["mean_gap"]) < 0.02
    assert "warning" not in capsys.readouterr().err
