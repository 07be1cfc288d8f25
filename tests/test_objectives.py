"""Objectives against the target's distribution (train.loss_kl, train.loss_tv, mixed with CE): the chunked loss
against a plain reference, the target's position for each block slot, the target's final hidden states in the
features (colocated, dumped), the config's checks, and a tiny run that learns with them."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.model.loss import Objective, chunked_block_loss

CASES = {
    "kl": Objective(ce=0.0, kl=1.0),
    "tv": Objective(ce=0.0, tv=1.0),
    "dspark": Objective(ce=0.1, tv=0.9),
    "all": Objective(ce=0.3, kl=0.5, tv=2.0),
}


def reference_loss(logits, target_logits, labels, weights, objective):
    """The terms written as plainly as possible (speculators' eager `ce` on the data's token, `kl_div`, `tv`)."""
    log_q = F.log_softmax(logits.float(), -1)
    p = F.softmax(target_logits.float(), -1)
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    kl = F.kl_div(log_q, p, reduction="none").sum(-1)
    tv = 1 - torch.minimum(log_q.exp(), p).sum(-1)
    return ((objective.ce * ce + objective.kl * kl + objective.tv * tv) * weights).sum()


def random_case(seed, b=2, blocks=5, block=4, hidden=16, vocab=60):
    g = torch.Generator().manual_seed(seed)
    rows = blocks * block
    h = torch.randn(b, rows, hidden, generator=g)
    target = torch.randn(b, rows, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g) * 0.5
    labels = torch.randint(vocab, (b, rows), generator=g)
    weights = torch.rand(b, rows, generator=g) * (torch.rand(b, rows, generator=g) > 0.3)
    weights.view(b, blocks, block)[:, :, 0] = 0  # slot 0, the anchor, never carries loss (build_blocks)
    return h, target, head, labels, weights


def _shaped(raw, multiplier, softcap):
    scaled = raw * multiplier
    return torch.tanh(scaled / softcap) * softcap if softcap else scaled


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("shaping", [(1.0, None), (0.7, 3.0)])
def test_mixtures_and_their_gradients_match_the_plain_reference(name, shaping):
    objective = CASES[name]
    h, target, head, labels, weights = random_case(0)
    hidden = h.clone().requires_grad_()
    scale = torch.tensor(0.8, requires_grad=True)  # the backward must apply the incoming gradient and flow on
    sums = chunked_block_loss(hidden * scale, head, labels, weights, 4, chunk_rows=7, output_multiplier=shaping[0],
                              final_logit_softcapping=shaping[1], objective=objective, target_hidden=target)
    got = torch.autograd.grad(2.0 * sums.weighted_loss, (hidden, scale))
    ref_hidden = h.clone().requires_grad_()
    logits = _shaped((ref_hidden * scale) @ head.T, *shaping)
    target_logits = _shaped(target @ head.T, *shaping)
    ref = reference_loss(logits.view(-1, 60), target_logits.view(-1, 60), labels.view(-1), weights.view(-1), objective)
    want = torch.autograd.grad(2.0 * ref, (ref_hidden, scale))
    torch.testing.assert_close(sums.weighted_loss, ref)
    torch.testing.assert_close(got, want)
    hit = (logits.argmax(-1) == labels) & (weights > 0)  # the slot accuracy stays the data token's
    assert sums.slot_correct.tolist() == hit.view(-1, 4).sum(0).float().tolist()


@pytest.mark.parametrize("name", ["ce", "dspark", "all"])
@pytest.mark.parametrize("shaping", [(1.0, None), (0.7, 3.0)])
def test_a_trained_logit_bias_and_the_acceptance_match_autograd(name, shaping):
    """logit_bias (DSpark's Markov head): codes @ W^T added after the target's transform; the loss, the acceptance
    sum_v min(p_v, q_v) (q of the label without the target) and the gradients of the hidden states, the codes and W
    equal autograd's over the plain reference."""
    objective = Objective() if name == "ce" else CASES[name]
    h, target, head, labels, weights = random_case(6)
    g = torch.Generator().manual_seed(8)
    codes0, bias0 = torch.randn(2, 20, 5, generator=g), torch.randn(60, 5, generator=g) * 0.5
    given = [t.clone().requires_grad_() for t in (h, codes0, bias0)]
    with_target = objective.needs_target
    sums = chunked_block_loss(given[0], head, labels, weights, 4, chunk_rows=7, output_multiplier=shaping[0],
                              final_logit_softcapping=shaping[1], objective=objective,
                              target_hidden=target if with_target else None, logit_bias=(given[1], given[2]),
                              acceptance=True)
    got = torch.autograd.grad(sums.weighted_loss, given)
    ref = [t.clone().requires_grad_() for t in (h, codes0, bias0)]
    logits = _shaped(ref[0] @ head.T, *shaping) + ref[1] @ ref[2].T
    target_logits = _shaped(target @ head.T, *shaping)
    want = reference_loss(logits.view(-1, 60), target_logits.view(-1, 60), labels.view(-1), weights.view(-1),
                          objective)
    torch.testing.assert_close(sums.weighted_loss, want)
    torch.testing.assert_close(got, torch.autograd.grad(want, ref))
    q = torch.softmax(logits.detach(), -1)
    accept = torch.minimum(q, torch.softmax(target_logits, -1)).sum(-1) if with_target else \
        q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(sums.acceptance, accept.view(2, 5, 4)[:, :, 1:].reshape(-1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_equals_unchunked_and_no_grad_equals_grad(name):
    h, target, head, labels, weights = random_case(1)
    hidden = h.clone().requires_grad_()
    kw = {"objective": CASES[name], "target_hidden": target}
    small = chunked_block_loss(hidden, head, labels, weights, 4, chunk_rows=3, **kw)
    whole = chunked_block_loss(hidden, head, labels, weights, 4, chunk_rows=10_000, **kw)
    torch.testing.assert_close(small.weighted_loss, whole.weighted_loss)
    torch.testing.assert_close(torch.autograd.grad(small.weighted_loss, hidden)[0],
                               torch.autograd.grad(whole.weighted_loss, hidden)[0])
    with torch.no_grad():  # evaluation: the same sums, no gradient work
        torch.testing.assert_close(chunked_block_loss(h, head, labels, weights, 4, chunk_rows=5, **kw).weighted_loss,
                                   whole.weighted_loss.detach())


def test_unscored_positions_add_nothing():
    h, target, head, labels, weights = random_case(2)
    hidden = h.clone().requires_grad_()
    objective = CASES["all"]
    sums = chunked_block_loss(hidden, head, labels, weights, 4, chunk_rows=6, objective=objective,
                              target_hidden=target)
    (grad,) = torch.autograd.grad(sums.weighted_loss, hidden)
    unscored = weights == 0
    assert grad[unscored].abs().max() == 0 and grad[~unscored].abs().max() > 0
    moved_target, moved_labels = target.clone(), labels.clone()  # what an unscored position holds does not matter
    moved_target[unscored] = torch.randn_like(moved_target[unscored])
    moved_labels[unscored] = (moved_labels[unscored] + 1) % 60
    again = chunked_block_loss(h, head, moved_labels, weights, 4, chunk_rows=6, objective=objective,
                               target_hidden=moved_target)
    torch.testing.assert_close(again.weighted_loss, sums.weighted_loss.detach())


def test_tv_is_one_minus_the_acceptance_chance_and_zero_on_the_target_itself():
    h, _, head, labels, weights = random_case(3)
    same = chunked_block_loss(h, head, labels, weights, 4, objective=Objective(ce=0.0, tv=1.0), target_hidden=h)
    assert abs(float(same.weighted_loss)) < 1e-5
    kl = chunked_block_loss(h, head, labels, weights, 4, objective=Objective(ce=0.0, kl=1.0), target_hidden=h)
    assert abs(float(kl.weighted_loss)) < 1e-4


def test_ce_alone_takes_the_default_path_exactly():
    """Objective(ce=1) is the default CE, bit for bit; ce alone at another weight scales it; no target needed."""
    h, _, head, labels, weights = random_case(4)
    hidden = h.clone().requires_grad_()
    default = chunked_block_loss(hidden, head, labels, weights, 4, chunk_rows=5)
    same = chunked_block_loss(hidden, head, labels, weights, 4, chunk_rows=5, objective=Objective())
    half = chunked_block_loss(hidden, head, labels, weights, 4, chunk_rows=5, objective=Objective(ce=0.5))
    assert torch.equal(default.weighted_loss, same.weighted_loss)
    assert torch.equal(torch.autograd.grad(default.weighted_loss, hidden)[0],
                       torch.autograd.grad(same.weighted_loss, hidden)[0])
    torch.testing.assert_close(half.weighted_loss, 0.5 * default.weighted_loss)
    with pytest.raises(ValueError, match="target_hidden"):
        chunked_block_loss(h, head, labels, weights, 4, objective=CASES["tv"])


@pytest.mark.slow
def test_the_compiled_mixture_matches_the_reference_for_any_chunk_length_in_one_graph():
    """COMPILED_MIXTURE (the GPU training path; Inductor's CPU code here) gives the eager mixture's loss,
    gradient, hits and CE, and the reference's gradient over the logits, for chunks of different lengths (a
    run's last chunk is shorter) from one graph: after the compile step a second graph would be an error."""
    from dflash_trainer.model.loss import compiled_mixture_and_grad, mixture_and_grad
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]  # counters outlive reset(): other tests in this process compiled
    objective = CASES["all"]
    g = torch.Generator().manual_seed(7)
    for rows in (24, 24, 11):
        logits, target_logits = (torch.randn(rows, 300, generator=g) * 3 for _ in range(2))
        labels, weights = torch.randint(300, (rows,), generator=g), torch.rand(rows, generator=g)
        got = compiled_mixture_and_grad(logits, target_logits, labels, weights, objective)
        for a, b in zip(got, mixture_and_grad(logits, target_logits, labels, weights, objective, True), strict=True):
            torch.testing.assert_close(a, b)
        ref_logits = logits.clone().requires_grad_()
        ref = reference_loss(ref_logits, target_logits, labels, weights, objective)
        torch.testing.assert_close(got[0].sum(), ref.detach())
        torch.testing.assert_close(got[1], torch.autograd.grad(ref, ref_logits)[0])
    assert counters["stats"]["unique_graphs"] - graphs == 1


def plain_dpace(ce, carries, block, alpha):
    """speculators' dpace_loss_decay, one block and one slot at a time."""
    weights = torch.zeros_like(ce)
    for start in range(0, len(ce), block):
        prefix, running = [], 1.0
        for k in range(block):
            if carries[start + k]:
                running *= (1 - alpha) * math.exp(-float(ce[start + k])) + alpha
            prefix.append(running if carries[start + k] else 0.0)
        for k in range(block):
            weights[start + k] = sum(prefix[k:]) if carries[start + k] else 0.0
    return weights


@pytest.mark.parametrize("name", ["ce", "dspark"])
def test_dpace_weights_the_positions_by_the_accepted_run_they_can_start(name):
    """position_weighting = dpace: each position's weight from the drafter's confidence in its token (no gradient
    through it), as speculators computes it; the loss is normalised by those weights' sum."""
    from dflash_trainer.model.loss import dpace_weights

    objective = {"ce": Objective(ce=0.5), "dspark": CASES["dspark"]}[name]
    h, target, head, labels, weights = random_case(5)
    hidden = h.clone().requires_grad_()
    sums = chunked_block_loss(hidden, head, labels, weights, 4, chunk_rows=5, target_hidden=target,
                              objective=Objective(objective.ce, objective.kl, objective.tv, dpace_alpha=0.3))
    (grad,) = torch.autograd.grad(sums.weighted_loss, hidden)
    ref_hidden = h.clone().requires_grad_()
    logits = (ref_hidden @ head.T).view(2, 5, 4, 60)[:, :, 1:].reshape(-1, 60)  # slot 0 carries nothing
    target_logits = (target @ head.T).view(2, 5, 4, 60)[:, :, 1:].reshape(-1, 60)
    keep = weights.view(2, 5, 4)[:, :, 1:].reshape(-1) > 0
    ce = F.cross_entropy(logits.detach(), labels.view(2, 5, 4)[:, :, 1:].reshape(-1), reduction="none")
    position = plain_dpace(ce, keep, 3, 0.3)
    torch.testing.assert_close(dpace_weights(ce, keep, 3, 0.3), position)
    per_row = [reference_loss(logits[i:i + 1], target_logits[i:i + 1], labels.view(2, 5, 4)[:, :, 1:].reshape(-1)[i:i + 1],
                              torch.ones(1), objective) for i in range(len(position))]
    ref = sum(w * r for w, r in zip(position, per_row, strict=True))
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(sums.weighted_loss, ref.detach())
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(sums.weight, position.sum())
    assert not torch.allclose(position[keep], position[keep][0])  # the weights differ by slot and block


def _tiny_drafter(block=4):
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from transformers import Qwen3Config

    target = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return DFlashDrafter(drafter_config(target, DrafterShape(num_layers=1, block_size=block, mask_token_id=49)))


def test_each_block_slot_is_compared_with_the_target_one_position_before():
    """Slot k of the block at anchor a predicts x[a+k]; the target predicts that token from position a+k-1."""
    from dflash_trainer.model.objective import drafter_loss, prepare_micro_batch

    drafter = _tiny_drafter()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(49, (2, 24), generator=g)
    loss_mask = torch.ones(2, 24, dtype=torch.uint8)
    features = torch.randn(2, 24, len(drafter.target_layer_ids) * 32, generator=g)
    target_hidden = torch.randn(2, 24, 32, generator=g)
    embed, head = torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g)
    mb = prepare_micro_batch(ids, loss_mask, 3, drafter.config, 49, None, "sdpa", torch.Generator().manual_seed(1))
    with torch.no_grad():
        sums = drafter_loss(drafter, embed, head, features, mb.blocks, mb.attention, objective=CASES["kl"],
                            target_hidden=target_hidden)
        hidden = drafter(features, F.embedding(mb.blocks.token_ids, embed),
                         torch.cat([torch.arange(24).expand(2, 24), mb.blocks.position_ids], 1), mb.attention)
    rows = torch.zeros(2, 3 * 4, 32)
    for b in range(2):
        for j, anchor in enumerate(mb.blocks.anchors[b].tolist()):
            for k in range(1, 4):
                rows[b, j * 4 + k] = target_hidden[b, min(anchor + k - 1, 23)]
    want = chunked_block_loss(hidden, head, mb.blocks.labels, mb.blocks.weights, 4, objective=CASES["kl"],
                              target_hidden=rows)
    torch.testing.assert_close(sums.weighted_loss, want.weighted_loss)
    shifted = chunked_block_loss(hidden, head, mb.blocks.labels, mb.blocks.weights, 4, objective=CASES["kl"],
                                 target_hidden=rows.roll(1, dims=1))
    assert abs(float(shifted.weighted_loss - want.weighted_loss)) > 1e-3  # the check can fail


@pytest.mark.parametrize("tapped", [True, False])
def test_the_final_hidden_state_is_what_the_lm_head_reads_and_features_are_unchanged(tapped):
    from dflash_trainer.target.frozen import FrozenTarget
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         attn_implementation="sdpa"))
    target = FrozenTarget(model, [0, 2])
    target.tapped = tapped
    ids = torch.randint(50, (2, 12))
    feats, final = target.features_and_final(ids, torch.ones_like(ids))
    assert torch.equal(feats, target.features(ids, torch.ones_like(ids)))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    torch.testing.assert_close(final, out.hidden_states[-1])
    torch.testing.assert_close(final @ model.lm_head.weight.T, out.logits)


