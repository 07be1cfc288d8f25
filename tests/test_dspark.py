"""DSpark (drafter.kind = "dspark"): the Markov and confidence heads, their export in speculators' DSpark format
loaded by speculators' own DSparkDraftModel with equal logits, Markov bias and confidence, and drafting along
the block with the token drafted before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dflash_trainer.export.cli import main as export_main
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.objective import sdpa_attention
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.test_export import SPECULATORS

TARGET = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def dspark(head_type="vanilla", with_markov=True, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_config(TARGET, DrafterShape(
        num_layers=2, block_size=4, mask_token_id=7, kind="dspark", markov_rank=8, markov_head_type=head_type,
        confidence_head_with_markov=with_markov)))
    with torch.no_grad():  # a Markov bias large enough to change the drafts
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
        drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
    return drafter


@pytest.fixture(scope="session")
def speculators_dspark(tmp_path_factory):
    """speculators installed into a directory of this test session only, from the configured package index."""
    where = tmp_path_factory.mktemp("speculators")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(where),
                           *SPECULATORS], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        pytest.skip(f"speculators could not be installed ({done.stderr.strip()[-300:]})")
    sys.path.append(str(where))
    try:
        from speculators.models.dspark import DSparkDraftModel
    except ImportError as exc:
        pytest.skip(f"speculators 0.9.0 does not import here ({exc})")
    return DSparkDraftModel


@pytest.mark.slow
@pytest.mark.parametrize(("head_type", "with_markov"), [("vanilla", True), ("gated", False), ("rnn", True)])
def test_speculators_dspark_loads_the_export_with_equal_outputs(tmp_path, speculators_dspark, head_type,
                                                                 with_markov):
    ours = dspark(head_type, with_markov).eval()
    Qwen3ForCausalLM(TARGET).save_pretrained(tmp_path / "target")
    ours.save_pretrained(tmp_path / "drafter")
    assert export_main(["--format", "speculators", str(tmp_path / "drafter"), str(tmp_path / "out"),
                        "--target", str(tmp_path / "target")]) == 0
    theirs = speculators_dspark.from_pretrained(str(tmp_path / "out")).eval()
    assert type(theirs).__name__ == "DSparkDraftModel" and not theirs.config.sample_from_anchor
    assert theirs.config.markov_head_type == head_type and theirs.markov_head.markov_rank == 8
    theirs.config.transformer_layer_config._attn_implementation = "sdpa"  # CPU: no flex attention
    target = Qwen3ForCausalLM.from_pretrained(tmp_path / "target").eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 10, 2 * 64, generator=g)
    block = torch.tensor([[42, 7, 7, 7]])
    previous = torch.tensor([[42, 42, 11, 12]])  # each slot's previous block token (slot 1: the anchor)
    pos = torch.arange(14)[None]
    with torch.no_grad():
        hidden = ours(feats, target.get_input_embeddings()(block), pos, sdpa_attention(None))
        want_logits, want_confidence = ours.block_outputs(hidden, previous, target.lm_head.weight)
        x = theirs.embed_tokens(block)
        context = theirs.hidden_norm(theirs.fc(feats))
        rope = theirs.rotary_emb(feats, pos)
        for layer in theirs.layers:
            x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_ids=pos,
                      position_embeddings=rope)
        their_hidden = theirs.norm(x)
        bias = theirs.markov_head.block_bias(prev_token_ids=previous, hidden_states=their_hidden)
        got_logits = theirs.lm_head(their_hidden) + bias
        prev_emb = theirs.markov_head.prev_embeddings(previous)
        got_confidence = theirs.confidence_head(torch.cat([their_hidden, prev_emb], -1) if with_markov
                                                else their_hidden)
    torch.testing.assert_close(their_hidden, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias, want_logits - ours.logits(hidden, target.lm_head.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_confidence, want_confidence, rtol=1e-5, atol=1e-5)


def test_the_export_is_speculators_dspark_config_with_every_weight(tmp_path):
    ours = dspark("gated")
    Qwen3ForCausalLM(TARGET).save_pretrained(tmp_path / "target")
    ours.save_pretrained(tmp_path / "drafter")
    assert export_main(["--format", "speculators", str(tmp_path / "drafter"), str(tmp_path / "out"),
                        "--target", str(tmp_path / "target")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkDraftModel"]
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["confidence_head_with_markov"]) == (8, "gated", True)
    assert cfg["sample_from_anchor"] is False and cfg["speculators_config"]["algorithm"] == "dspark"
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(ours.state_dict())


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_propose_biases_each_slot_by_the_token_drafted_before(tmp_path, head_type):
    drafter = dspark(head_type).eval()
    drafter.save_pretrained(tmp_path / "d")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d")
    assert loaded.kind == "dspark" and loaded.markov_head.head_type == head_type
    g = torch.Generator().manual_seed(2)
    hidden, head = torch.randn(2, 3, 64, generator=g), torch.randn(300, 64, generator=g) * 0.1
    anchors = torch.tensor([5, 9])
    with torch.no_grad():
        tokens, q = loaded.propose(hidden, anchors, head)
        # Teacher-forced with its own drafts as the previous tokens, the block's logits pick the same drafts.
        previous = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
        logits, _ = loaded.block_outputs(hidden, previous, head)
        plain = loaded.logits(hidden, head).argmax(-1)
        noise = torch.empty(2, 3, 300).exponential_(generator=g)
        sampled, probs = loaded.propose(hidden, anchors, head, torch.tensor(0.7), noise)
    assert q is None and torch.equal(tokens, logits.argmax(-1))
    assert not torch.equal(tokens, plain)  # the bias changed some draft
    previous = torch.cat([anchors[:, None], sampled[:, :-1]], 1)
    torch.testing.assert_close(probs, torch.softmax(loaded.block_outputs(hidden, previous, head)[0] / 0.7, -1))
    assert torch.equal(sampled, (probs / noise).argmax(-1))


def dspark_case(seed=3):
    """Two rows of three blocks of 4 (slot 0 of each carries no loss): hidden, the target's, head, previous tokens,
    labels, weights."""
    g = torch.Generator().manual_seed(seed)
    hidden, target = (torch.randn(2, 12, 64, generator=g) for _ in range(2))
    head = torch.randn(300, 64, generator=g) * 0.2
    previous, labels = (torch.randint(0, 300, (2, 12), generator=g) for _ in range(2))
    weights = torch.rand(2, 12, generator=g)
    weights.view(2, 3, 4)[:, :, 0] = 0
    return hidden, target, head, previous, labels, weights


def trained(drafter):
    """The hidden states' gradient is checked beside these: every parameter the DSpark objective reaches."""
    return [*drafter.markov_head.parameters(), *drafter.confidence_head.parameters()]


