"""The peers' drafters (bench/peers): SpecForge's and vLLM speculators' DFlash model, loss and step, from their
packages installed as the adapters tell users to (`pip install --no-deps ...`), trained on features our trainer
dumped from a tiny random Qwen3 target, published in our format, loaded and decoded by our loop; and the mapping
of each peer's parameters onto ours, proven by equal logits. A peer that cannot be installed here is skipped
with the reason, never faked."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from dflash_trainer.bench.peers import specforge_peer, speculators_peer
from dflash_trainer.bench.peers.__main__ import main
from dflash_trainer.bench.peers.common import (
    PeerMissing,
    PeerRefused,
    as_ours,
    import_peer,
    load_inputs,
    our_flops,
    step_micro_batches,
)
from dflash_trainer.config import load_config

ADAPTERS = {"specforge": specforge_peer, "speculators": speculators_peer}
SETTINGS = ["train.micro_batch=2", "train.num_anchors=6", "train.steps=3", "drafter.num_layers=2",
            "drafter.block_size=4", "train.lr=3e-3"]


@pytest.fixture(scope="session")
def installed_peer(tmp_path_factory):
    """peer name -> installed (its wheel and the light modules it imports, --no-deps, from the configured
    registry, into a directory put on sys.path); pytest.skip with the reason where that fails."""
    done: dict[str, str | None] = {}

    def install(peer: str) -> None:
        if peer not in done:
            # what users are told: "pip install [--no-deps] PKG ... [&& pip install PKG ...]"; here all without
            # dependencies, which this environment has
            packages = [word for command in ADAPTERS[peer].INSTALL.split("&&")
                        for word in command.split()[2:] if not word.startswith("-")]
            where = tmp_path_factory.mktemp(f"peer-{peer}")
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
                                   str(where), *packages], check=False, capture_output=True, text=True, timeout=600)
            done[peer] = f"{' '.join(packages)} could not be installed: {proc.stderr.strip()[-500:]}" \
                if proc.returncode else None
            if not proc.returncode:
                sys.path.insert(0, str(where))
                try:  # imported here, outside any test's captured output (loguru keeps the stream it first sees)
                    ADAPTERS[peer].modules()
                except PeerMissing as exc:
                    done[peer] = str(exc)
        if done[peer]:
            print(f"skipping {peer}: {done[peer]}")
            pytest.skip(done[peer])

    return install


@pytest.fixture(scope="module")
def dumped(tiny_target, tmp_path_factory):
    """Three micro-batches of features our trainer dumped from the tiny target, and the settings to read them."""
    from dflash_trainer.run.target_rank import dump_features

    root = tmp_path_factory.mktemp("peer-features")
    settings = [f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
                f"output_dir={root / 'dump'}", *SETTINGS]
    dump_features(load_config("embedded", settings), root / "feats", 3)
    return {"features": root / "feats", "target": tiny_target["target"], "settings": SETTINGS,
            "config": lambda *more: load_config("embedded", [*settings, f"data.features_dir={root / 'feats'}", *more],
                                                whole_run=False)}


def cli(dumped, peer: str, out, *more: str) -> int:
    sets = [x for s in [*dumped["settings"], *more] for x in ("--set", s)]
    return main(["--peer", peer, "--features", str(dumped["features"]), "--target", dumped["target"],
                 "--out", str(out), "--config", "embedded", *sets])


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["specforge", "speculators"])
def test_a_peer_trains_on_our_features_and_publishes_a_drafter_our_loop_decodes(peer, installed_peer, dumped,
                                                                                tmp_path, capsys):
    from dflash_trainer.decoding.speculative import greedy_generate, speculative_generate
    from dflash_trainer.eval.cli import check_drafter_dir
    from dflash_trainer.model.drafter import DFlashDrafter
    from dflash_trainer.target.frozen import FrozenTarget
    from transformers import AutoModelForCausalLM

    installed_peer(peer)
    # two micro-batches a step: the peer's accumulation window (SpecForge) or one packed sequence (speculators)
    assert cli(dumped, peer, tmp_path / "run", "train.grad_accum=2") == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["peer"] == peer and summary["package_version"] == ADAPTERS[peer].VERSION
    assert summary["micro_batches_per_step"] == 2
    assert summary["steps"] == 3 and len(summary["losses"]) == 3 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["train_s"] > 0 and summary["tokens_per_s"] > 0 and summary["steady_tokens_per_s"] > 0
    assert len(summary["step_s"]) == 3 and abs(sum(summary["step_s"]) - summary["train_s"]) < 0.01
    assert summary["first_loss"] == summary["losses"][0] and summary["final_loss"] == summary["losses"][-1]
    # the step's cost as our trainer's summary records it: a CPU has no GPU peak and no GPU memory
    # 3 steps: the last is the steady one (step_s is rounded to 0.1 ms)
    assert summary["steady_step_ms"] == pytest.approx(summary["step_s"][-1] * 1e3, abs=0.1)
    assert summary["mfu"] is None and summary["steady_mfu"] is None and summary["peak_memory_gib"] is None
    inputs = load_inputs(dumped["config"]("train.grad_accum=2"), torch.device("cpu"))
    assert summary["model_flops"] > 0
    assert summary["model_flops"] == pytest.approx(sum(f for _, f in step_micro_batches(inputs)))

    drafter_dir = tmp_path / "run" / "drafter"
    raw = check_drafter_dir(drafter_dir)  # dflash-eval's check of a drafter directory
    assert raw["block_size"] == 4 and raw["num_hidden_layers"] == 2
    drafter = DFlashDrafter.from_pretrained(drafter_dir).eval()
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(dumped["target"]), drafter.target_layer_ids)
    prompt = [5, 9, 12, 7, 30, 2]
    spec = speculative_generate(drafter, target, prompt, 12)
    assert spec.tokens == greedy_generate(target, prompt, 12)  # lossless, as any drafter must be
    assert spec.accept_lengths and all(1 <= n <= 4 for n in spec.accept_lengths)

    # a second run into the same directory is refused, the drafter left as it was
    before = (drafter_dir / "model.safetensors").read_bytes()
    assert cli(dumped, peer, tmp_path / "run") == 2
    assert "holds a drafter already" in capsys.readouterr().err
    assert (drafter_dir / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_specforge_parameters_in_our_format_give_specforge_logits(installed_peer, dumped):
    installed_peer("specforge")
    (_, family, *_) = specforge_peer.modules()
    inputs = load_inputs(dumped["config"](), torch.device("cpu"))
    run = specforge_peer.build(inputs)
    specforge_peer.train_step(run, [inputs.shards.load(0, "cpu")])  # weights that are not their init
    mb = inputs.shards.load(1, "cpu")
    ids, loss_mask, features = mb["input_ids"], mb["loss_mask"], mb["features"].float()
    torch.manual_seed(3)
    anchors, keep = run.model._sample_anchor_positions(ids.shape[1], loss_mask, ids.device)
    block = run.model.block_size
    mask = family.create_dflash_sdpa_mask(anchors, keep, ids.shape[1], block, ids.device)
    noise = run.model._create_noise_embed(ids, anchors, keep)
    position_ids = torch.cat([torch.arange(ids.shape[1]).expand(ids.shape[0], -1),
                              run.model._create_position_ids(anchors)], dim=1)
    with torch.no_grad():
        theirs = run.model.lm_head(run.draft(position_ids=position_ids, attention_mask=mask, noise_embedding=noise,
                                             target_hidden=features))
        ours = our_logits(inputs, specforge_peer.state_dict(run), "specforge", ids, features, anchors, keep,
                          position_ids)
    assert keep.any() and torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()


@pytest.mark.slow
def test_speculators_parameters_in_our_format_give_speculators_logits(installed_peer, dumped):
    installed_peer("speculators")
    speculators_peer.modules()
    from speculators.models.dflash.utils import select_anchors

    inputs = load_inputs(dumped["config"](), torch.device("cpu"))
    run = speculators_peer.build(inputs)
    target = speculators_peer.last_hidden_target(inputs)
    mb = inputs.shards.load(0, "cpu")
    row = {k: v[:1] for k, v in mb.items()}  # one document: our mask knows no document boundaries
    batch = speculators_peer.pack([row], [target.features(row["input_ids"], row["attention_mask"])], torch.float32)
    speculators_peer.train_step(run, batch)  # weights that are not their init
    anchors_n = 3  # fewer than the row's valid positions: every block a real one
    torch.manual_seed(5)
    anchors, valid = select_anchors(batch["loss_mask"], anchors_n, run.model.block_size)
    torch.manual_seed(5)  # the same draw inside their forward
    with torch.no_grad():
        _, theirs, *_ = run.model._backbone_forward(
            batch["hidden_states"], batch["input_ids"], batch["loss_mask"], batch["verifier_last_hidden_states"],
            batch["document_ids"], batch["position_ids"], max_anchors=anchors_n)
        block = run.model.block_size
        width = batch["input_ids"].shape[1]
        position_ids = torch.cat([torch.arange(width), (anchors[:, None] + torch.arange(block)).reshape(-1)])[None]
        ours = our_logits(inputs, speculators_peer.state_dict(run), "speculators", batch["input_ids"],
                          batch["hidden_states"], anchors[None], valid[None], position_ids)
    assert valid.all() and torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()


def our_logits(inputs, state, peer, ids, features, anchors, keep, position_ids):
    """Our drafter, holding the peer's parameters, on the same blocks: our forward, our mask, our head."""
    from dflash_trainer.model.anchors import build_blocks
    from dflash_trainer.model.mask import dense_mask
    from dflash_trainer.model.objective import sdpa_attention
    from dflash_trainer.target.frozen import load_embed_and_head

    drafter = as_ours(inputs.drafter_config, state, peer).eval()
    borrowed = load_embed_and_head(inputs.cfg.target.path, "cpu", torch.float32)
    borrowed.wait()
    loss_mask = torch.ones_like(ids)
    blocks = build_blocks(ids, loss_mask, anchors, keep, drafter.block_size, drafter.mask_token_id)
    attention = sdpa_attention(dense_mask(anchors, keep, drafter.block_size, ids.shape[1]))
    hidden = drafter(features, F.embedding(blocks.token_ids, borrowed.embed), position_ids, attention)
    return drafter.logits(hidden, borrowed.head)