def _config(tiny_target, out, *extra):
    return load_config("embedded", [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={out}", "train.micro_batch=4",
        "train.num_anchors=8", "train.checkpoint_every=0", "train.log_every=1", "eval.prompts=2",
        "eval.max_new_tokens=8", *extra,
    ])


def test_loss_weights_are_checked():
    with pytest.raises(ConfigError, match="all 0, so the loss is 0"):
        load_config("embedded", ["train.loss_ce=0"])
    with pytest.raises(ConfigError, match=r"train.loss_tv = -0.5: must be >= 0"):
        load_config("embedded", ["train.loss_tv=-0.5"])
    c = load_config("embedded", ["train.loss_ce=0.1", "train.loss_tv=0.9"])
    assert (c.train.loss_ce, c.train.loss_kl, c.train.loss_tv) == (0.1, 0.0, 0.9)
    defaults = load_config("embedded").train
    assert (defaults.loss_ce, defaults.loss_kl, defaults.loss_tv) == (1.0, 0.0, 0.0)


def test_the_colocated_source_adds_the_final_states_only_for_a_loss_that_reads_them(tiny_target, tmp_path):
    from dflash_trainer.distributed.sources import local_source
    from dflash_trainer.run.loading import load_data, load_target, load_tokenizer

    cfg = _config(tiny_target, tmp_path / "run")
    tokenizer = load_tokenizer(cfg)
    stream, _, _ = load_data(cfg, tokenizer)
    cpu = torch.device("cpu")
    target = load_target(cfg, [0, 1], cpu)
    plain = next(local_source(stream, target, [0], torch.float32, cpu))
    both = next(local_source(stream, target, [0], torch.float32, cpu, with_final=True))
    assert plain.target_hidden is None and torch.equal(plain.features, both.features)
    assert both.target_hidden.shape == (*both.features.shape[:2], target.config.hidden_size)


