"""Write docs/settings.md, the reference of every run-config key, from config.py.

Each key's type, default and allowed values come from the config dataclasses (what `load_config` checks);
its meaning from the comments beside it in config.py (the comment on its line and the comment lines just
above it). A key added to config.py appears on the next `make config-doc`; tests/test_docs.py checks that
the committed file is current.

    python -m dflash_trainer.config_doc            # rewrite docs/settings.md
    python -m dflash_trainer.config_doc --check    # exit 1 (and say so) when it is not current
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import sys
import tokenize
from pathlib import Path

from . import config

SOURCE = Path(config.__file__)
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
HEADER = """\
# Settings reference: every key of a run config

<!-- Generated from dflash/dflash_trainer/config.py by `make config-doc`: edit the comments there, not this file. -->

What each key of a run config means, its type, default and allowed values. A run config is a TOML file
(`--config FILE`, or a bundled name: {bundled}); a key goes in its section (`[train]` then `steps = 2000`)
or on the command line (`--set train.steps=2000`; `--set` values are JSON, strings need no quotes, `null`
unsets an optional key). Unknown keys, wrong types and values outside the allowed range are refused before
anything starts, each with its key named. How to write one: [configuration.md](configuration.md).
"""


def comments_by_line(source: str) -> dict[int, str]:
    """{line number: the text of the comment on that line}."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def field_comments(source: str) -> dict[str, dict[str, str]]:
    """{class name: {field name: its comment}}: the comment lines just above a field, then the one on its line."""
    comments, lines = comments_by_line(source), source.splitlines()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = out.setdefault(node.name, {})
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above, line = [], stmt.lineno - 1
                while line >= 1 and lines[line - 1].strip().startswith("#"):
                    above.insert(0, comments[line])
                    line -= 1
                beside = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
                fields[stmt.target.id] = " ".join(above + beside)
    return out


def type_name(hint) -> str:
    inner, nullable = config._optional(hint)
    if getattr(inner, "__origin__", None) is list:
        text = f"list of {inner.__args__[0].__name__}"
    else:
        text = {bool: "bool", int: "int", float: "float", str: "string"}.get(inner, str(inner))
    return text + (" or unset" if nullable else "")


def allowed(rule: config.Rule) -> str:
    parts = []
    if rule.choices:
        parts.append("one of " + ", ".join(f"`{c}`" for c in rule.choices))
    for word, bound in ((">=", rule.ge), (">", rule.gt), ("<=", rule.le)):
        if bound is not None:
            parts.append(f"{word} {int(bound) if float(bound).is_integer() else bound}")
    if rule.path:
        parts.append("a path (a leading `~` is expanded)")
    return ", ".join(parts)


def default_of(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if value is None:
        return "unset"
    return "`" + (json.dumps(value) if not isinstance(value, float) else repr(value)) + "`"


def cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def table(cls, comments: dict[str, str], prefix: str) -> list[str]:
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f, hint, rule in config._fields(cls):
        if not dataclasses.is_dataclass(hint):
            rows.append(f"| `{prefix}{f.name}` | {type_name(hint)} | {cell(default_of(f))} | {cell(allowed(rule))} | "
                        f"{cell(comments.get(f.name, ''))} |")
    return rows


def render(source: str) -> str:
    comments = field_comments(source)
    bundled = ", ".join(f"`{p.stem}`" for p in sorted(config.CONFIG_DIR.glob("*.toml")))
    lines = HEADER.format(bundled=bundled).splitlines()
    lines += ["", "## Top level", ""] + table(config.RunConfig, comments.get("RunConfig", {}), "")
    for f, hint, _ in config._fields(config.RunConfig):
        if dataclasses.is_dataclass(hint):
            doc = (hint.__doc__ or "").strip()
            doc = "" if doc.startswith(hint.__name__ + "(") else doc  # dataclasses' own signature, not a docstring
            lines += ["", f"## [{f.name}]", ""] + ([doc, ""] if doc else [])
            lines += table(hint, comments.get(hint.__name__, {}), f"{f.name}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_trainer.config_doc", description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", type=Path, default=REFERENCE)
    ap.add_argument("--check", action="store_true", help="only say whether the file is current")
    args = ap.parse_args(argv)
    wanted = render(SOURCE.read_text())
    current = args.file.read_text() if args.file.is_file() else ""
    if args.check:
        if current != wanted:
            print(f"config-doc: {args.file} is not current with config.py: run make config-doc", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        try:
            args.file.write_text(wanted)
        except OSError as exc:
            print(f"config-doc: cannot write {args.file}: {exc.strerror or exc}; create its folder "
                  f"({args.file.parent}) or give a file in an existing one", file=sys.stderr)
            return 2
        print(f"config-doc: wrote {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
