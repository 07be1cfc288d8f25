"""`make bench` on CPU with the tiny preset: the timing loop, accumulation, the target path and the report."""

import json

import pytest
from dflash_trainer.bench import step as bench


@pytest.mark.parametrize("extra", [[], ["--grad-accum", "2", "--with-target"], ["--moments-dtype", "bfloat16"],
                                   ["--with-target", "--set", "train.loss_ce=0.1", "--set", "train.loss_tv=0.9"]],
                         ids=["drafter", "accum+target", "bf16-moments", "tv-loss+target"])
def test_tiny_bench_reports_a_consistent_result(tmp_path, extra):
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "tiny", "--seq", "128", "--anchors", "8", "--steps", "2", "--untimed-steps", "1",
                       "--json", str(out), *extra]) == 0
    r = json.loads(out.read_text())
    accum = 2 if "--grad-accum" in extra else 1
    # the A/B's two arms: the moments as the optimizer held them after the steps, and their bytes (plus the
    # 4-byte step counters, one per tensor)
    bf16 = "--moments-dtype" in extra
    assert r["moments_dtype"] == ["bfloat16" if bf16 else "float32"]
    assert r["optimizer_state_gib"] * 2**30 == pytest.approx(2 * (2 if bf16 else 4) * r["drafter_params_m"] * 1e6,
                                                             rel=1e-3)
    assert r["grad_accum"] == accum and r["compiled_layers"] is False and r["device"] == "cpu"
    assert r["drafter_step_ms"] > 0 and r["drafter_step_ms_min"] <= r["drafter_step_ms"]
    # tokens/s counts every micro-batch of the step; the FLOPs are those of all of them
    assert r["context_tokens_per_s_drafter"] == pytest.approx(accum * 128 / (r["drafter_step_ms"] / 1e3))
    assert r["achieved_tflops"] == pytest.approx(r["model_tflop_per_step"] / (r["drafter_step_ms"] / 1e3))
    assert (r["target_ms"] is not None) == ("--with-target" in extra) and r["mfu"] is None  # no GPU peak here
    assert r["clock_unavailable"] == "not a CUDA device" and "sm_clock_mhz_mean" not in r


def test_the_bench_times_each_drafter_kind_with_its_own_loss(tmp_path):
    """--kind (drafter.kind) builds the preset's drafter of that kind, its settings and loss from the config: DFlash 2
    (its convolutions and selector, the selector's CE beside a KL unary term) and DSpark (its Markov and confidence
    heads, 0.1 CE + 0.9 TV against the target), each a couple of steps on a CPU."""
    runs = {"dflash": [], "dflash2": ["--kind", "dflash2", "--set", "drafter.selector_rank=16", "--set",
                                      "train.loss_ce=0", "--set", "train.loss_kl=1"],
            "dspark": ["--kind", "dspark", "--set", "drafter.markov_rank=32", "--set", "train.loss_ce=0.1", "--set",
                       "train.loss_tv=0.9"]}
    got = {}
    for kind, extra in runs.items():
        out = tmp_path / f"{kind}.json"
        assert bench.main(["--preset", "tiny", "--seq", "64", "--anchors", "4", "--steps", "2", "--untimed-steps", "1",
                           "--no-memory-probe", "--json", str(out), *extra]) == 0
        got[kind] = json.loads(out.read_text())
    assert {kind: r["kind"] for kind, r in got.items()} == {kind: kind for kind in runs}
    assert got["dspark"]["loss"] == {"ce": 0.1, "kl": 0.0, "tv": 0.9}
    plain = got["dflash"]
    for kind in ("dflash2", "dspark"):  # the kind's own modules are there and counted in the step's FLOPs
        assert got[kind]["drafter_params_m"] > plain["drafter_params_m"], kind
        assert got[kind]["model_tflop_per_step"] > plain["model_tflop_per_step"], kind
        assert got[kind]["drafter_step_ms"] > 0


TINY = ["--preset", "tiny", "--seq", "64", "--anchors", "4", "--steps", "1", "--untimed-steps", "1", "--no-memory-probe"]