def test_the_dump_holds_the_final_states_only_for_a_loss_that_reads_them(tiny_target, tmp_path):
    from dflash_trainer.data.features import TARGET_HIDDEN, FeatureShards
    from dflash_trainer.run.loading import feature_buckets, target_config
    from dflash_trainer.run.target_rank import dump_features
    from safetensors import safe_open

    tv = ["train.loss_ce=0.1", "train.loss_tv=0.9"]
    plain_dir, tv_dir = tmp_path / "plain", tmp_path / "tv"
    dump_features(_config(tiny_target, tmp_path / "a"), plain_dir, 1)
    dump_features(_config(tiny_target, tmp_path / "b", *tv), tv_dir, 1)
    plain, with_states = FeatureShards(plain_dir), FeatureShards(tv_dir)
    assert not plain.has_target_hidden and with_states.has_target_hidden
    with safe_open(plain_dir / "mb-00000000.safetensors", "pt") as f:
        assert TARGET_HIDDEN not in f.keys()  # noqa: SIM118 - safe_open is not a dict
    a, b = plain.load(0, "cpu"), with_states.load(0, "cpu")
    assert torch.equal(a["features"], b["features"])  # the features themselves are the same either way
    assert b[TARGET_HIDDEN].shape[:2] == a["features"].shape[:2]
    cfg = _config(tiny_target, tmp_path / "c", *tv)
    layers = json.loads((plain_dir / "meta.json").read_text())["target_layer_ids"]
    with pytest.raises(ConfigError, match="holds no final hidden states of the target"):
        feature_buckets(cfg, plain, target_config(cfg), layers, lead=False)
    assert feature_buckets(cfg, with_states, target_config(cfg), layers, lead=False)


