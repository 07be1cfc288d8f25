"""The FP8-dynamic target (target.quantization = "fp8"): weights per output channel and activations per
token in float8_e4m3fn. On a GPU the product is torch._scaled_mm's; on the CPU (here) the same product of the
same FP8 values, dequantized in fp32 (fp8.fp8_matmul; tests/test_gpu.py checks the two agree)."""

import pytest
import torch
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.target.fp8 import FP8, Float8Linear, check_fp8_device, quantize_linears
from dflash_trainer.target.frozen import FrozenTarget
from torch import nn
from transformers import AutoModelForCausalLM


def test_a_float8_linear_scales_each_weight_row_and_each_token():
    torch.manual_seed(0)
    linear = nn.Linear(256, 384, bias=True)
    with torch.no_grad():
        linear.weight[7] *= 1e4  # one loud output channel: its own scale keeps the other rows' precision
    fp8 = Float8Linear(linear)
    assert fp8.weight.dtype == FP8 and fp8.weight.shape == (384, 256) and fp8.weight_scale.shape == (1, 384)
    # each row's largest magnitude lands on FP8's largest value, 448
    assert torch.allclose(fp8.weight.float().abs().amax(dim=1), torch.full((384,), 448.0))
    x = torch.randn(3, 40, 256)
    x[1, 5] *= 1e5  # one loud token: its own scale keeps the other tokens' precision
    with torch.no_grad():
        ref, out = linear(x), fp8(x)
    assert out.shape == ref.shape == (3, 40, 384) and out.dtype == x.dtype
    tokens = torch.ones(3, 40, dtype=torch.bool)
    tokens[1, 5] = False
    channels = torch.ones(384, dtype=torch.bool)
    channels[7] = False
    # e4m3 keeps 3 mantissa bits: about 4% relative error in a product of two quantized operands, in each
    # block alike; with one scale per tensor the loud channel and token would cost the rest their precision
    for rows, cols in ((tokens, channels), (tokens, ~channels), (~tokens, channels)):
        err = (out[rows][:, cols] - ref[rows][:, cols]).norm() / ref[rows][:, cols].norm()
        assert 0.005 < err < 0.06, err.item()
    zeros = fp8(torch.zeros(2, 256))  # a zero row has no amax: a tiny scale, not a division by zero
    torch.testing.assert_close(zeros, linear.bias.detach().expand(2, -1))


def test_quantize_linears_replaces_only_the_shapes_fp8_gemms_take():
    block = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Sequential(nn.Linear(128, 48, bias=False)),
                          nn.Linear(48, 10))  # 10 outputs: not divisible by 16
    assert quantize_linears([block]) == 2
    assert isinstance(block[0], Float8Linear) and isinstance(block[2][0], Float8Linear)
    assert type(block[3]) is nn.Linear
    assert block(torch.randn(4, 64)).shape == (4, 10)


def test_a_checkpoints_own_quantized_layers_are_left_alone_and_a_quantized_checkpoint_refused(tiny_target,
                                                                                               tmp_path):
    """Qwen's *-FP8 and llm-compressor's checkpoints come with their own nn.Linear subclasses holding packed
    weights and scales: quantizing them again would read those as plain weights. They are refused from their
    config.json, before the weights are read."""
    import json
    import shutil

    from dflash_trainer.run.loading import check_inputs

    from tests.test_train import tiny_config

    class PackedLinear(nn.Linear):  # stands in for a checkpoint's own quantized layer class
        pass

    block = nn.Sequential(PackedLinear(64, 64), nn.Linear(64, 64))
    assert quantize_linears([block]) == 1 and type(block[0]) is PackedLinear

    quantized = tmp_path / "target-fp8"
    shutil.copytree(tiny_target["target"], quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}  # as Qwen3-8B-FP8's
    (quantized / "config.json").write_text(json.dumps(config))
    (quantized / "model.safetensors").unlink()  # the refusal must come before any weight is read
    cfg = tiny_config({**tiny_target, "target": str(quantized)}, tmp_path / "run", "target.dtype=bfloat16",
                      "target.quantization=fp8")
    with pytest.raises(ConfigError, match=r"is quantized already .*quant_method fp8\): set target.quantization = "
                                          "'none' to run it as it is"):
        check_inputs(cfg)  # what a start checks before its run directory or any weight
    from dflash_trainer.train import main

    out = tmp_path / "refused"
    assert main(["--config", "embedded", "--output-dir", str(out), "--set", f"target.path={quantized}",
                 "--set", f"data.train={json.dumps([tiny_target['train']])}", "--set", "target.dtype=bfloat16",
                 "--set", "target.quantization=fp8"]) == 2
    assert not out.exists()