def test_the_loss_is_the_mixture_over_biased_logits_plus_the_confidence_bce():
    """dspark_loss in chunks (each chunk's gradient computed in its forward) equals the whole computation written out,
    with the gradients of the hidden states and of both heads: speculators' terms on the Markov-biased logits and the
    BCE against sum_v min(q_v, p_v), over the scored slots; the slots' accuracy that of the biased logits."""
    from dflash_trainer.model.dspark.objective import dspark_loss
    from dflash_trainer.model.loss import Objective, scored_rows

    drafter = dspark("gated")
    h, target, head, previous, labels, weights = dspark_case()
    hidden = h.clone().requires_grad_()
    objective = Objective(ce=0.1, tv=0.9, kl=0.3)
    sums = dspark_loss(drafter, hidden, previous, labels, weights, head, objective, target, 0.7, chunk_rows=4)
    got = torch.autograd.grad(sums.weighted_loss, [hidden, *trained(drafter)])

    def rows(t):
        return scored_rows(t, 4)

    ref_hidden = h.clone().requires_grad_()
    hid, prev, lab, w = rows(ref_hidden), rows(previous), rows(labels), rows(weights)
    logits = hid @ head.T + drafter.markov_head.markov_w2(drafter.markov_head.step(prev, hid)[0])
    q, p = torch.softmax(logits, -1), torch.softmax(rows(target) @ head.T, -1)
    overlap = torch.minimum(p, q).sum(-1)
    mixture = (0.1 * torch.nn.functional.cross_entropy(logits, lab, reduction="none") + 0.9 * (1 - overlap)
               + 0.3 * (p * (p.log() - q.log())).sum(-1))
    confidence = drafter.confidence_head(torch.cat([hid, drafter.markov_head.markov_w1(prev)], -1))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(confidence, overlap.detach(), reduction="none")
    want = (w * (mixture + 0.7 * bce)).sum()
    torch.testing.assert_close(sums.weighted_loss, want)
    torch.testing.assert_close(got, torch.autograd.grad(want, [ref_hidden, *trained(drafter)], retain_graph=True))
    torch.testing.assert_close(sums.acceptance, overlap.detach())
    hit = (logits.argmax(-1) == lab) & (w > 0)
    assert sums.slot_correct.tolist() == [0.0, *hit.view(-1, 3).sum(0).float().tolist()]
    with torch.no_grad():  # evaluation: the same sums, no gradient work
        torch.testing.assert_close(dspark_loss(drafter, h, previous, labels, weights, head, objective, target, 0.7,
                                               chunk_rows=5).weighted_loss, want.detach())
    # Without the target's distribution, the acceptance is the drafter's probability of the data's token.
    ce_only = dspark_loss(drafter, hidden, previous, labels, weights, head, Objective(), None, 1.0)
    accept = q.gather(1, lab[:, None])[:, 0].detach()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
    want = (w * (torch.nn.functional.cross_entropy(logits, lab, reduction="none") + bce)).sum()
    torch.testing.assert_close(ce_only.weighted_loss, want)
    torch.testing.assert_close(torch.autograd.grad(ce_only.weighted_loss, [hidden, *trained(drafter)]),
                               torch.autograd.grad(want, [ref_hidden, *trained(drafter)]))


