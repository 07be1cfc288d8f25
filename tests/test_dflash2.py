"""DFlash 2 (drafter.kind = "dflash2"): the convolutions' block semantics, z-lab's loader and forward on our
directory, the selector's objective and its gradient, the settings' checks."""

import json

import pytest
import torch
import torch.nn.functional as F
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.model.anchors import build_blocks
from dflash_trainer.model.dflash2.objective import predecessors, selector_ce, training_candidates
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config, shape_logits
from dflash_trainer.model.loss import Objective, chunked_block_loss, scored_rows
from dflash_trainer.model.objective import block_attention, drafter_loss, sdpa_attention
from transformers import Qwen3Config

TINY_TARGET = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
BLOCK = 4


def dflash2(seed=0, **shape):
    """A DFlash 2 drafter whose convolutions are not the identity (a new one's are)."""
    torch.manual_seed(seed)
    config = drafter_config(TINY_TARGET, DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=7, kind="dflash2",
                                                      selector_rank=8, selector_top_k=5, **shape))
    model = DFlashDrafter(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name:
                p.normal_(0, 0.3)
    return model


def test_a_new_dflash2_drafter_starts_as_the_dflash_one():
    """speculators' initialisation: identity convolutions, so the same weights give DFlash's outputs."""
    shape = {"num_layers": 2, "block_size": BLOCK, "mask_token_id": 7}
    one = DFlashDrafter.initialised(drafter_config(TINY_TARGET, DrafterShape(**shape)), "cpu", 0)
    two = DFlashDrafter.initialised(drafter_config(TINY_TARGET, DrafterShape(**shape, kind="dflash2")), "cpu", 0)
    assert two.layers[0].attention_conv is not None and one.layers[0].attention_conv is None
    two.load_state_dict(one.state_dict(), strict=False)
    feats, emb = torch.randn(1, 6, 128), torch.randn(1, BLOCK, 64)
    pos = torch.arange(6 + BLOCK)[None]
    attn = sdpa_attention(None)
    torch.testing.assert_close(two(feats, emb, pos, attn), one(feats, emb, pos, attn), rtol=0, atol=0)


def test_training_blocks_equal_each_block_drafted_alone():
    """Training lays N blocks end to end; the convolution stays inside each block, so every block's output is
    the one serving computes for it alone, from the context before its anchor."""
    model = dflash2()
    g = torch.Generator().manual_seed(3)
    ctx_len = 20
    ids = torch.randint(8, 300, (1, ctx_len), generator=g)
    anchors, keep = torch.tensor([[2, 7, 13]]), torch.ones(1, 3, dtype=torch.bool)
    blocks = build_blocks(ids, torch.ones_like(ids), anchors, keep, BLOCK, 7)
    feats = torch.randn(1, ctx_len, 128, generator=g)
    embed = torch.randn(300, 64, generator=g)
    attention = block_attention("sdpa", blocks, ctx_len, BLOCK, model.config)
    pos = torch.cat([torch.arange(ctx_len)[None], blocks.position_ids], 1)
    together = model(feats, F.embedding(blocks.token_ids, embed), pos, attention)
    for j, a in enumerate(anchors[0].tolist()):
        block_ids = blocks.token_ids[:, j * BLOCK:(j + 1) * BLOCK]
        alone = model(feats[:, :a], F.embedding(block_ids, embed), torch.arange(a + BLOCK)[None],
                      sdpa_attention(None))
        torch.testing.assert_close(together[:, j * BLOCK:(j + 1) * BLOCK], alone, rtol=1e-5, atol=1e-5)


def test_zlab_loads_our_dflash2_directory_and_agrees(tmp_path):
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is installed by `make venv`")
    model = dflash2()
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                                        "selector_rank": 8, "selector_top_k": 5}
    theirs = zlab.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours_state = model.state_dict()
    assert torch.equal(theirs.candidate_selector.predecessor_codebook.weight,
                       ours_state["candidate_selector.predecessor_codebook"])
    assert torch.equal(theirs.layers[1].mlp_conv.base_kernel, ours_state["layers.1.mlp_conv.base_kernel"])
    g = torch.Generator().manual_seed(1)
    feats, emb = torch.randn(2, 10, 128, generator=g), torch.randn(2, BLOCK, 64, generator=g)
    pos = torch.arange(10 + BLOCK).expand(2, -1)
    with torch.no_grad():
        ours = model(feats, emb, pos, sdpa_attention(None))
        hidden = theirs(position_ids=pos, noise_embedding=emb, target_hidden=feats)
        torch.testing.assert_close(hidden, ours, rtol=1e-5, atol=1e-5)
        head = torch.randn(300, 64, generator=g)
        anchors = torch.tensor([5, 9])
        drafted, _, _ = theirs.propose(hidden[:, 1:], anchors, lambda h: F.linear(h, head), 0.0)
        assert torch.equal(model.propose(ours[:, 1:], anchors, head)[0], drafted)


