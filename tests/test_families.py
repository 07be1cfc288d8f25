"""The architecture matrix: every supported family as a tiny random target (tests/helpers/families.py), on CPU.

Per family: the features are the target's own hidden states; the embedding scale and logit transform the
drafter is trained and served with are the target's; the drafter's config derives; the whole recipe runs
(regenerate the target's answers, train colocated and from dumped features, publish, dflash-eval); and
z-lab's dflash_generate gives the tokens and acceptance lengths dflash-eval gives, which are the target's
own greedy output, with prompts and answers longer than any sliding window.
"""

import json
import math
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.decoding.speculative import greedy_generate, speculative_generate, stop_token_ids
from dflash_trainer.eval.cli import main as eval_main
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config, shape_logits
from dflash_trainer.model.loss import chunked_block_loss
from dflash_trainer.model.optim import MasterWeightAdamW
from dflash_trainer.regenerate import regenerate_rows
from dflash_trainer.regenerate.engine_hf import HFEngine
from dflash_trainer.regenerate.sampling import Sampling
from dflash_trainer.run.loading import check_inputs
from dflash_trainer.run.target_rank import dump_features
from dflash_trainer.target.frozen import (
    FrozenTarget,
    attention_implementation,
    check_supported_target,
    meta_skeleton,
)
from dflash_trainer.train import run
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers.families import FAMILIES, WINDOW, build_family, family_config, tokenizer_for_tests
from tests.helpers.regenerate import free_port
from tests.helpers.training import sdpa_step

