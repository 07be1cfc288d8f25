"""dflash-eval, dflash-regenerate and the benches read the run config dflash-train reads: --config FILE, then --set,
then the flags that set one key each (--target is target.path, --micro-batch train.micro_batch, ...). A bad key is
bad input (exit 2) naming the key and the fix, and nothing is written."""

from __future__ import annotations

import json

import pytest
from dflash_trainer.bench import regenerate as bench_regenerate
from dflash_trainer.bench import startup as bench_startup
from dflash_trainer.bench import step as bench
from dflash_trainer.eval import cli as eval_cli
from dflash_trainer.regenerate import cli as regenerate_cli

from tests.helpers.training import random_drafter_dir


@pytest.fixture
def run_toml(tmp_path, tiny_target):
    """A training config as users write one: the target (in bf16), a micro-batch and tau's new tokens."""
    path = tmp_path / "run.toml"
    path.write_text(f"[target]\npath = {json.dumps(tiny_target['target'])}\ndtype = \"bfloat16\"\n\n"
                    "[train]\nmicro_batch = 3\n\n[eval]\nmax_new_tokens = 3\n")
    return path


@pytest.fixture(scope="module")
def drafter(tiny_target, tmp_path_factory):
    return random_drafter_dir(tiny_target["target"], tmp_path_factory.mktemp("drafter"))


def test_eval_takes_the_target_and_tokens_from_the_config_and_set_overrides_it(run_toml, drafter, tiny_target,
                                                                             tmp_path, capsys):
    out = tmp_path / "eval"
    code = eval_cli.main(["--config", str(run_toml), "--set", "target.dtype=float32", "--drafter", str(drafter),
                          "--prompts", tiny_target["eval"], "--limit", "1", "--device", "cpu", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "eval.json").read_text())
    # the file's target and max_new_tokens; --set's dtype over the file's bfloat16, the drafter's with it
    assert (report["target"], report["max_new_tokens"]) == (tiny_target["target"], 3)
    assert (report["dtype"], report["drafter_dtype"]) == ("float32", "float32")


def test_eval_flags_set_their_keys_over_the_file(run_toml, capsys):
    argv = ["--config", str(run_toml), "--set", "eval.max_new_tokens=5", "--max-new-tokens", "7", "--dtype",
            "float16", "--target-quantization", "fp8", "--print-config"]
    assert eval_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert 'dtype = "float16"' in printed and "max_new_tokens = 7" in printed and 'quantization = "fp8"' in printed


def test_regenerate_takes_the_target_and_dtype_from_the_config(run_toml, tiny_target, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(regenerate_cli, "run", lambda args: seen.append((args.target, args.dtype)))
    needs = ["--data", "d.jsonl", "--out", str(tmp_path / "out")]
    assert regenerate_cli.main(["--config", str(run_toml), *needs]) == 0
    assert regenerate_cli.main(["--config", str(run_toml), "--set", "target.path=/models/x", *needs]) == 0
    assert regenerate_cli.main(["--config", str(run_toml), "--target", "/models/y", "--dtype", "float32", *needs]) == 0
    assert regenerate_cli.main(["--target", "/models/z", *needs]) == 0  # no config: the command's own auto dtype
    assert seen == [(tiny_target["target"], "bfloat16"), ("/models/x", "bfloat16"), ("/models/y", "float32"),
                    ("/models/z", "auto")]


def test_regenerate_without_a_target_says_where_to_give_it(tmp_path, capsys):
    assert regenerate_cli.main(["--data", "d.jsonl", "--out", str(tmp_path / "out")]) == 2
    assert "--target is missing: give the target model directory (or --config with target.path)" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bench_takes_the_shape_from_the_config(run_toml, tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "tiny", "--config", str(run_toml), "--set", "train.grad_accum=2", "--seq", "64",
                       "--anchors", "4", "--steps", "1", "--untimed-steps", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["micro_batch"], result["grad_accum"], result["seq"], result["anchors"]) == (3, 2, 64, 4)


def test_startup_bench_passes_the_config_to_the_trainer(run_toml, tmp_path, capsys):
    assert bench_startup.main(["--config", str(run_toml), "--seq", "96", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "max_length = 96" in printed and "micro_batch = 3" in printed
    args = bench_startup.train_args("tiny", tmp_path, 96, 4, str(run_toml), ["train.lr=0.001"])
    assert args[:4] == ["--config", str(run_toml), "--set", "train.lr=0.001"] and "data.max_length=96" in args


def _refused(command, argv, capsys) -> str:
    """The exit code must be 2 (a parser's error exits by SystemExit); stderr."""
    try:
        code = command(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return " ".join(err.split())


@pytest.mark.parametrize("command, argv", [
    (eval_cli.main, ["--drafter", "d", "--target", "t", "--prompts", "p.jsonl", "--out", "{out}"]),
    (regenerate_cli.main, ["--target", "t", "--data", "d.jsonl", "--out", "{out}"]),
    (bench.main, ["--preset", "tiny", "--json", "{out}"]),
    (bench_startup.main, ["--preset", "tiny", "--work", "{out}"]),
    (bench_regenerate.main, ["--preset", "tiny", "--json", "{out}"]),
], ids=["eval", "regenerate", "bench", "bench-startup", "bench-regenerate"])
def test_a_bad_key_is_refused_naming_it_and_nothing_is_written(command, argv, tmp_path, capsys):
    out = tmp_path / "out"
    err = _refused(command, [a.format(out=out) for a in argv] + ["--set", "train.stepz=3"], capsys)
    assert "unknown key 'stepz' in [train] (did you mean 'steps'?)" in err
    err = _refused(command, [a.format(out=out) for a in argv] + ["--set", "target.dtype=fp4"], capsys)
    assert "target.dtype" in err and "bfloat16" in err
    assert not out.exists()


def test_eval_of_a_run_takes_its_settings_and_set_overrides_them(drafter, tiny_target, tmp_path, capsys):
    """--run OUTPUT: the run's config.json gives the target and settings; --set and the flags override them."""
    import shutil

    from dflash_trainer.config import RunConfig

    run = tmp_path / "run"
    shutil.copytree(drafter, run / "drafter")
    recorded = RunConfig().to_dict()
    recorded["target"].update(path=tiny_target["target"], dtype="float32")
    recorded["train"]["dtype"], recorded["eval"]["max_new_tokens"] = "float32", 4
    (run / "config.json").write_text(json.dumps(recorded))
    reports = []
    for extra in ([], ["--set", "eval.max_new_tokens=2"], ["--set", "eval.max_new_tokens=2", "--max-new-tokens", "3"]):
        out = tmp_path / f"eval{len(reports)}"
        code = eval_cli.main(["--run", str(run), "--prompts", tiny_target["eval"], "--limit", "1", "--device", "cpu",
                              "--out", str(out), *extra])
        assert code == 0, capsys.readouterr().err
        reports.append(json.loads((out / "eval.json").read_text()))
    assert [r["max_new_tokens"] for r in reports] == [4, 2, 3]
    assert {(r["target"], r["dtype"]) for r in reports} == {(tiny_target["target"], "float32")}
