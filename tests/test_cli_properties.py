"""Property-based tests of every command line: option values drawn from each option's declared type and range
(and from just outside it, non-finite numbers and text that is no number), and damaged drafter files.

Each property: the command accepts the value as the rule says it should (the parsed value is the one given), or
it exits 2 with one message naming the option and no traceback. Seeded (derandomize) and bounded: the same
examples on every run, all of them in a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import types
import typing
from pathlib import Path

import pytest
from dflash_trainer import cli_args, train
from dflash_trainer.bench import step as bench
from dflash_trainer.config import ConfigError, Rule, RunConfig, load_config, setting
from dflash_trainer.eval import cli as eval_cli
from dflash_trainer.regenerate import cli as regenerate_cli
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.helpers.training import random_drafter_dir

FIXED = settings(derandomize=True, database=None, deadline=None, max_examples=25,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Each command's main, and what it needs besides the option under test to get past its parser.
COMMANDS = {
    "dflash-train": (train.main, []),
    "dflash-eval": (eval_cli.main, []),
    "dflash-regenerate": (regenerate_cli.main, ["--target", "t", "--data", "d.jsonl", "--out", "o"]),
    "dflash-bench": (bench.main, []),
}


def parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    """The parser main() builds, caught where it hands it to cli_args.parse (nothing else runs)."""
    caught = []

    def catch(parser, argv):
        caught.append(parser)
        return 0

    monkeypatch.setattr(cli_args, "parse", catch)
    assert main([]) == 0
    monkeypatch.undo()
    return caught[0]


def typed_options() -> list[tuple[str, str, str, cli_args.Typed]]:
    """(command, option, its dest, its type) of every option whose type is a Typed."""
    found = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, (main, _) in COMMANDS.items():
            for action in parser_of(main, monkeypatch)._actions:
                if isinstance(action.type, cli_args.Typed):
                    found.append((name, action.option_strings[-1], action.dest, action.type))
    return found


def test_every_numeric_option_of_every_command_has_a_rule(monkeypatch):
    """No option parses a number with bare int/float (NaN, inf and 1e23 would pass)."""
    for name, (main, _) in COMMANDS.items():
        for action in parser_of(main, monkeypatch)._actions:
            assert action.type not in (int, float), f"{name} {action.option_strings}: a bare {action.type.__name__}"
    assert len(typed_options()) >= 25


# ---- the oracle: what the rule says of a text, written apart from the code under test ------------------

INVALID = object()


def expected(text: str, hint: type, rule: Rule):
    try:
        value = int(text.strip(), 10) if hint is int else float(text)
    except ValueError:
        return INVALID
    if hint is float and not math.isfinite(value):
        return INVALID
    if (rule.ge is not None and value < rule.ge) or (rule.gt is not None and value <= rule.gt) or \
            (rule.le is not None and value > rule.le):
        return INVALID
    return value


def texts(hint: type, rule: Rule) -> st.SearchStrategy[str]:
    """Inside the range, at and just past its bounds, far outside it, and text that is no number of this type."""
    low = rule.ge if rule.ge is not None else rule.gt if rule.gt is not None else -1e6
    high = rule.le if rule.le is not None else 1e6
    odd = st.sampled_from(["", "x", "nan", "NaN", "inf", "-inf", "1e", "1e400", "0x10", "1.5", "1e3", " 7", "--"])
    if hint is int:
        near = st.integers(math.floor(low) - 2, math.floor(low) + 2) | st.integers(int(high) - 2, int(high) + 2)
        numbers = st.integers(math.ceil(low), int(high)) | near | st.integers(-(2**80), 2**80)
    else:
        numbers = st.floats(low, high) | st.sampled_from([low, high, -low - 1, high * 10]) | st.floats()
    return numbers.map(str) | odd


def _run_option(main, needs: list[str], option: str, text: str, capsys, monkeypatch, dest: str):
    """(exit code, stderr, the parsed value): the command stops right after its parser."""
    seen = {}
    real = cli_args.parse

    def parse_only(parser, argv):
        result = real(parser, argv)
        if not isinstance(result, int):
            seen["value"] = getattr(result, dest)
            return 0
        return result

    monkeypatch.setattr(cli_args, "parse", parse_only)
    code = main([*needs, f"{option}={text}"])
    monkeypatch.undo()
    return code, capsys.readouterr().err, seen.get("value")


OPTIONS = typed_options()


@FIXED
@given(data=st.data())
def test_every_option_takes_what_its_rule_allows_and_names_itself_otherwise(data, capsys, monkeypatch):
    command, option, dest, typed = data.draw(st.sampled_from(OPTIONS), label="option")
    text = data.draw(texts(typed.hint, typed.rule), label="value")
    main, needs = COMMANDS[command]
    code, err, value = _run_option(main, needs, option, text, capsys, monkeypatch, dest)
    want = expected(text, typed.hint, typed.rule)
    assert "Traceback" not in err
    if want is INVALID:
        assert code == 2 and f"argument {option}" in err, (command, option, text, err)
        assert err.count("error:") == 1, err
    else:
        assert code == 0 and value == want and type(value) is typed.hint, (command, option, text, err)


# ---- the config loader: every numeric key, by the same rules ------------------------------------------

def _inner(hint):
    """int for `int | None`, float for `float`, list[int] for a list (left out: a list is no single number)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is types.UnionType else hint