LAYER_IDS = (1, 2)
BLOCK, NEW = 4, 16
# Families whose decoder layers may run one by one with a causal mask alone (target.TAPPED_FAMILIES, no sliding
# window); the others take their own forward, hooked.
TAPPED = {"llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2"}
EAGER = {"gemma2", "gpt_oss"}  # attention SDPA cannot express: soft-capped scores, attention sinks
SCALED_EMBEDDINGS = {"gemma2", "gemma3", "gemma3_multimodal", "granite", "granitemoe"}
family_names = pytest.mark.parametrize("family", list(FAMILIES))
# A drafter trained per family: test-fast trains Gemma 3's (sliding and full layers, the cache rolled back past
# the window), the slow tests every other family's.
SERVED_FAST = "gemma3"
served_family_names = pytest.mark.parametrize(
    "family", [f if f == SERVED_FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
# DFlash 2 on the families the issue names: Llama (full attention), Qwen3 (QK norms), Gemma 3 (sliding layers,
# scaled embeddings, soft-capped logits).
DFLASH2_FAMILIES = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_for_tests()


@pytest.fixture(scope="module")
def targets(tokenizer, tmp_path_factory):
    """family -> its saved directory, built on first use."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(family):
        if family not in built:
            built[family] = build_family(family, tokenizer, root / family)
        return built[family]

    return get


def load(path) -> FrozenTarget:
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(meta_skeleton(config)))
    return FrozenTarget(model, list(LAYER_IDS))


@family_names
def test_features_and_borrowed_weights_are_the_targets_own(family, targets):
    target = load(targets(family))
    assert target.tapped == (family in TAPPED)
    assert target.attention == ("eager" if family in EAGER else "sdpa")
    ids = torch.randint(8, 300, (2, 3 * WINDOW))
    mask = torch.ones_like(ids)
    mask[1, 2 * WINDOW:] = 0  # right padding, as the training batches have it
    out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i + 1] for i in LAYER_IDS], dim=-1)
    got = target.features(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    # What the drafter borrows, transformed as drafter_config records it: the target's embedding output and logits.
    drafter = DFlashDrafter(drafter_config(target.config, DrafterShape(num_layers=1, block_size=BLOCK,
                                                                       target_layer_ids=LAYER_IDS)))
    assert (drafter.input_embedding_scale != 1.0) == (family in SCALED_EMBEDDINGS)
    torch.testing.assert_close(F.embedding(ids, target.embed_weight) * drafter.input_embedding_scale,
                               out.hidden_states[0], rtol=1e-6, atol=1e-6)
    last = target.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(drafter.logits(last, target.head_weight), out.logits, rtol=1e-5, atol=1e-5)
    # A loss against the target's distribution (train.loss_kl, loss_tv): the same features, and the final hidden
    # states whose logits, shaped as the drafter's are, are the target's own.
    feats, final = target.features_and_final(ids, mask)
    torch.testing.assert_close(feats, got)
    torch.testing.assert_close(drafter.logits(final, target.head_weight)[real], out.logits[real], rtol=1e-5, atol=1e-5)


@family_names
def test_drafter_config_derives_from_the_family(family, tokenizer):
    config = family_config(family, tokenizer)
    text = config.get_text_config(decoder=True)
    dc = drafter_config(config, DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=tokenizer.mask_token_id))
    assert (dc.hidden_size, dc.num_attention_heads, dc.num_key_value_heads, dc.vocab_size) == \
        (text.hidden_size, text.num_attention_heads, getattr(text, "num_key_value_heads", None) or
         text.num_attention_heads, text.vocab_size)  # Falcon names none: the drafter takes one KV head per head
    assert dc.head_dim == (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    assert dc.hidden_act == (getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None) or "silu")
    rope = text.rope_parameters.get("full_attention", text.rope_parameters)
    assert dc.rope_parameters["rope_theta"] == rope["rope_theta"] == dc.rope_theta
    assert dc.rope_parameters["rope_type"] == rope["rope_type"]
    assert dc.dflash_config.get("final_logit_softcapping") == getattr(text, "final_logit_softcapping", None)
    drafter = DFlashDrafter(dc)  # the rotary embedding takes the derived RoPE parameters
    assert drafter.rotary_emb.inv_freq.shape == (dc.head_dim // 2,)


def prompts_for(tokenizer, count: int = 2) -> list[list[int]]:
    from dflash_trainer.data.prompts import prompt_messages, render_prompt
    from dflash_trainer.embedded import read_corpus

    return [render_prompt(tokenizer, prompt_messages(c)) for c in read_corpus()[:count]]


def zlab_generate(drafter_dir, model, prompts, stop):
    """z-lab's loop with the serving class its drafter's architectures name (DFlash 2: its candidate selector)."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is installed by `make venv`")
    architecture = json.loads((Path(drafter_dir) / "config.json").read_text())["architectures"][0]
    theirs = getattr(zlab, architecture).from_pretrained(drafter_dir, dtype=torch.float32).eval()
    with mock.patch.object(zlab, "_cuda_time", time.perf_counter):  # its stats time with CUDA syncs
        runs = [zlab.dflash_generate(theirs, model, torch.tensor([p]), NEW, stop, return_stats=True) for p in prompts]
    return [(r.output_ids[0].tolist(), r.acceptance_lengths) for r in runs]


def trained_drafter(target: FrozenTarget, tokenizer, prompts, out, steps: int = 40, kind: str = "dflash"):
    """A drafter of `kind` trained a little (the trainer's objective, dense attention) on the target's greedy
    answers."""
    config = drafter_config(target.config, DrafterShape(num_layers=1, block_size=BLOCK,
                                                         mask_token_id=tokenizer.mask_token_id,
                                                         target_layer_ids=LAYER_IDS, kind=kind, selector_rank=16,
                                                         selector_top_k=8, markov_rank=16))
    stop = stop_token_ids(target.model, tokenizer)
    samples = []
    for prompt in prompts:
        ids = torch.tensor([greedy_generate(target, prompt, NEW, stop)])
        mask = torch.zeros_like(ids, dtype=torch.uint8)
        mask[0, len(prompt):] = 1
        samples.append((ids, mask, target.features(ids)))
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    opt = MasterWeightAdamW(drafter.parameters(), lr=1e-2, max_grad_norm=1.0)
    for step in range(steps):
        ids, mask, feats = samples[step % len(samples)]
        sdpa_step(drafter, opt, target, ids, mask, feats, NEW, step)
    return drafter.save_pretrained(out)


@served_family_names
def test_a_trained_drafter_serves_in_dflash_eval_as_in_zlabs_loop(family, targets, tokenizer, tmp_path):
    """Prompts plus answers run past every sliding window: the verify steps are rolled back on sliding,
    hybrid and full-attention layers alike, and both loops give the target's own greedy tokens."""
    serves_as_in_zlabs_loop(family, "dflash", 1, targets, tokenizer, tmp_path)


@pytest.mark.parametrize("family", [f if f == SERVED_FAST else pytest.param(f, marks=pytest.mark.slow)
                                    for f in DFLASH2_FAMILIES])
def test_a_trained_dflash2_drafter_serves_as_in_zlabs_loop_at_batch_1_and_batched(family, targets, tokenizer,
                                                                                  tmp_path):
    """DFlash 2: the selector drafts within the block in dflash-eval's fast loop (one row, and rows that accept
    differently in one batch) and in the reference loop, token for token as z-lab's DFlash2DraftModel."""
    drafter_dir, prompts, theirs = serves_as_in_zlabs_loop(family, "dflash2", 1, targets, tokenizer, tmp_path)
    batched = eval_at(drafter_dir, targets(family), prompts, 2, tmp_path / "batched")
    assert batched == [(tokens[len(p):], lengths) for p, (tokens, lengths) in zip(prompts, theirs, strict=True)]
    target = load(targets(family))
    drafter = DFlashDrafter.from_pretrained(drafter_dir).eval()
    stop = stop_token_ids(target.model, tokenizer)
    for prompt, (tokens, lengths) in zip(prompts, theirs, strict=True):
        reference = speculative_generate(drafter, target, prompt, NEW, stop)
        assert (reference.tokens, reference.accept_lengths) == (tokens, lengths)


@pytest.mark.parametrize("family", [f if f == SERVED_FAST else pytest.param(f, marks=pytest.mark.slow)
                                    for f in DFLASH2_FAMILIES])
def test_a_trained_dspark_drafter_decodes_with_its_markov_head_at_batch_1_and_batched(family, targets, tokenizer,
                                                                                     tmp_path):
    """DSpark: the Markov head drafts within the block in dflash-eval's fast loop (one row, and rows that accept
    differently in one batch) as in the reference loop, the outputs the target's own, and eval.json reports the
    confidence head's calibration per slot."""
    target_dir = targets(family)
    target = load(target_dir)
    prompts = prompts_for(tokenizer)
    drafter_dir = trained_drafter(target, tokenizer, prompts, tmp_path / "drafter", kind="dspark")
    drafter = DFlashDrafter.from_pretrained(drafter_dir).eval()
    stop = stop_token_ids(target.model, tokenizer)
    reference = [speculative_generate(drafter, target, p, NEW, stop) for p in prompts]
    assert [r.tokens for r in reference] == [greedy_generate(target, p, NEW, stop) for p in prompts]
    for batch in (1, 2):
        where = tmp_path / f"eval-{batch}"
        ours = eval_at(drafter_dir, target_dir, prompts, batch, where)
        assert ours == [(r.tokens[len(p):], r.accept_lengths) for p, r in zip(prompts, reference, strict=True)]
        calibration = json.loads((where / "eval.json").read_text())["sets"]["prompts"]["confidence_calibration"]
        assert calibration["reached"][0] == sum(len(r.accept_lengths) for r in reference)
        assert all(0 <= c <= 1 for c in calibration["predicted"] + calibration["measured"] if c is not None)
    assert max(n for r in reference for n in r.accept_lengths) > 1  # the drafter drafts something accepted


def eval_at(drafter_dir, target_dir, prompts, batch_size: int, where) -> list[tuple[list[int], list[int]]]:
    """dflash-eval on `prompts` at `batch_size`: each request's (output_ids, accept_lengths); every output
    equal to the target's own."""
    (where.parent / f"{where.name}-in").mkdir()
    prompt_file = where.parent / f"{where.name}-in" / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": str(i), "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    assert eval_main(["--drafter", str(drafter_dir), "--target", str(target_dir), "--prompts", str(prompt_file),
                      "--max-new-tokens", str(NEW), "--dtype", "float32", "--device", "cpu", "--out", str(where),
                      "--batch-size", str(batch_size)]) == 0
    report = json.loads((where / "eval.json").read_text())
    assert report["sets"]["prompts"]["outputs_equal"] == len(prompts)  # token for token the target's own
    requests = [json.loads(line) for line in (where / "requests.jsonl").read_text().splitlines()]
    return [(r["output_ids"], r["accept_lengths"]) for r in requests]


def serves_as_in_zlabs_loop(family, kind, batch_size, targets, tokenizer, tmp_path):
    """A `kind` drafter trained a little for `family`, evaluated by dflash-eval and decoded by z-lab's loop: the
    same tokens (the target's greedy ones) and acceptance lengths. (drafter dir, prompts, z-lab's results)"""
    target_dir = targets(family)
    target = load(target_dir)
    prompts = prompts_for(tokenizer)
    assert all(len(p) + NEW > WINDOW for p in prompts)
    drafter_dir = trained_drafter(target, tokenizer, prompts, tmp_path / "drafter", kind=kind)
    where = tmp_path / "eval"
    ours = eval_at(drafter_dir, target_dir, prompts, batch_size, where)
    assert json.loads((where / "eval.json").read_text())["target_attention"] == target.attention
    stop = stop_token_ids(target.model, tokenizer)
    theirs = zlab_generate(drafter_dir, target.model, prompts, sorted(stop))
    for prompt, (output, accepted), (tokens, lengths) in zip(prompts, ours, theirs, strict=True):
        assert output == tokens[len(prompt):]
        assert accepted == lengths
        assert tokens == greedy_generate(target, prompt, NEW, stop)
    assert max(n for _, accepted in ours for n in accepted) > 1  # the drafter drafts something accepted
    return drafter_dir, prompts, theirs


def test_the_soft_capped_loss_has_the_autograd_gradient():
    """Gemma 2's soft-cap (and a logit multiplier) inside the chunked loss: its gradient is autograd's."""
    torch.manual_seed(0)
    hidden = torch.randn(1, 12, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(40, 16, dtype=torch.float64) * 3
    labels = torch.randint(40, (1, 12))
    weights = torch.rand(1, 12, dtype=torch.float64)
    sums = chunked_block_loss(hidden, head, labels, weights, block_size=4, chunk_rows=5, output_multiplier=0.5,
                              final_logit_softcapping=3.0)
    (grad,) = torch.autograd.grad(sums.weighted_loss, hidden)
    scored = torch.arange(12) % 4 != 0
    logits = shape_logits(F.linear(hidden[0, scored], head), 0.5, 3.0)
    ce = F.cross_entropy(logits, labels[0, scored], reduction="none")
    reference = (ce * weights[0, scored]).sum()
    (want,) = torch.autograd.grad(reference, hidden)
    torch.testing.assert_close(sums.weighted_loss.double(), reference.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)  # the CE runs in fp32


def regenerated_rows(target_dir, tokenizer, chats):
    """The target's own greedy answers to chat rows, as training rows (what dflash-regenerate writes)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    sampling = Sampling(max_new_tokens=NEW)
    engine = HFEngine(model, tokenizer, sampling, stop_ids=[tokenizer.eos_token_id])
    return [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
            for r in regenerate_rows(engine, [{"messages": c} for c in chats], tokenizer, sampling)]


def run_config(target_dir, data, out, *extra):
    return load_config("embedded", [
        f"target.path={target_dir}", f"data.train={json.dumps([str(data['train'])])}",
        f"data.eval={json.dumps([str(data['eval'])])}", f"output_dir={out}", "train.dtype=float32",
        "target.dtype=float32", "drafter.num_layers=1", f"drafter.block_size={BLOCK}",
        f"drafter.target_layer_ids={json.dumps(list(LAYER_IDS))}", "train.steps=3", "train.micro_batch=4",
        "train.num_anchors=6", "train.checkpoint_every=0", "train.log_every=1", "eval.prompts=2",
        f"eval.max_new_tokens={NEW}", "data.max_length=96", "data.context_buckets=[96]", *extra,
    ])


@pytest.mark.slow
@family_names
def test_the_recipe_runs_and_serves_as_zlab_does(family, targets, tokenizer, tmp_path, monkeypatch):
    """The whole recipe in the trainer's own processes: regenerate, train colocated and from dumped features,
    publish, dflash-eval --run, and z-lab's loop on the published drafter."""
    from dflash_trainer.embedded import read_corpus

    target_dir = targets(family)
    rows = regenerated_rows(target_dir, tokenizer, read_corpus()[:10])
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    for name, part in (("eval", rows[:2]), ("train", rows[2:])):
        data[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    colocated = run(run_config(target_dir, data, tmp_path / "run"))
    published = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert "input_embedding_scale" not in published["dflash_config"]  # drafter.embedding_scale = none, the default
    assert colocated["target_attention"] == ("eager" if family in EAGER else "sdpa")
    features = tmp_path / "features"
    dump_features(run_config(target_dir, data, tmp_path / "dump"), features, 2)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():  # one drafter rank, as torchrun starts it
        monkeypatch.setenv(key, value)
    offline = run(run_config(target_dir, data, tmp_path / "offline", f"data.features_dir={features}",
                             "parallel.target_ranks=0", "train.steps=2"))
    assert len(offline["losses"]) == 2 and all(math.isfinite(x) for x in offline["losses"])
    where = tmp_path / "eval"
    assert eval_main(["--run", str(tmp_path / "run"), "--out", str(where)]) == 0  # equal to target-only greedy
    report = json.loads((where / "eval.json").read_text())["sets"]["held-out"]
    assert report["tau"] == colocated["tau_after"] and report["outputs_equal"] == 2
    requests = [json.loads(line) for line in (where / "requests.jsonl").read_text().splitlines()]
    prompts = [json.loads(line)["prompt_ids"] for line in (tmp_path / "run" / "eval_prompts.jsonl").open()]
    model = load(target_dir).model
    theirs = zlab_generate(tmp_path / "run" / "drafter", model, prompts, sorted(stop_token_ids(model, tokenizer)))
    for prompt, request, (tokens, lengths) in zip(prompts, requests, theirs, strict=True):
        assert request["output_ids"] == tokens[len(prompt):]
        assert request["accept_lengths"] == lengths


@pytest.mark.parametrize(("family", "refusal"), [
    ("bert", (r"BertLMHeadModel \(the bert family\) has no decoder layer list .*an encoder.*decoder-only causal LM "
              r"\(Llama")),
    ("t5", r"transformers builds no causal LM for the t5 family.*decoder-only causal LM \(Llama"),
    ("distilbert", r"transformers builds no causal LM for the distilbert family.*decoder-only causal LM \(Llama"),
    ("phi", r"the LM head of PhiForCausalLM \(phi\) has a bias, which the drafter's loss does not apply"),
])
def test_an_unsupported_target_is_refused_before_anything_is_read(family, refusal, tmp_path):
    from transformers import AutoConfig as Auto

    directory = tmp_path / family
    small = {"bert": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64},
             "t5": {"d_model": 32, "num_layers": 2, "num_heads": 4}, "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4},
             "phi": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}}[family]
    Auto.for_model(family, vocab_size=300, **small).save_pretrained(directory)  # a config, no weights, no data
    cfg = load_config("embedded", [f"target.path={directory}", f"output_dir={tmp_path / 'out'}",
                                   f"data.train={json.dumps([str(tmp_path / 'absent.jsonl')])}"])
    with pytest.raises(ConfigError, match=refusal):
        check_inputs(cfg)


def test_a_target_with_remote_code_needs_the_explicit_setting(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({
        "model_type": "not_in_transformers", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    cfg = load_config("embedded", [f"target.path={remote}", f"output_dir={tmp_path / 'out'}",
                                   f"data.train={json.dumps([str(tmp_path / 'absent.jsonl')])}"])
    with pytest.raises(ConfigError, match="target.trust_remote_code=true"):
        check_inputs(cfg)


def test_unsupported_rope_and_head_layout_name_the_family(tokenizer):
    config = family_config("llama", tokenizer)
    config.num_key_value_heads = 3
    with pytest.raises(ConfigError, match=r"4 attention heads are not a multiple of 3 KV heads \(llama\)"):
        check_supported_target(config, "target.path x")