def test_sampled_drafts_use_zlabs_selector_distribution(monkeypatch):
    """At a temperature > 0 the selector draws each position from z-lab's q (softmax of its candidates' scores
    at T, given the token drawn before it): along our drawn path, z-lab's select (made to draw our tokens) gives
    the same q, which ours returns spread over the vocabulary, zero off the candidates, and the draws follow q."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is installed by `make venv`")
    model = dflash2()
    theirs = zlab.DFlash2DraftModel(model.config).eval()
    theirs.load_state_dict({k.replace("codebook", "codebook.weight"): v for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(3)
    hidden, head = torch.randn(2, BLOCK - 1, 64, generator=g), torch.randn(300, 64, generator=g)
    anchors, temperature = torch.tensor([5, 9]), torch.tensor(0.7)
    noise = torch.empty(2, BLOCK - 1, 300).exponential_(generator=g)
    with torch.no_grad():
        tokens, q = model.propose(hidden, anchors, head, temperature, noise)
        logits = model.logits(hidden, head)
        candidates = torch.topk(logits, 5, dim=-1, sorted=False).indices
        drawn = iter(range(BLOCK - 1))
        monkeypatch.setattr(zlab, "_sample_probs", lambda _q: (candidates[:, (p := next(drawn))]
                                                                 == tokens[:, p, None]).long().argmax(-1))
        path, their_candidates, their_q = theirs.propose(hidden, anchors, lambda h: F.linear(h, head), 0.7)
    assert torch.equal(path, tokens) and torch.equal(their_candidates, candidates)
    torch.testing.assert_close(q.gather(-1, candidates), their_q)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, BLOCK - 1))
    assert (q.gather(-1, tokens[..., None]) > 0).all()
    assert ((q > 0).sum(-1) <= 5).all()


def test_automodel_builds_dflash2_from_the_published_directory(tmp_path):
    """AutoModel with trust_remote_code builds DFlash2DraftModel from a dflash2 directory, every weight loaded,
    with our forward and greedy drafts."""
    from transformers import AutoModel

    model = dflash2()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == {
        "AutoModel": "modeling_dflash.DFlash2DraftModel"}
    hub, info = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype="auto", output_loading_info=True)
    assert type(hub).__name__ == "DFlash2DraftModel"
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    g = torch.Generator().manual_seed(1)
    feats, emb = torch.randn(2, 10, 128, generator=g), torch.randn(2, BLOCK, 64, generator=g)
    pos = torch.arange(10 + BLOCK).expand(2, -1)
    with torch.no_grad():
        ours = model(feats, emb, pos, sdpa_attention(None))
        theirs = hub(target_hidden=feats, noise_embedding=emb, position_ids=pos)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        head, anchors = torch.randn(300, 64, generator=g), torch.tensor([5, 9])
        assert torch.equal(hub.propose(theirs[:, 1:], anchors, head)[0], model.propose(ours[:, 1:], anchors, head)[0])


def test_the_selector_path_follows_its_predecessor():
    """Position p's choice depends on the token chosen at p-1: a different anchor changes the first choice's
    successor scores, and with a dominant transition score the path is the selector's, not the argmax."""
    model = dflash2()
    hidden = torch.randn(1, BLOCK - 1, 64)
    head = torch.randn(300, 64) * 0.01  # flat unary logits: the transition scores decide
    with torch.no_grad():
        model.candidate_selector.predecessor_codebook.normal_(0, 3.0)
        model.candidate_selector.successor_codebook.normal_(0, 3.0)
    paths = {tuple(model.propose(hidden, torch.tensor([a]), head)[0][0].tolist()) for a in range(8, 40)}
    assert len(paths) > 1
    assert any(p != tuple(model.logits(hidden, head).argmax(-1)[0].tolist()) for p in paths)