def test_a_peers_flop_count_is_what_our_trainers_step_counts_for_the_same_micro_batches(dumped):
    """our_flops (the peers' MFU): our trainer's own step over micro-batch i, with the anchors it draws for i."""
    from dflash_trainer.model.drafter import DFlashDrafter
    from dflash_trainer.model.optim import MasterWeightAdamW
    from dflash_trainer.run.step import DrafterStep, anchor_generator

    inputs = load_inputs(dumped["config"]("train.grad_accum=2", "train.steps=2"), torch.device("cpu"))
    config, seed = inputs.drafter_config, inputs.cfg.train.seed
    drafter = DFlashDrafter(config)
    borrowed = torch.zeros(config.vocab_size, inputs.target_config.hidden_size)
    step = DrafterStep(drafter, borrowed, borrowed, MasterWeightAdamW(drafter.parameters(), lr=1e-3),
                       num_anchors=inputs.cfg.train.num_anchors, gamma=None, chunk_rows=64, backend="sdpa",
                       compiled_layers=False, vocab_size=config.vocab_size)
    counted = []
    for index in range(4):  # two steps of two micro-batches: shards 0, 1, 2 and 0 again
        mb = inputs.shards.load(index, "cpu")
        sums = step.forward_backward(mb["input_ids"], mb["loss_mask"], mb["features"].float(),
                                     anchor_generator(seed, "cpu", index))
        counted.append(float(sums.flops))
    assert [our_flops(inputs, inputs.shards.load(i, "cpu"), i) for i in range(4)] == pytest.approx(counted)
    assert [f for _, f in step_micro_batches(inputs)] == pytest.approx([counted[0] + counted[1],
                                                                        counted[2] + counted[3]])
    assert counted[0] != counted[3]  # one shard, other anchors: the count follows the anchors drawn for each index