def numeric_keys(values: dict | None = None, prefix: str = "") -> list[str]:
    """Every config key whose value is one int or float."""
    keys = []
    for name, value in (values if values is not None else RunConfig().to_dict()).items():
        if isinstance(value, dict):
            keys += numeric_keys(value, f"{prefix}{name}.")
        elif _inner(setting(prefix + name)[0]) in (int, float):
            keys.append(prefix + name)
    return keys


@FIXED
@given(data=st.data())
def test_every_numeric_config_key_takes_what_its_rule_allows(data):
    key = data.draw(st.sampled_from(numeric_keys()), label="key")
    hint, rule = setting(key)
    hint = _inner(hint)
    text = data.draw(texts(hint, rule).filter(lambda t: t.strip() not in ("", "--")), label="value")
    want = expected(text, hint, rule)
    try:
        value = load_config("embedded", [f"{key}={text}"])
    except ConfigError as error:
        assert key in str(error), (key, text, str(error))
        # a value the rule allows is refused only for what another key says of it (both given, a bucket)
        assert want is INVALID or "must be" not in str(error), (key, text, str(error))
        return
    section, _, name = key.rpartition(".")
    got = getattr(getattr(value, section) if section else value, name)
    assert want is not INVALID and got == want, (key, text, got)


def test_the_numeric_keys_cover_every_section():
    assert {"train.steps", "train.lr", "drafter.block_size", "drafter.gamma", "data.max_length",
            "parallel.drafter_ranks", "eval.max_new_tokens"} <= set(numeric_keys())


# ---- damaged drafter files: dflash-eval's and drafter.init_from's one check ----------------------------

@pytest.fixture(scope="module")
def drafter_files(tiny_target, tmp_path_factory) -> Path:
    """A drafter (random weights) built for the tiny target: config.json and model.safetensors."""
    return random_drafter_dir(tiny_target["target"], tmp_path_factory.mktemp("drafter"))


FILE_KEYS = {"block_size": ("drafter.block_size", None), "num_hidden_layers": ("drafter.num_layers", None),
             "mask_token_id": ("drafter.mask_token_id", "dflash_config"),
             "target_layer_ids": ("drafter.target_layer_ids", "dflash_config")}


@FIXED
@given(data=st.data())
def test_an_edited_drafter_config_is_refused_by_the_settings_rules(data, drafter_files, tmp_path_factory):
    """block_size 0 or 10**9, a layer id below 0, a string for a count: exit 2 naming config.json, no traceback."""
    name = data.draw(st.sampled_from(sorted(FILE_KEYS)), label="key")
    setting_key, section = FILE_KEYS[name]
    _, rule = setting(setting_key)
    value = data.draw(st.integers(-3, 2**40) | st.sampled_from(["8", 2.5, None, True]), label="value")
    if name == "target_layer_ids":
        value = [value]
    raw = json.loads((drafter_files / "config.json").read_text())
    (raw[section] if section else raw)[name] = value
    edited = tmp_path_factory.mktemp("edited")
    (edited / "config.json").write_text(json.dumps(raw))
    item = value[0] if isinstance(value, list) else value
    allowed = (isinstance(item, int) and not isinstance(item, bool) and expected(str(item), int, rule) is not INVALID
               or value is None and name == "num_hidden_layers")  # optional: the weights say how many
    try:
        eval_cli.check_drafter_dir(edited)
    except eval_cli.EvalError as error:
        assert not allowed, (name, value, str(error))
        assert str(edited) in str(error)
        return
    assert allowed, (name, value)


@FIXED
@given(cut=st.integers(0, 10_000))
def test_a_cut_short_drafter_weights_file_is_bad_input_naming_the_file(cut, drafter_files, tmp_path_factory):
    import shutil

    damaged = tmp_path_factory.mktemp("cut")
    shutil.copy(drafter_files / "config.json", damaged / "config.json")
    weights = (drafter_files / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(weights[: min(cut, len(weights) - 1)])
    plan = argparse.Namespace(drafter_dir=damaged)
    with pytest.raises(eval_cli.EvalError) as error:
        eval_cli.load_models(plan)
    assert str(damaged / "model.safetensors") in str(error.value) and "copy the drafter directory again" in \
        str(error.value)


# ---- a short real run for a sample of valid values ---------------------------------------------------

@settings(derandomize=True, database=None, deadline=None, max_examples=3, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(max_new=st.integers(1, 6), limit=st.integers(1, 2), tolerance=st.floats(0, 1))
def test_dflash_eval_runs_with_valid_values_and_records_them(max_new, limit, tolerance, drafter_files, tiny_target,
                                                             tmp_path_factory, capsys):
    out = tmp_path_factory.mktemp("eval") / "out"
    code = eval_cli.main(["--drafter", str(drafter_files), "--target", tiny_target["target"], "--prompts",
                          tiny_target["eval"], "--out", str(out), "--device", "cpu", "--max-new-tokens", str(max_new),
                          "--limit", str(limit), f"--tie-tolerance={tolerance!r}"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    report = json.loads((out / "eval.json").read_text())
    assert (report["max_new_tokens"], report["limit"]) == (max_new, limit)