@pytest.mark.slow
@pytest.mark.parametrize("with_target", [True, False])
def test_the_compiled_objective_equals_the_eager_one_in_one_graph(with_target):
    """compiled_mixture (COMPILED_MIXTURE: the GPU path; Inductor's CPU code here) gives the eager path's loss,
    acceptance, slot accuracy and every gradient, and serves chunks of different lengths from one graph (after the
    compile step a second graph would be an error)."""
    from dflash_trainer.model.dspark.objective import dspark_loss
    from dflash_trainer.model.loss import Objective, mixture_rows_and_grad
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    drafter = dspark("gated")
    h, target, head, previous, labels, weights = dspark_case()
    objective = Objective(ce=0.1, tv=0.9, kl=0.3) if with_target else Objective()
    for chunk_rows in (8, 5):  # chunks of 8, 8, 2 rows; of 5, 5, 5, 3
        runs = []
        for compiled in (True, False):
            hidden = h.clone().requires_grad_()
            sums = dspark_loss(drafter, hidden, previous, labels, weights, head, objective,
                               target if with_target else None, 0.7, chunk_rows, compiled_mixture=compiled)
            runs.append((sums.weighted_loss, sums.acceptance, sums.slot_correct,
                         torch.autograd.grad(sums.weighted_loss, [hidden, *trained(drafter)])))
        torch.testing.assert_close(runs[0], runs[1])
    assert len(_debug_get_cache_entry_list(mixture_rows_and_grad.__code__)) == 1


@pytest.mark.parametrize(("settings", "refusal"), [
    (["drafter.markov_rank=64"], "drafter.markov_rank is a DSpark setting, and drafter.kind is dflash"),
    (["drafter.kind=dflash2", "drafter.confidence_loss_weight=2", "drafter.markov_head_type=gated"],
     "are DSpark settings, and drafter.kind is dflash2"),
    (["drafter.kind=dspark", "drafter.selector_top_k=4"], "is a DFlash 2 setting, and drafter.kind is dspark"),
    (["drafter.kind=dspark", "drafter.markov_head_type=rnn"], "markov_head_type"),
    (["drafter.kind=dspark", "train.position_weighting=dpace"], 'set train.position_weighting = "exp-decay"'),
])
def test_dspark_settings_beside_another_kind_are_refused(settings, refusal):
    from dflash_trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=refusal):
        load_config("embedded", settings)