def test_the_bench_times_the_drafter_the_config_gives_over_the_presets(tmp_path):
    """drafter.* and train.* from --set or the config file reach the timed step as dflash-train builds it; the keys
    neither gives keep the preset's (tiny: 2 layers, blocks of 8). The JSON records the shape it timed."""
    from dflash_trainer.model.anchors import default_gamma

    def timed(*extra) -> dict:
        out = tmp_path / "bench.json"
        assert bench.main([*TINY, "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())

    preset = timed()
    assert (preset["drafter_layers"], preset["block"], preset["gamma"]) == (2, 8, default_gamma(8))
    assert preset["dtype"] == "float32" and preset["attention"] == "sdpa"  # a CPU's defaults
    given = timed("--set", "drafter.num_layers=3", "--set", "drafter.block_size=4", "--set", "drafter.gamma=2.5",
                  "--set", "train.dtype=bfloat16", "--set", "train.position_weighting=dpace")
    assert (given["drafter_layers"], given["block"], given["gamma"]) == (3, 4, 2.5)
    assert given["dtype"] == "bfloat16" and given["position_weighting"] == "dpace"
    # one more layer of the same width: its parameters and FLOPs are in the timed step (4-token blocks: fewer FLOPs
    # per layer, so the per-layer parameters are the measure)
    assert given["drafter_params_m"] * 2 / 3 == pytest.approx(preset["drafter_params_m"], rel=0.05)
    config = tmp_path / "run.toml"
    config.write_text("[drafter]\nnum_layers = 5\nblock_size = 16\n")  # the config's defaults, given: they count
    from_file = timed("--config", str(config))
    assert (from_file["drafter_layers"], from_file["block"]) == (5, 16)


def test_the_bench_builds_its_step_as_the_trainer_does():
    """The drafter, optimizer and step setup() times: the layers and block of --set, the position decay, and the
    optimizer and LR schedule of train.*."""
    from dflash_trainer.config import load_config

    cfg = load_config(None, ["drafter.num_layers=3", "drafter.block_size=4", "drafter.gamma=2.5", "train.lr=3e-3",
                             "train.max_grad_norm=0.5", "train.weight_decay=0.1", "train.num_anchors=4"],
                      whole_run=False)
    args = bench.parser().parse_args(["--preset", "tiny"])
    device = bench.torch.device("cpu")
    s = bench.setup(args, bench.preset_config(cfg, "tiny"), device, bench.step_dtype(cfg, device))
    assert len(s.drafter.layers) == 3 and s.drafter.block_size == 4 and s.step.gamma == 2.5
    assert s.drafter.mask_token_id == bench.PRESETS["tiny"]["drafter"]["mask_token_id"]  # the preset's: not given
    group = s.opt.opt.param_groups[0]
    assert (group["initial_lr"], group["weight_decay"], s.opt.max_grad_norm) == (3e-3, 0.1, 0.5)
    assert s.step.scheduler is not None and s.step.num_anchors == 4


@pytest.mark.parametrize("bad, says", [(["--steps", "0"], "argument --steps: 0: must be >= 1"),
                                       (["--seq", "0"], "argument --seq: 0: must be >= 2"),
                                       (["--untimed-steps", "-1"], "argument --untimed-steps: -1: must be >= 0"),
                                       (["--micro-batch", "-1"], "argument --micro-batch: -1: must be >= 1"),
                                       (["--stack-dump-after", "nan"], "argument --stack-dump-after: nan: must be"),
                                       (["--kind", "dspark", "--set", "drafter.selector_rank=8"],
                                        "drafter.selector_rank is a DFlash 2 setting, and drafter.kind is dspark"),
                                       (["--kind", "dflash2", "--set", "drafter.conv_group_size=48"],
                                        "conv_group_size 48 does not divide the hidden size 64"),
                                       (["--kind", "dflash3"], "argument --kind: invalid choice: 'dflash3'"),
                                       (["--set", "drafter.num_layers=0"], "drafter.num_layers = 0: must be >= 1"),
                                       (["--set", "drafter.block_size=1"], "drafter.block_size = 1: must be >= 2"),
                                       (["--set", "drafter.target_layer_ids=[9]"],
                                        "[9] are not layers of target --preset tiny, which has 6"),
                                       (["--set", "drafter.init_from=runs/x/drafter"],
                                        "the benchmark times a new drafter on the preset's target"),
                                       (["--set", "train.loss_ce=0"], "train.loss_tv are all 0")])
def test_bench_refuses_counts_below_one_in_words(bad, says, capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "tiny", "--json", str(out), *bad]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not out.exists()


def test_real_presets_need_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--preset", "qwen3-8b"]) == 2
    assert "needs a CUDA GPU; use --preset tiny" in capsys.readouterr().err


def test_idle_gaps_are_charged_to_the_phase_and_op_the_cpu_was_in():
    from dflash_trainer.bench.step import idle_gaps

    def ev(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = [
        ev("user_annotation", "step/forward", 0, 100), ev("user_annotation", "step/sync", 100, 60),
        ev("cpu_op", "aten::mm", 0, 20), ev("cpu_op", "aten::index_add_", 30, 40),
        ev("cuda_runtime", "cudaStreamSynchronize", 100, 60), ev("cpu_op", "autograd::engine", 0, 200, tid=2),
        ev("kernel", "gemm", 10, 20, tid=7), ev("kernel", "gemm", 32, 3, tid=7),  # 2 us gap: launch latency
        ev("kernel", "add", 60, 30, tid=7),  # 25 us gap at t=47.5, inside index_add_ within forward
        ev("gpu_memcpy", "DtoH", 150, 5, tid=7),  # 60 us gap at t=120, in the sync
        {"ph": "i", "name": "marker", "ts": 5},
    ]
    charged, gaps = idle_gaps(trace)
    assert gaps == 2
    assert charged == {("forward", "aten::index_add_"): 25.0, ("sync", "cudaStreamSynchronize"): 60.0}
    assert idle_gaps([ev("kernel", "k", 0, 1)]) == ({}, 0)  # no step phases: nothing to charge


@pytest.mark.slow
def test_startup_bench_starts_the_trainer_cold_then_warm(tmp_path):
    """Two real torchrun starts of the tiny preset on one cache, their phases as the runs measured them."""
    from dflash_trainer.bench import startup as bench_startup

    out = tmp_path / "startup.json"
    assert bench_startup.main(["--preset", "tiny", "--seq", "128", "--anchors", "8", "--starts", "2",
                               "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [s["cache"] for s in result["starts"]] == ["cold", "warm"]
    for start in result["starts"]:
        phases = start["startup_s"]
        assert {"start-up and imports", "compile step", "step 1"} <= set(phases)
        assert abs(sum(phases.values()) - start["time_to_first_step_s"]) < 0.05  # the phases add up to the total
    assert (tmp_path / "work" / "tiny-s128-n8-d1" / "features" / "meta.json").is_file()  # made once, for every start


@pytest.mark.parametrize("args, says", [
    (["--starts", "0"], "argument --starts: 0: must be >= 1"),
    (["--work", "{file}/work"], "is a file, so no directory can be made there"),
    (["--json", "{file}/out.json"], "exists and is not a directory"),
])
def test_startup_bench_refuses_bad_input_in_words(tmp_path, capsys, args, says):
    from dflash_trainer.bench import startup as bench_startup

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        bench_startup.main([a.format(file=tmp_path / "file") for a in args])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing made