@pytest.mark.parametrize("loss", [["train.loss_ce=0.1", "train.loss_tv=0.9"], ["train.loss_ce=0", "train.loss_kl=1"],
                                  ["train.position_weighting=dpace"]])
def test_a_tiny_run_learns_with_the_loss_against_the_target(tiny_target, tmp_path, loss):
    from dflash_trainer.train import run

    summary = run(_config(tiny_target, tmp_path / "run", "train.steps=8", "train.lr=3e-3", *loss))
    assert len(summary["losses"]) == 8
    assert summary["final_loss"] < summary["first_loss"]
    if "train.loss_tv=0.9" in loss:  # 0.9 TV + 0.1 CE (at most 0.9 + 0.1 CE), not the CE alone (about log V)
        from transformers import AutoTokenizer

        assert summary["first_loss"] < 0.5 * math.log(len(AutoTokenizer.from_pretrained(tiny_target["target"])))


@pytest.mark.parametrize("rows, chunk", [(11, 5), (10, 5), (1, 5), (5, 5), (6, 5), (1025, 512), (3, 2)])
def test_chunks_cover_the_rows_once_and_none_but_a_lone_row_has_one_row(rows, chunk):
    """A compiled mixture kernel marked dynamic in its rows would compile a graph of its own for a chunk of one
    row (after the compile step: an error); the last such chunk joins the one before it."""
    from dflash_trainer.model.loss import chunk_slices

    slices = chunk_slices(rows, chunk)
    assert [i for s in slices for i in range(rows)[s]] == list(range(rows))
    sizes = [s.stop - s.start for s in slices]
    assert all(n >= 2 for n in sizes) or sizes == [1]
    assert max(sizes) <= chunk + 1