def test_a_tiny_dspark_run_trains_resumes_publishes_and_is_evaluated(tiny_target, tmp_path):
    """drafter.kind = dspark with DSpark's 0.1 CE + 0.9 TV: the loss falls, a resume repeats the losses, the
    published directory loads back as DSpark and exports in speculators' format, and dflash-eval decodes it
    greedy (to the target's own tokens) and sampled."""
    import shutil

    from dflash_trainer.config import load_config
    from dflash_trainer.eval.cli import main as eval_main
    from dflash_trainer.train import run

    def config(out):
        return load_config("embedded", [
            f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
            f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={out}", "drafter.kind=dspark",
            "drafter.markov_rank=16", "train.loss_ce=0.1", "train.loss_tv=0.9", "train.steps=6", "train.lr=3e-3",
            "train.micro_batch=4", "train.num_anchors=8", "train.checkpoint_every=3", "train.log_every=1",
            "eval.prompts=2", "eval.max_new_tokens=8"])

    out = tmp_path / "run"
    summary = run(config(out))
    assert summary["final_loss"] < summary["first_loss"]
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    assert run(config(resumed), resume=True)["losses"] == summary["losses"][3:]
    ours = DFlashDrafter.from_pretrained(out / "drafter")
    assert ours.kind == "dspark" and ours.markov_head.rank == 16
    assert export_main(["--format", "speculators", str(out / "drafter"), str(tmp_path / "spec"),
                        "--target", tiny_target["target"]]) == 0
    where = tmp_path / "eval"
    assert eval_main(["--run", str(out), "--out", str(where), "--temperature", "0", "0.8"]) == 0
    evaluated = json.loads((where / "eval.json").read_text())
    report = evaluated["sets"]["held-out"]
    assert report["outputs_equal"] == 2 and report["tau"] == summary["tau_after"]
    assert report["confidence_calibration"]["reached"][0] == report["verify_steps"]
    sampled = evaluated["by_temperature"]["0.8"]["sets"]["held-out"]
    assert sampled["outputs_equal"] is None and 1.0 <= sampled["tau"] <= ours.block_size
    assert sampled["confidence_calibration"]["reached"][0] == sampled["verify_steps"]


def test_the_calibration_compares_each_reached_slots_prediction_with_its_acceptance():
    from dflash_trainer.decoding.speculative import AcceptanceStats

    stats = AcceptanceStats(block_size=4)
    # (predicted acceptance of each drafted slot, drafts accepted): slot k is reached when k - 1 were accepted.
    stats.add([1, 4], 5, [([0.5, 0.4, 0.3], 0), ([0.9, 0.8, 0.7], 3)])
    stats.add([3], 3, [([0.7, 0.6], 2)])  # a block cut at the token limit drafts two slots
    calibration = stats.confidence_calibration
    assert calibration["reached"] == [3, 2, 1]
    assert calibration["measured"] == [2 / 3, 1.0, 1.0]
    assert calibration["predicted"] == pytest.approx([0.7, 0.7, 0.7])
    assert AcceptanceStats(block_size=4).confidence_calibration is None


def test_dflash_eval_refuses_a_dspark_directory_without_its_head_settings(tmp_path):
    from dflash_trainer.eval.cli import EvalError, check_drafter_dir

    dspark().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert check_drafter_dir(tmp_path)["dflash_config"]["markov_rank"] == 8
    del config["dflash_config"]["markov_rank"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EvalError, match=r"is a DSpark drafter and lacks dflash_config \['markov_rank'\].*markov_rank 256"):
        check_drafter_dir(tmp_path)


def test_init_from_a_dspark_drafter_refuses_another_kind_or_head(tmp_path):
    from dflash_trainer.config import ConfigError, check_init_from, load_config

    dspark("gated").save_pretrained(tmp_path / "d")

    def config(*settings):
        return load_config("embedded", [f"drafter.init_from={tmp_path / 'd'}", "drafter.block_size=4", *settings])

    check_init_from(config("drafter.kind=dspark", "drafter.markov_rank=8", "drafter.markov_head_type=gated"))
    with pytest.raises(ConfigError, match=r'drafter.kind = "dflash2", the drafter in it is "dspark"'):
        check_init_from(config("drafter.kind=dflash2"))
    with pytest.raises(ConfigError, match=r'drafter.markov_head_type = "vanilla", the drafter in it has "gated"'):
        check_init_from(config("drafter.kind=dspark", "drafter.markov_head_type=vanilla"))
