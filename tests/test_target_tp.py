"""Tensor-parallel target groups (parallel.target_tp = N) on CPU with gloo.

The strongest check is equality again: sharding the target changes who holds which weights, never the
features. A TP=2 group's features equal one rank's (tiny Llama, Qwen3 and Gemma 3 models from their config
classes: the tapped forward and the hooked one), a run with one group of two target ranks and one drafter
rank trains the losses of one target rank and one drafter rank, and a resumed one continues them.
The schedule, the split advice, the plan and the refusals are checked without processes.
"""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest
import torch
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.distributed.parallel import split_advice, suggest_split
from dflash_trainer.distributed.transport import Roles
from dflash_trainer.target.frozen import meta_skeleton
from dflash_trainer.target.tensor_parallel import (
    check_target_fits,
    check_tp_shape,
    config_plan,
    layer_styles,
    share_per_gpu,
    target_bytes,
    valid_tp_sizes,
)
from dflash_trainer.train import main

from tests.test_distributed import overrides, torchrun

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


def tiny_config(family: str, **changes):
    from transformers import (
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        Olmo2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig, "qwen3_moe": Qwen3MoeConfig,
               "gpt_oss": GptOssConfig, "olmo2": Olmo2Config}
    config = classes[family](**{**TINY, **changes})
    config._attn_implementation = "eager" if family in ("gemma3", "gpt_oss") else "sdpa"
    return config


# ---- the schedule and the advice: groups, not ranks -------------------------------------------------

def test_target_groups_share_the_schedule_and_their_first_rank_sends():
    roles = Roles.from_world(5, 4, 1, target_tp=2)  # ranks 0-1: group 0, ranks 2-3: group 1, rank 4: drafter
    assert roles.num_target_groups == 2
    assert [roles.producer_of(i) for i in range(4)] == [0, 2, 0, 2]
    assert [roles.sends_features(r) for r in range(5)] == [True, False, True, False, False]
    assert [roles.target_index(r) for r in range(4)] == [0, 0, 1, 1]
    assert list(roles.batches_for_target(1, 7)) == [1, 3, 5]
    assert roles.stop_positions(1, 0, 6, 2) == [7]  # drafter 0 posts 6 and 7; group 1 produces 7
    with pytest.raises(ConfigError, match=r"target ranks \(3\) must be a multiple of parallel.target_tp \(2\)"):
        Roles.from_world(4, 3, 1, target_tp=2)


def test_split_advice_counts_groups():
    # a group of 2 takes 0.2 s a micro-batch, a drafter rank 0.1 s: 3 groups (6 GPUs) feed 2 drafters best
    assert suggest_split(0.2, 0.1, 8, target_tp=2) == (6, 2)
    text = " ".join(split_advice(0.2, 0.1, 2, 6, target_tp=2).split())
    assert "on a target group of 2 GPUs" in text
    assert "for 8 GPUs try --target-gpus 6 --drafter-gpus 2 (3 groups of 2)" in text
    with pytest.raises(ValueError, match="at least 3 GPUs"):
        suggest_split(0.2, 0.1, 2, target_tp=2)


# ---- refusals: the config's validation, exit 2 --------------------------------------------------------

@pytest.mark.parametrize(("settings", "expected"), [
    (["parallel.target_tp=2", "parallel.target_ranks=3"],
     ("parallel.target_ranks = 3 is not a multiple of parallel.target_tp = 2 (each group of 2 target GPUs holds "
      "one target): give --target-gpus 2 or 4")),
    (["parallel.target_tp=2"], "parallel.target_tp = 2 needs target ranks, and target_ranks is 0"),
])
def test_bad_group_settings_are_refused_by_the_config(settings, expected):
    with pytest.raises(ConfigError) as err:
        load_config("embedded", settings)
    assert expected in " ".join(str(err.value).split())


