"""What every command line of the trainer (dflash-train, dflash-eval, dflash-regenerate, dflash-bench) accepts,
checked by the rules the config loader uses, and the exit-code contract all of them follow.

A numeric flag's `type=` is a `Typed`: its value parsed as an integer or a finite number and checked
against a config.Rule (ranges, with upper bounds where it counts work), so `--temperature nan` or
`--max-new-tokens 1e23` is refused by argparse, exit 2, with one message naming the flag. A flag that
sets a config key (`--drafter-gpus`) takes that key's own declared type and Rule (`for_key`). Paths that
must be files or directories are checked the same way: "is a directory" is said as such, never "not found".

Exit codes, for every command:
    0  done
    1  a fault at run time (a disk full, a damaged checkpoint, a diverged loss, output that differs)
    2  bad input: a flag, a config key, a data file or a directory needs a change (the message says which)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from . import config
from .config import MAX_TOKENS, Rule, RunConfig, check_value, describe_rule, given_keys, load_config
from .config import setting as config_setting

OK, FAULT, BAD_INPUT = 0, 1, 2


def bad_input_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The errors whose fix is a change of input: the trainer's own, and a command's (EvalError, ...)."""
    from .config import ConfigError
    from .data.rows import DataError
    from .run.run_dir import RunDirError
    from .run.train_state import UnsafeCheckpoint

    return (ConfigError, DataError, RunDirError, UnsafeCheckpoint, *more)


def exit_code(exc: BaseException, *more: type[BaseException]) -> int:
    """BAD_INPUT for bad_input_errors(*more), FAULT for anything else that ends a command."""
    return BAD_INPUT if isinstance(exc, bad_input_errors(*more)) else FAULT


def _parse_number(text: str, hint):
    """The text as an int (digits only: 1e3 and 2.0 are no integers) or a float (nan and inf included: check_value
    refuses them by name); ValueError otherwise."""
    text = text.strip()
    return int(text, 10) if hint is int else float(text)


@dataclass(frozen=True)
class Typed:
    """An argparse `type=`: the flag's text as `hint` (int or float), checked against `rule` as the config loader
    checks a key. argparse turns the ArgumentTypeError into "argument --flag: ..." and exit 2."""

    hint: type
    rule: Rule

    @property
    def __name__(self) -> str:  # argparse names the type in some of its own messages
        return self.hint.__name__

    def describe(self) -> str:
        return describe_rule(self.hint, self.rule)

    def __call__(self, text: str):
        try:
            value = _parse_number(text, self.hint)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {self.describe()}") from None
        typed, problem = check_value(value, self.hint, self.rule)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{text}: {problem} (give {self.describe()})")
        return typed


def integer(ge: float | None = None, le: float | None = None, gt: float | None = None) -> Typed:
    return Typed(int, Rule(ge=ge, gt=gt, le=le))


def number(ge: float | None = None, le: float | None = None, gt: float | None = None) -> Typed:
    """A finite float (nan and inf are refused) within the bounds."""
    return Typed(float, Rule(ge=ge, gt=gt, le=le))


def for_key(key: str) -> Typed:
    """The type of a flag that sets the config key `key`: that key's declared type and Rule."""
    hint, rule = config_setting(key)
    return Typed(hint, rule)


# Counts of work the command lines share: the config's own rules for them.
STEPS = Typed(int, config.STEPS)
NEW_TOKENS = Typed(int, config.NEW_TOKENS)
TOKENS = integer(ge=1, le=MAX_TOKENS)  # one token is a usable count here (config.TOKENS starts at 2: a context)
PROMPTS = Typed(int, config.PROMPTS)
ROWS = Typed(int, config.ROWS)
PROCESSES = Typed(int, config.PROCESSES)
SEED = for_key("train.seed")
SECONDS = number(gt=0, le=7 * 24 * 3600)  # a week


# ---- paths -------------------------------------------------------------------------------------

def path_problem(path: Path, kind: str) -> str | None:
    """What keeps `path` from being the `kind` ("file" or "directory") a flag needs, or None. A missing path is a
    problem only for a file (a directory may be created)."""
    if kind == "file" and path.is_dir():
        return "is a directory: give a file (one in it, or a glob)"
    if kind == "file" and not path.exists():
        return f"not found (relative paths are from {Path.cwd()})"
    if kind == "directory" and path.exists() and not path.is_dir():
        return "is a file: give a directory"
    return None


def existing_file(text: str) -> str:
    if problem := path_problem(Path(text), "file"):
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return text


def directory(text: str) -> str:
    """A directory, or a path where one can be made."""
    if problem := path_problem(Path(text), "directory"):
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return text


def file_or_dataset(text: str) -> str:
    """A data file, a glob, or a hub dataset name: refused only when it names a directory (a hub name never does)."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give the JSONL file(s) in it (or a glob such as "
                                         f"{Path(text) / '*.jsonl'}) or a hub dataset name")
    return text


def named_source(text: str) -> str:
    """--name NAME=SOURCE, its SOURCE checked as file_or_dataset."""
    _, sep, source = text.partition("=")
    if sep and source.strip():
        file_or_dataset(source.strip())
    return text


# ---- --log-format: text, or one JSON object a line -------------------------------------------------

def add_log_format_flag(parser: argparse.ArgumentParser) -> None:
    from .infra.console import LOG_FORMATS

    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text (default), or json: every line on stderr one JSON object (time, stage, message; "
                             "progress lines add step, loss, tokens_per_s, tau, ...) for log collectors; no bars")


def use_log_format(args: argparse.Namespace, stage: str) -> None:
    """The console's format for this command (stage: its name in each JSON line)."""
    from .infra.console import console

    console.use(args.log_format, stage)