def test_training_candidates_inject_a_missing_label_last():
    candidates = torch.tensor([[4, 5, 6], [7, 8, 9]])
    injected, column, contains = training_candidates(candidates, torch.tensor([5, 1]))
    assert injected.tolist() == [[4, 5, 6], [7, 8, 1]]
    assert column.tolist() == [1, 2] and contains.tolist() == [True, False]
    assert predecessors(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 4).tolist() == [[1, 1, 2, 3, 5, 5, 6, 7]]


def test_selector_ce_and_its_gradient_equal_the_full_computation():
    """The selector's CE over the unary top-k (the label injected), with the soft-capped logits, and its
    gradient through the chunked candidate logits, against autograd over the full logits."""
    torch.manual_seed(0)
    model = dflash2()
    selector = model.candidate_selector.double()
    rows, h = 9, 64
    hidden = torch.randn(rows, h, dtype=torch.float64, requires_grad=True)
    head = torch.randn(300, h, dtype=torch.float64)
    labels = torch.randint(300, (rows,))
    weights = torch.rand(rows, dtype=torch.float64)
    previous = torch.randint(300, (rows,))
    full = shape_logits(F.linear(hidden, head), 0.5, 3.0)
    candidates = full.detach().topk(5, dim=-1).indices
    labels[:3] = candidates[:3, 2]  # some labels among the candidates, the rest (most likely) not
    total, hit = selector_ce(selector, hidden, head, labels, weights, previous, candidates, chunk_rows=4,
                             multiplier=0.5, softcap=3.0)
    injected, column, _ = training_candidates(candidates, labels)
    scores = full.gather(1, injected) + selector(hidden, previous, injected)
    reference = (F.cross_entropy(scores, column, reduction="none") * weights).sum()
    torch.testing.assert_close(total.double(), reference, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(total, [hidden, selector.successor_codebook])
    want = torch.autograd.grad(reference, [hidden, selector.successor_codebook])
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    assert hit.dtype == torch.bool and hit.shape == (rows,)


def test_drafter_loss_adds_the_selector_term_and_returns_the_unary_candidates():
    model = dflash2()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(8, 300, (1, 24), generator=g)
    blocks = build_blocks(ids, torch.ones_like(ids), torch.tensor([[3, 11]]), torch.ones(1, 2, dtype=torch.bool),
                          BLOCK, 7)
    embed, head = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    feats = torch.randn(1, 24, 128, generator=g)
    attention = block_attention("sdpa", blocks, 24, BLOCK, model.config)
    unary = drafter_loss(model, embed, head, feats, blocks, attention, selector_loss_weight=0.0)
    both = drafter_loss(model, embed, head, feats, blocks, attention, selector_loss_weight=0.5)
    plain = chunked_block_loss(model(feats, F.embedding(blocks.token_ids, embed),
                                     torch.cat([torch.arange(24)[None], blocks.position_ids], 1), attention),
                               head, blocks.labels, blocks.weights, BLOCK)
    torch.testing.assert_close(unary.weighted_loss, plain.weighted_loss)
    assert both.weighted_loss > unary.weighted_loss and unary.candidates.shape == (2 * (BLOCK - 1), 5)
    both.weighted_loss.backward()
    assert model.candidate_selector.successor_codebook.grad.abs().sum() > 0
    assert model.layers[0].attention_conv.kernel_projection.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("objective", [Objective(ce=0.0, kl=1.0), Objective(ce=0.1, tv=0.9),
                                       Objective(dpace_alpha=0.5), Objective(ce=0.0, kl=1.0, dpace_alpha=0.5)])
def test_the_unary_term_is_the_loss_mixture_and_the_selector_stays_its_own_term(objective):
    """DFlash 2's unary term is train.loss_*'s objective against the target's distribution (the target's final
    hidden state one position before each block slot), as DFlash's loss; the selector's CE is added beside it,
    each position weighted as the unary term weighs it (D-PACE's weights where it chose them)."""
    model = dflash2()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(8, 300, (1, 24), generator=g)
    blocks = build_blocks(ids, torch.ones_like(ids), torch.tensor([[3, 11]]), torch.ones(1, 2, dtype=torch.bool),
                          BLOCK, 7)
    embed, head = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    feats, final = torch.randn(1, 24, 128, generator=g), torch.randn(1, 24, 64, generator=g)
    attention = block_attention("sdpa", blocks, 24, BLOCK, model.config)
    unary = drafter_loss(model, embed, head, feats, blocks, attention, objective=objective, target_hidden=final,
                         selector_loss_weight=0.0)
    both = drafter_loss(model, embed, head, feats, blocks, attention, objective=objective, target_hidden=final,
                        selector_loss_weight=0.5)
    hidden = model(feats, F.embedding(blocks.token_ids, embed),
                   torch.cat([torch.arange(24)[None], blocks.position_ids], 1), attention)
    before = final.gather(1, (blocks.position_ids - 1).clamp(0, 23).unsqueeze(-1).expand(-1, -1, 64))
    plain = chunked_block_loss(hidden, head, blocks.labels, blocks.weights, BLOCK, objective=objective,
                               target_hidden=before, top_k=5)
    torch.testing.assert_close(unary.weighted_loss, plain.weighted_loss)
    rows = scored_rows(blocks.weights, BLOCK) if plain.row_weights is None else plain.row_weights
    if objective.dpace_alpha is not None:
        torch.testing.assert_close(both.weight, plain.row_weights.sum())  # what the step divides by
        assert not torch.equal(rows, scored_rows(blocks.weights, BLOCK))
    selector, _ = selector_ce(model.candidate_selector, scored_rows(hidden, BLOCK), head,
                              scored_rows(blocks.labels, BLOCK), rows, scored_rows(predecessors(blocks.labels, BLOCK),
                                                                                   BLOCK), plain.candidates)
    torch.testing.assert_close(both.weighted_loss, plain.weighted_loss + 0.5 * selector)
    both.weighted_loss.backward()
    assert model.candidate_selector.successor_codebook.grad.abs().sum() > 0


def test_a_tiny_dflash2_run_learns_with_the_kl_to_the_target(tiny_target, tmp_path):
    """drafter.kind = dflash2 with train.loss_kl (speculators' DFlash 2 default): the final hidden states reach
    the step, and the loss (KL + the selector's CE) falls."""
    from dflash_trainer.train import run

    summary = run(load_config("embedded", [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={tmp_path / 'run'}", "drafter.kind=dflash2",
        "drafter.selector_rank=16", "drafter.selector_top_k=8", "train.loss_ce=0", "train.loss_kl=1",
        "train.steps=8", "train.lr=3e-3", "train.micro_batch=4", "train.num_anchors=8", "train.checkpoint_every=0",
        "train.log_every=1", "eval.prompts=2", "eval.max_new_tokens=8"]))
    assert len(summary["losses"]) == 8
    assert summary["final_loss"] < summary["first_loss"]


@pytest.mark.parametrize(("settings", "refusal"), [
    (["drafter.kind=eagle"], "drafter.kind.*dflash.*dflash2"),
    (["drafter.selector_rank=64"], "drafter.selector_rank is a DFlash 2 setting, and drafter.kind is dflash"),
])
def test_bad_kind_settings_are_refused(settings, refusal):
    with pytest.raises(ConfigError, match=refusal):
        load_config("embedded", settings)


def test_shapes_dflash2_cannot_build_are_refused():
    with pytest.raises(ValueError, match="conv_group_size 24 does not divide the hidden size 64"):
        drafter_config(TINY_TARGET, DrafterShape(num_layers=1, block_size=BLOCK, mask_token_id=7, kind="dflash2",
                                                 conv_group_size=24))
    with pytest.raises(ValueError, match="selector_top_k 301 exceeds the target's vocabulary"):
        drafter_config(TINY_TARGET, DrafterShape(num_layers=1, block_size=BLOCK, mask_token_id=7, kind="dflash2",
                                                 selector_top_k=301))


def test_a_tiny_dflash2_run_trains_resumes_publishes_and_is_evaluated(tiny_target, tmp_path):
    """drafter.kind = dflash2 through the trainer: the loss falls, a resume repeats the losses, the published
    directory loads in z-lab's DFlash2DraftModel with our forward, the serving check passes and dflash-eval
    --run decodes it to the target's own tokens with the run's tau, and samples with it at a temperature."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is installed by `make venv`")
    import shutil

    from dflash_trainer.eval.cli import main as eval_main
    from dflash_trainer.train import run

    def config(out):
        return load_config("embedded", [
            f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
            f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={out}", "drafter.kind=dflash2",
            "drafter.selector_rank=16", "drafter.selector_top_k=8", "train.steps=4", "train.micro_batch=4",
            "train.num_anchors=8", "train.checkpoint_every=2", "train.log_every=1", "eval.prompts=2",
            "eval.max_new_tokens=8"])

    out = tmp_path / "run"
    summary = run(config(out))
    assert summary["final_loss"] < summary["first_loss"]
    assert not summary["serving_check"]["flagged"]
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    assert run(config(resumed), resume=True)["losses"] == summary["losses"][2:]
    ours = DFlashDrafter.from_pretrained(out / "drafter")
    assert ours.kind == "dflash2"
    theirs = zlab.DFlash2DraftModel.from_pretrained(out / "drafter", dtype=torch.float32).eval()
    feats, emb = torch.randn(1, 6, ours.fc.in_features), torch.randn(1, ours.block_size, ours.config.hidden_size)
    pos = torch.arange(6 + ours.block_size)[None]
    with torch.no_grad():
        torch.testing.assert_close(theirs(position_ids=pos, noise_embedding=emb, target_hidden=feats),
                                   ours(feats, emb, pos, sdpa_attention(None)), rtol=1e-5, atol=1e-5)
    where = tmp_path / "eval"
    assert eval_main(["--run", str(out), "--out", str(where), "--temperature", "0", "0.8"]) == 0
    evaluated = json.loads((where / "eval.json").read_text())
    report = evaluated["sets"]["held-out"]
    assert report["outputs_equal"] == 2 and report["tau"] == summary["tau_after"]
    sampled = evaluated["by_temperature"]["0.8"]["sets"]["held-out"]  # the selector sampling along the block
    assert sampled["outputs_equal"] is None and 1.0 <= sampled["tau"] <= ours.block_size


@pytest.mark.slow
def test_a_dflash2_layer_traces_whole_as_the_compile_step_compiles_it():
    """COMPILED_LAYER's settings (one graph, no break, static shapes) on a DFlash 2 layer: the convolutions
    trace with it, and forward and backward equal the eager layer's (aot_eager: the trace without a C++
    compiler; the GPU compile step runs Inductor with flex_attention)."""
    from dflash_trainer.model.objective import call_layer

    model = dflash2()
    compiled = torch.compile(call_layer, fullgraph=True, dynamic=False, backend="aot_eager")
    x, context = torch.randn(1, 2 * BLOCK, 64, requires_grad=True), torch.randn(1, 10, 64)
    cos, sin = model.rotary_emb(x, torch.arange(10 + 2 * BLOCK)[None])
    for layer in model.layers:
        got = compiled(layer, x, context, cos, sin, sdpa_attention(None))
        (grad,) = torch.autograd.grad(got.sum(), x)
        want = call_layer(layer, x, context, cos, sin, sdpa_attention(None))
        (want_grad,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(grad, want_grad)


def test_init_from_a_dflash2_drafter_refuses_another_kind_or_selector(tmp_path):
    from dflash_trainer.config import check_init_from

    dflash2().save_pretrained(tmp_path / "d2")

    def config(*settings):
        return load_config("embedded", [f"drafter.init_from={tmp_path / 'd2'}", f"drafter.block_size={BLOCK}",
                                        *settings])

    check_init_from(config("drafter.kind=dflash2", "drafter.selector_rank=8"))  # what the drafter has: accepted
    with pytest.raises(ConfigError, match=r'drafter.kind = "dflash", the drafter in it is "dflash2"'):
        check_init_from(config("drafter.kind=dflash"))
    with pytest.raises(ConfigError, match=r"drafter.selector_rank = 64, the drafter in it has 8"):
        check_init_from(config("drafter.kind=dflash2", "drafter.selector_rank=64"))