def test_gpus_without_fp8_tensor_cores_are_refused_with_the_fix():
    check_fp8_device(torch.device("cpu"))
    check_fp8_device(torch.device("cuda"), capability=(9, 0))  # H100 / H200
    check_fp8_device(torch.device("cuda"), capability=(8, 9))  # L40S
    with pytest.raises(ConfigError, match=r"FP8 tensor cores.*is 8\.0.*target.quantization = 'none'"):
        check_fp8_device(torch.device("cuda"), capability=(8, 0))  # A100


def test_a_run_on_a_gpu_without_fp8_stops_before_reading_the_target(tiny_target, monkeypatch):
    """The refusal is a config error (exit 2 from the trainer), raised before the target's weights are read."""
    import transformers
    from dflash_trainer.run.loading import load_target

    def read(*args, **kwargs):
        raise AssertionError("the target was read before the refusal")

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", read)
    from tests.test_train import tiny_config

    cfg = tiny_config(tiny_target, "unused", "target.dtype=bfloat16", "target.quantization=fp8")
    with pytest.raises(ConfigError, match="needs a GPU with FP8 tensor cores"):
        load_target(cfg, [1], "cuda")


def test_the_fp8_target_quantizes_every_decoder_layer_and_stays_close_to_bf16(tiny_target):
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_target["target"], attn_implementation="sdpa",
                                                dtype=torch.bfloat16)
    fp8 = AutoModelForCausalLM.from_pretrained(tiny_target["target"], attn_implementation="sdpa",
                                               dtype=torch.bfloat16)
    ids = [1, 3]
    ref, target = FrozenTarget(bf16, ids), FrozenTarget(fp8, ids, quantization="fp8")
    layers = len(fp8.model.layers)
    assert target.quantized_linears == 7 * layers  # q k v o gate up down, in every layer (evaluation runs them all)
    assert all(type(m) is not nn.Linear for m in fp8.model.layers.modules())
    assert type(fp8.lm_head) is nn.Linear and fp8.lm_head.weight.dtype == torch.bfloat16  # the head stays
    input_ids = torch.randint(fp8.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    a, b = ref.features(input_ids).float(), target.features(input_ids).float()
    assert a.shape == b.shape
    err = ((b - a).norm() / a.norm()).item()
    assert 0.005 < err < 0.3, err  # different (FP8 rounding), not something else
    with torch.no_grad():  # the full model still answers: the colocated evaluation decodes with it
        logits = fp8(input_ids[:1, :8]).logits
    assert torch.isfinite(logits).all()


def test_unknown_quantization_and_fp32_targets_are_refused(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], attn_implementation="sdpa")
    with pytest.raises(ValueError, match="target quantization 'int4': use 'none' or 'fp8'"):
        FrozenTarget(model, [1], quantization="int4")
    with pytest.raises(ConfigError, match='target.quantization = "int8": must be one of none, fp8'):
        load_config("embedded", ["target.quantization=int8"])
    with pytest.raises(ConfigError, match="fp8 needs target.dtype = bfloat16.*target.dtype is float32.*set "
                                          "target.dtype = bfloat16, or target.quantization = none"):
        load_config("embedded", ["target.quantization=fp8"])  # the embedded default's target is fp32
    assert load_config("embedded", ["target.quantization=fp8", "target.dtype=bfloat16"]).target.quantization == "fp8"