def test_a_missing_peer_names_the_install_command():
    with pytest.raises(PeerMissing, match="pip install --no-deps no-such-peer==1.0"):
        import_peer("no-such-peer", "1.0", "pip install --no-deps no-such-peer==1.0", "no_such_peer")


def test_another_installed_version_of_a_peer_is_said_not_refused(capsys):
    (module,) = import_peer("pytest", "0.0.1", "pip install --no-deps pytest==0.0.1", "pytest")
    assert module is pytest
    assert f"pytest {pytest.__version__} is installed; this adapter was written against pytest 0.0.1" in \
        capsys.readouterr().err


def test_a_peer_model_our_format_cannot_hold_is_refused(tiny_target):
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from transformers import AutoConfig

    config = drafter_config(AutoConfig.from_pretrained(tiny_target["target"]),
                            DrafterShape(num_layers=1, block_size=4, mask_token_id=0))
    state = DFlashDrafter(config).state_dict()
    assert as_ours(config, state, "peer") is not None
    with pytest.raises(PeerRefused, match=r"no place for: \['markov_head.weight'\]"):
        as_ours(config, {**state, "markov_head.weight": torch.zeros(2, 2)}, "peer")
    with pytest.raises(PeerRefused, match="lacks: \\['fc.weight'\\]"):
        as_ours(config, {k: v for k, v in state.items() if k != "fc.weight"}, "peer")