def test_a_split_that_is_not_whole_groups_exits_2_naming_the_fix(capsys, tmp_path):
    flags = ["--config", "embedded", "--set", "parallel.target_tp=2", "--target-gpus", "3", "--drafter-gpus", "1"]
    assert main([*flags, "--output-dir", str(tmp_path / "run")]) == 2
    assert "give --target-gpus 2 or 4" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "run").exists()  # refused before anything was written
    # --print-config still prints the merged config, and says beside it why it cannot start a run
    assert main([*flags, "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "target_tp = 2" in out and "give --target-gpus 2 or 4" in " ".join(err.split())


def test_a_group_size_that_splits_no_heads_evenly_names_the_sizes_that_do(tmp_path, capsys):
    """Checked from config.json before anything loads or starts: the tiny Qwen3's 2 KV heads do not split in 4."""
    tiny_config("qwen3").save_pretrained(tmp_path / "target")
    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code = main(["--config", "embedded", "--set", f"target.path={tmp_path / 'target'}", "--set",
                 f"data.train={json.dumps([str(tmp_path / 'train.jsonl')])}", "--set", "parallel.target_tp=4",
                 "--target-gpus", "4", "--drafter-gpus", "1", "--output-dir", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert "parallel.target_tp = 4 does not divide the" in err and "target's 2 KV heads" in err
    assert "set parallel.target_tp to one of 1, 2" in err and not (tmp_path / "out").exists()


def test_shape_check_names_every_dimension_that_does_not_split():
    config = tiny_config("llama", num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                         head_dim=128, intermediate_size=14336)
    assert valid_tp_sizes(config) == [1, 2, 4, 8]
    with pytest.raises(ConfigError) as err:
        check_tp_shape(config, 3, "Llama-3.1-8B")
    text = str(err.value)
    assert "32 attention heads and 8 KV heads and 14336 MLP width" in text and "one of 1, 2, 4, 8" in text


def test_memory_check_names_the_smallest_group_that_fits():
    config = tiny_config("llama")
    shardable, replicated = target_bytes(config, 4)
    assert shardable > 0 and replicated > 0
    free = int((share_per_gpu(shardable, replicated, 2) + 1) / 0.85)  # the share at N = 2 fits, N = 1 does not
    check_target_fits(config, 2, 4, free)
    with pytest.raises(ConfigError, match=r"set parallel.target_tp = 2 \(its share is"):
        check_target_fits(config, 1, 4, free)
    with pytest.raises(ConfigError, match="even the largest group leaves"):
        check_target_fits(config, 1, 4, replicated // 2)


# ---- the plan: the config's own, translated to torch's styles ------------------------------------------

def _styles(config) -> dict[str, str]:
    layer = meta_skeleton(config).model.layers[0]
    return {path: type(style).__name__ for path, style in layer_styles(layer, config_plan(config)).items()}


def test_the_plan_shards_attention_and_mlp_projections_and_keeps_the_rest_whole():
    dense = {"self_attn.q_proj": "ColwiseParallel", "self_attn.k_proj": "ColwiseParallel",
             "self_attn.v_proj": "ColwiseParallel", "self_attn.o_proj": "RowwiseParallel",
             "mlp.gate_proj": "ColwiseParallel", "mlp.up_proj": "ColwiseParallel", "mlp.down_proj": "RowwiseParallel"}
    assert _styles(tiny_config("qwen3")) == dense  # the config's plan (its q/k norms stay whole)
    assert _styles(tiny_config("olmo2")) == dense  # colwise_gather_output / rowwise_split_input: torch's too
    # MoE: the attention is split, the experts (fused, packed styles) stay whole on every rank
    moe = _styles(tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    assert moe == {k: v for k, v in dense.items() if k.startswith("self_attn")}
    # gpt-oss: per-head attention sinks and MoE experts: nothing to split (the group would refuse to start)
    assert _styles(tiny_config("gpt_oss", num_local_experts=4, num_experts_per_tok=2)) == {}


# ---- several processes: the features and a short run ----------------------------------------------------

def _features_worker(rank: int, world: int, init_file: str, results: str):
    import torch.distributed as dist
    from dflash_trainer.target.frozen import FrozenTarget
    from dflash_trainer.target.tensor_parallel import shard_target, tp_mesh
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group([0, 1])
    errors = {}
    for family, dtype in (("llama", torch.float32), ("qwen3", torch.float32), ("gemma3", torch.float32),
                          ("llama", torch.bfloat16)):
        config = tiny_config(family, **({"sliding_window": 8} if family == "gemma3" else {}))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(dtype)
        ids = torch.randint(TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 18:] = 0  # right padding, as the micro-batches are padded
        whole = FrozenTarget(model, [0, 2]).features(ids, mask).float()
        shard_target(model, tp_mesh(group, torch.device("cpu")))
        target = FrozenTarget(model, [0, 2])
        split = target.features(ids, mask)
        assert type(split) is torch.Tensor  # a plain tensor: the transport sends it as it is
        scale = whole.abs().max().item()
        errors[f"{family} {dtype} {'tapped' if target.tapped else 'hooked'}"] = \
            (split.float() - whole).abs().max().item() / scale
    errors.update(_fp8_errors(group))
    if rank == 0:
        with open(results, "w") as f:
            json.dump(errors, f)
    dist.destroy_process_group()


def _fp8_errors(group) -> dict[str, float]:
    """target.quantization = fp8: the group's FP8 features against one rank's FP8 and against bf16."""
    import copy

    from dflash_trainer.target.frozen import FrozenTarget
    from dflash_trainer.target.tensor_parallel import quantize_shards, shard_target, tp_mesh
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16)
    ids = torch.randint(TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    bf16 = FrozenTarget(copy.deepcopy(model), [0, 2]).features(ids).float()
    one_rank = FrozenTarget(copy.deepcopy(model), [0, 2], quantization="fp8").features(ids).float()
    shard_target(model, tp_mesh(group, torch.device("cpu")))
    assert quantize_shards(model) == 28  # every projection of the 4 layers
    split = FrozenTarget(model, [0, 2], quantization="fp8").features(ids).float()
    scale = bf16.abs().max().item()
    return {"fp8 group vs one rank": (split - one_rank).abs().max().item() / scale,
            "fp8 one rank vs bf16": (one_rank - bf16).abs().max().item() / scale,
            "fp8 group vs bf16": (split - bf16).abs().max().item() / scale}


@pytest.mark.slow
def test_a_tp2_group_computes_the_features_of_one_rank(tmp_path):
    import torch.multiprocessing as mp

    results = tmp_path / "errors.json"
    mp.spawn(_features_worker, args=(2, tempfile.mktemp(dir=tmp_path), str(results)), nprocs=2)
    errors = json.loads(results.read_text())
    fp8 = {case: errors.pop(case) for case in list(errors) if case.startswith("fp8")}
    assert set(errors) == {"llama torch.float32 tapped", "qwen3 torch.float32 tapped", "gemma3 torch.float32 hooked",
                           "llama torch.bfloat16 tapped"}
    for case, error in errors.items():  # fp32: summation order only; bf16: its rounding of the partial sums
        assert error < (2e-2 if "bfloat16" in case else 1e-5), (case, error)
    # FP8: the row-wise shares scale over half the inputs each, so the group's features differ from one rank's
    # by FP8 rounding, and are no further from the bf16 target's than one rank's FP8 features are
    assert fp8["fp8 group vs one rank"] < 0.15, fp8
    assert fp8["fp8 group vs bf16"] < 1.5 * fp8["fp8 one rank vs bf16"], fp8


def _compiled_worker(rank: int, world: int, init_file: str, results: str):
    import torch.distributed as dist
    from dflash_trainer.target.frozen import FrozenTarget
    from dflash_trainer.target.tensor_parallel import shard_target, tp_mesh
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    ids = torch.randint(TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    whole = FrozenTarget(model, [0, 2]).features(ids)
    shard_target(model, tp_mesh(dist.new_group([0, 1]), torch.device("cpu")))
    target = FrozenTarget(model, [0, 2], compile_layers=True)
    for _ in range(2):
        split = target.features(ids)
    if rank == 0:
        with open(results, "w") as f:
            json.dump({"error": (split - whole).abs().max().item(), "graphs": counters["stats"]["unique_graphs"]}, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_tp2_groups_compiled_layers_keep_the_all_reduce_and_share_one_graph(tmp_path):
    """The compiled tapped forward (GPUs) runs the layers with transformers' hooks suspended: tensor
    parallelism's output hooks (the row-wise all-reduce) must stay, and every layer reuses the one graph."""
    import torch.multiprocessing as mp

    results = tmp_path / "compiled.json"
    mp.spawn(_compiled_worker, args=(2, tempfile.mktemp(dir=tmp_path), str(results)), nprocs=2)
    got = json.loads(results.read_text())
    assert got["error"] < 1e-5 and got["graphs"] == 1, got


@pytest.fixture(scope="module")
def one_target_one_drafter(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("t1d1") / "run"
    sets = [x for o in overrides(tiny_target, out) for x in ("--set", o)]
    torchrun(2, ["--config", "embedded", *sets, "--target-gpus", "1", "--drafter-gpus", "1"])
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_one_tp2_group_and_one_drafter_train_as_one_target_and_resume(tiny_target, tmp_path, one_target_one_drafter):
    out = tmp_path / "tp2"
    args = ["--config", "embedded", *[x for o in overrides(tiny_target, out) + ["train.checkpoint_every=2",
                                                                                 "parallel.target_tp=2"]
                                      for x in ("--set", o)], "--target-gpus", "2", "--drafter-gpus", "1"]
    proc = torchrun(3, args)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_ranks"] == 2 and summary["target_tp"] == 2
    assert summary["losses"] == pytest.approx(one_target_one_drafter["losses"], rel=1e-4)
    assert summary["tau_after"] == pytest.approx(one_target_one_drafter["tau_after"])
    log = " ".join(proc.stderr.split())
    assert log.count("split across a group of 2 (parallel.target_tp)") == 1  # one line per group
    assert log.count("target done") == 1
    # resume from step 2 (as after a crash there): steps 3-4 repeat
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    torchrun(3, [*args, "--resume"])
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["losses"] == pytest.approx(summary["losses"][2:], rel=1e-5)


# Each drafter kind's extra inputs ride the same path: DSpark's TV and confidence term read the target's final
# hidden states (its distribution), DFlash 2's unary KL reads them too and its selector the drafter's own top-k.
KIND_SETTINGS = {
    "dflash2": ["drafter.kind=dflash2", "drafter.selector_rank=16", "drafter.selector_top_k=8", "train.loss_ce=0",
                "train.loss_kl=1"],
    "dspark": ["drafter.kind=dspark", "drafter.markov_rank=16", "train.loss_ce=0.1", "train.loss_tv=0.9"],
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KIND_SETTINGS))
def test_a_tp2_group_trains_each_drafter_kind_as_one_process_and_resumes(kind, tiny_target, tmp_path):
    """One TP=2 target group and one drafter rank: the features and the target's final hidden states the group
    sends train the losses (finite) and tau of one process holding the whole target; a resume continues them."""
    import math

    from dflash_trainer.train import run

    settings = KIND_SETTINGS[kind] + ["train.checkpoint_every=2"]
    alone = run(load_config("embedded", overrides(tiny_target, tmp_path / "alone") + settings))
    out = tmp_path / "tp2"
    args = ["--config", "embedded", *[x for o in overrides(tiny_target, out) + settings + ["parallel.target_tp=2"]
                                      for x in ("--set", o)], "--target-gpus", "2", "--drafter-gpus", "1"]
    proc = torchrun(3, args)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_tp"] == 2 and all(math.isfinite(x) for x in summary["losses"])
    assert f"drafter: {kind}," in proc.stderr
    assert summary["losses"] == pytest.approx(alone["losses"], rel=1e-4)
    assert summary["tau_after"] == pytest.approx(alone["tau_after"])
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    torchrun(3, [*args, "--resume"])
    assert json.loads((out / "summary.json").read_text())["losses"] == pytest.approx(summary["losses"][2:], rel=1e-5)