def test_a_colocated_run_trains_on_the_fp8_targets_features_and_dumps_and_evaluation_follow_it(tiny_target, tmp_path,
                                                                                     capsys):
    import json

    from dflash_trainer.eval.cli import main as eval_main
    from dflash_trainer.run.target_rank import dump_features
    from dflash_trainer.train import run

    from tests.test_train import tiny_config

    fp8 = ["target.dtype=bfloat16", "target.quantization=fp8"]
    summary = run(tiny_config(tiny_target, tmp_path / "run", *fp8, "train.checkpoint_every=0"))
    assert len(summary["losses"]) == 6 and summary["final_loss"] < summary["first_loss"]
    assert 1.0 <= summary["tau_before"] <= 8 and 1.0 <= summary["tau_after"] <= 8  # decoding with the FP8 target
    said = capsys.readouterr().err
    assert "target: 42 linears of its decoder layers as FP8-dynamic GEMMs (target.quantization = fp8)" in said  # 7 in each of 6
    dump_features(tiny_config(tiny_target, tmp_path / "dump", *fp8), tmp_path / "feats", 1)
    assert json.loads((tmp_path / "feats" / "meta.json").read_text())["target_quantization"] == "fp8"
    # dflash-eval --run judges against the target as the run had it, unless told otherwise
    for extra, expected in (([], "fp8"), (["--target-quantization", "none"], "none")):
        where = tmp_path / f"eval-{expected}"
        assert eval_main(["--run", str(tmp_path / "run"), "--out", str(where), "--limit", "1",
                          "--max-new-tokens", "8", *extra]) == 0
        report = json.loads((where / "eval.json").read_text())
        assert report["target_quantization"] == expected and report["dtype"] == "bfloat16"
    # a target quantized already is refused by dflash-eval too, from its config.json, with the flag to give
    import shutil

    quantized = tmp_path / "target-quantized"
    shutil.copytree(tiny_target["target"], quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    capsys.readouterr()
    refused = tmp_path / "eval-refused"
    assert eval_main(["--drafter", str(tmp_path / "run" / "drafter"), "--target", str(quantized), "--prompts",
                      tiny_target["eval"], "--out", str(refused), "--dtype", "bfloat16",
                      "--target-quantization", "fp8"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "is quantized already" in err and "give --target-quantization none to run it as it is" in err
    assert not refused.exists()


KIND_SETTINGS = {  # each kind with the loss its authors train it with: DSpark's and DFlash 2's read the target's
    "dflash2": ["drafter.kind=dflash2", "drafter.selector_rank=16", "drafter.selector_top_k=8", "train.loss_ce=0",
                "train.loss_kl=1"],
    "dspark": ["drafter.kind=dspark", "drafter.markov_rank=16", "train.loss_ce=0.1", "train.loss_tv=0.9"],
}


@pytest.mark.parametrize("kind", sorted(KIND_SETTINGS))
def test_each_drafter_kind_trains_on_the_fp8_targets_features_and_distribution(kind, tiny_target, tmp_path, capsys):
    """DFlash 2 (KL) and DSpark (CE + TV): the FP8 target's features and final hidden states reach the loss; the
    first loss differs from the bf16 target's by FP8 rounding, not more; the loss falls and the FP8 target
    verifies the drafts."""
    import math

    from dflash_trainer.train import run

    from tests.test_train import tiny_config

    settings = [*KIND_SETTINGS[kind], "target.dtype=bfloat16", "train.checkpoint_every=0", "train.lr=3e-3"]
    bf16 = run(tiny_config(tiny_target, tmp_path / "bf16", *settings, "train.steps=1", "eval.prompts=1"))
    capsys.readouterr()
    fp8 = run(tiny_config(tiny_target, tmp_path / "fp8", *settings, "target.quantization=fp8"))
    said = capsys.readouterr().err
    assert f"drafter: {kind}," in said and "42 linears of its decoder layers as FP8-dynamic GEMMs" in said
    assert all(math.isfinite(x) for x in fp8["losses"]) and fp8["final_loss"] < fp8["first_loss"]
    assert fp8["first_loss"] != bf16["first_loss"]  # the FP8 target's outputs, not the bf16 one's
    assert fp8["first_loss"] == pytest.approx(bf16["first_loss"], rel=0.1)
    assert 1.0 <= fp8["tau_after"] <= 8