# ---- the run config: --config, --set and the flags that set one key each ----------------------------

def add_config_flags(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """--config, --set and --print-config, as dflash-train takes them. default None: every key at its default
    until a file or --set gives it (a command's own defaults then stand, see `chosen`)."""
    parser.add_argument("--config", default=default, metavar="NAME_OR_FILE",
                        help="a TOML run config, or a bundled config name (default: "
                             + (default or "none, every key at its default") + ")")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key (repeatable)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the merged config (defaults, the file, --set and the flags) as TOML and exit")


def key_flag(parser, flag: str, key: str, help: str, **kwargs) -> None:
    """A flag that sets the config key `key`: the key's type and Rule (unless choices or an action are given), its
    help naming the key. Its default is None (not given): the key's value then comes from --config / --set."""
    if "choices" not in kwargs and "action" not in kwargs and config_setting(key)[0] in (int, float):
        kwargs["type"] = for_key(key)  # a number: the key's Rule (a path or a name is taken as given)
    parser.add_argument(flag, help=f"{help} ({key})", default=None, **kwargs)


def flag_settings(args: argparse.Namespace, key_flags: dict[str, str]) -> dict[str, str]:
    """{flag: "key=value"} of the key-bound flags given, as load_config takes them (named as themselves in its
    errors). A flag's "auto" is no value of its key: the command decides (a dtype by the device)."""
    settings = {}
    for flag, key in key_flags.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and value != "auto":
            settings[flag] = f"{key}={_override_text(value)}"
    return settings


def _override_text(value) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def run_config(args: argparse.Namespace, key_flags: dict[str, str] | None = None, *,
               whole_run: bool = True, checks=None) -> RunConfig:
    """The merged run config: the defaults < --config < --set < the key-bound flags; ConfigError (exit 2) naming
    the key, the file or the flag and the fix, every problem at once (checks: as load_config takes them)."""
    return load_config(args.config, args.set, flag_settings(args, key_flags or {}), whole_run=whole_run,
                       checks=checks)


def chosen(cfg: RunConfig, key: str, fallback):
    """The key's value when the file, --set or a flag gave it, else the command's own default `fallback` (where
    the command's default differs from the config's: eval's 256 new tokens, a dtype by the device)."""
    if key not in given_keys(cfg):
        return fallback
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def config_toml(values: dict, section: str = "") -> str:
    """The merged config as TOML: top-level keys, then one [section] per table; an unset (null) key is a
    comment, as TOML has no null."""
    lines = [f"[{section}]"] if section else []
    for key, value in values.items():
        if isinstance(value, dict):
            continue
        lines.append(f"# {key} is unset" if value is None else f"{key} = {_toml_value(value)}")
    text = "\n".join(lines) + "\n"
    for key, value in values.items():
        if isinstance(value, dict):
            text += "\n" + config_toml(value, f"{section}.{key}" if section else key)
    return text


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings (JSON escapes are TOML's), ints, floats


def print_config(cfg: RunConfig) -> None:
    """--print-config: the merged config as TOML on stdout (train.steps unset when train.epochs derives it)."""
    values = cfg.to_dict()
    if cfg.train.epochs is not None:  # derived from the data at the start, not read from here
        values["train"]["steps"] = None
    print(config_toml(values), end="")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parser's answer, or the exit code argparse chose after saying why (2: a bad flag; 0: --help): main()
    returns it as it returns every other refusal, rather than raising SystemExit."""
    try:
        # `--flag=--`: Python 3.11's argparse drops the "--" and hands the option [] without calling its type,
        # where `--flag --` is refused for want of a value: refused the same way here.
        for arg in sys.argv[1:] if argv is None else argv:
            if arg.startswith("--") and arg.endswith("=--"):
                parser.error(f"argument {arg[:-3]}: expected one argument")
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else BAD_INPUT


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None, key_flags: dict[str, str],
                      console, checks=None) -> tuple[argparse.Namespace, RunConfig] | int:
    """A command's flags and its merged run config (whole_run=False: not a training run), or the exit code to
    return: argparse's, 2 for a bad key (said on `console`), 0 after --print-config printed the config.
    checks: what else the command asks of the config, as load_config takes them."""
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        cfg = run_config(args, key_flags, whole_run=False, checks=checks)
    except config.ConfigError as exc:
        say_error(console, str(exc))
        return BAD_INPUT
    if args.print_config:
        print_config(cfg)
        return 0
    return args, cfg


def say_error(console, message: str, *, bold: str = "error:") -> None:
    """One error line on a rich console: the message escaped (a path such as mt[bench].jsonl is text, not markup)."""
    from rich.markup import escape

    console.print(f"[red]{escape(bold)}[/] {escape(message)}", soft_wrap=True)
