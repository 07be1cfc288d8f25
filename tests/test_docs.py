"""The documents a user reads stay true to the code: every command they show parses (each `make X` target
exists, each trainer command's module accepts the flags shown), every config they name exists and loads,
every relative link and anchor resolves, the settings reference is current with config.py, and the
README's inventory settings are the example inventory's."""
from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dflash_trainer import config, config_doc

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLE_SETTINGS = REPO / "inventory" / "example" / "group_vars" / "all" / "proxmox.yml"

# The programs the docs show, by the module that parses their command line.
CONSOLE_SCRIPTS = {"dflash-train": "dflash_trainer.train", "dflash-eval": "dflash_trainer.eval.cli",
                   "dflash-regenerate": "dflash_trainer.regenerate", "dflash-doctor": "dflash_image.doctor",
                   "dflash-export": "dflash_trainer.export.cli"}
# make variables that carry a module's flags (Makefile).
MAKE_ARGS = {"TRAIN_ARGS": "dflash_trainer.train", "EVAL_ARGS": "dflash_trainer.eval.cli",
             "REGEN_ARGS": "dflash_trainer.regenerate", "BENCH_ARGS": "dflash_trainer.bench.step",
             "STARTUP_ARGS": "dflash_trainer.bench.startup", "REGEN_BENCH_ARGS": "dflash_trainer.bench.regenerate"}
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
PROGRAM = re.compile(r"^(make|torchrun|python3?|\S*/python3?|dflash-[a-z]+)\s")


def doc_name(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---- commands ------------------------------------------------------------------------------------------
def shell_lines(text: str) -> list[str]:
    """Lines of fenced code blocks (not yaml/toml), of indented blocks, and inline code spans; continuations joined."""
    lines, block, lang = [], None, ""
    for raw in text.splitlines():
        if raw.startswith("```"):
            block, lang = (None, "") if block is not None else ([], raw[3:].strip())
        elif (lang in ("", "bash", "sh", "console")) if block is not None else raw.startswith("    "):
            lines.append(raw)  # a shell block's line, or an indented block's
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return joined + [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose, re.DOTALL)]


def command_lines(text: str) -> list[list[str]]:
    """The words of every command that starts with a program, comments dropped, split at && || ;."""
    commands = []
    for line in shell_lines(text):
        command: list[str] = []
        for word in [*tokens(line), ";"]:
            if word not in ("&&", "||", ";"):
                command.append(word)
            elif command:
                if PROGRAM.match(command[0] + " "):
                    commands.append(command)
                command = []
    return commands


def tokens(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in prose: split on blanks
        return command.split()


def module_of(words: list[str]) -> tuple[str | None, list[str]]:
    """(the module whose command line this is, the words after it) for python -m / torchrun / a console script."""
    if words[0] in CONSOLE_SCRIPTS:
        return CONSOLE_SCRIPTS[words[0]], words[1:]
    if "-m" in words[:-1]:
        module = words[words.index("-m") + 1]
        if module.startswith(("dflash_trainer", "dflash_image")):
            return module, words[words.index("-m") + 2:]
    return None, []


def flags(words: list[str]) -> set[str]:
    return {FLAG.match(w).group(0) for w in words if FLAG.match(w)}


@functools.cache
def make_targets() -> frozenset[str]:
    targets = set()
    for mk in [REPO / "Makefile", *REPO.glob("*/*.mk")]:
        for names in re.findall(r"^([a-zA-Z][a-zA-Z0-9_ -]*?)\s*:(?!=)", mk.read_text(), re.MULTILINE):
            targets |= set(names.split())
    return frozenset(targets)


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(document, the command as shown, its words) for every command the docs show."""
    return [(doc_name(doc), " ".join(words), words) for doc in DOCS for words in command_lines(doc.read_text())]


def uses() -> dict[str, list[tuple[str, str, set[str]]]]:
    """{module: [(doc, command, flags shown)]} over every command the docs show."""
    found: dict[str, list] = {}
    for doc, cmd, words in shown_commands():
        module, rest = module_of(words)
        if module:
            found.setdefault(module, []).append((doc, cmd, flags(rest)))
        if words[0] == "make":
            for word in words[1:]:
                var, _, value = word.partition("=")
                if var in MAKE_ARGS:
                    found.setdefault(MAKE_ARGS[var], []).append((doc, cmd, flags(tokens(value))))
    return found


HELP_SCRIPT = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for module in sys.argv[1:]:
    buffer = io.StringIO()
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(buffer):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    except BaseException:
        buffer.write(traceback.format_exc())
    out[module] = buffer.getvalue()
print(json.dumps(out))
"""


@functools.cache
def help_texts(modules: tuple[str, ...]) -> dict[str, str]:
    """Each module's --help, all in one interpreter (torch and transformers import once)."""
    proc = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *modules], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_docs_show_commands_of_every_kind():
    found = uses()
    assert {"dflash_trainer.train", "dflash_trainer.eval.cli", "dflash_trainer.regenerate",
            "dflash_trainer.bench.step"} <= set(found), sorted(found)
    assert sum(1 for _, _, words in shown_commands() if words[0] == "make") > 30


def test_every_make_target_shown_exists():
    missing = []
    for doc, cmd, words in shown_commands():
        if words[0] != "make":
            continue
        for word in words[1:]:
            if "=" not in word and not word.startswith("-") and word not in make_targets():
                missing.append(f"{doc}: `{cmd}` -> {word}")
    assert not missing, "make targets the docs show but no Makefile defines:\n" + "\n".join(missing)


@pytest.mark.slow  # starts every command the docs show
def test_every_flag_shown_is_accepted_by_its_module():
    found = uses()
    helps = help_texts(tuple(sorted(found)))
    unknown = []
    for module, shown in found.items():
        accepted = set(FLAG.findall(helps[module]))
        assert "--help" in accepted, f"{module} --help failed:\n{helps[module][-2000:]}"
        for doc, cmd, used in shown:
            unknown += [f"{doc}: `{cmd}` -> {flag} ({module})" for flag in sorted(used - accepted)]
    assert not unknown, "flags the docs show that the command does not accept:\n" + "\n".join(unknown)


def test_every_config_named_exists_and_loads():
    named = set()
    for doc, _, words in shown_commands():
        named |= {(doc, words[i + 1]) for i, w in enumerate(words[:-1]) if w == "--config"}
    assert any(name == "qwen3-8b" for _, name in named)
    for doc, name in sorted(named):
        bundled = config.CONFIG_DIR / f"{name}.toml"
        assert bundled.is_file() or (REPO / name).is_file(), f"{doc} names config {name!r}, which does not exist"
    for toml in config.CONFIG_DIR.glob("*.toml"):
        config.load_config(toml.stem)  # raises ConfigError naming the key when a bundled config falls behind


# ---- links ---------------------------------------------------------------------------------------------
def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        found.add(slug)
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc_name(doc)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{doc_name(doc)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_topic_document_starts_with_the_task_it_answers():
    for doc in DOCS[1:]:
        if doc.name == "settings.md":
            continue
        second_paragraph = doc.read_text().split("\n\n")[1]
        assert second_paragraph.startswith("**Task:"), f"{doc_name(doc)} does not start with its task"


def test_the_readme_links_every_document_and_stays_short():
    readme = (REPO / "README.md").read_text()
    for doc in DOCS[1:]:
        assert f"(docs/{doc.name})" in readme, f"README.md does not link docs/{doc.name}"
    assert len(readme.splitlines()) <= 160


# ---- generated and copied content ----------------------------------------------------------------------
def test_the_settings_reference_is_current():
    assert config_doc.main(["--check"]) == 0, "docs/settings.md is not current with config.py: run make config-doc"


def test_the_settings_reference_names_every_key():
    text = config_doc.REFERENCE.read_text()
    for f, hint, _ in config._fields(config.RunConfig):
        sections = [(f"{f.name}.", hint)] if hasattr(hint, "__dataclass_fields__") else [("", None)]
        for prefix, cls in sections:
            keys = [g.name for g, _, _ in config._fields(cls)] if cls else [f.name]
            for key in keys:
                assert f"`{prefix}{key}`" in text


def test_the_readme_inventory_settings_are_the_examples():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
    assert blocks, "the README shows no inventory settings"
    example = yaml.safe_load(EXAMPLE_SETTINGS.read_text())
    for block in blocks:
        for name, value in yaml.safe_load(block).items():
            assert example.get(name) == value, f"README shows {name}: {value!r}, the example has {example.get(name)!r}"


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "settings.md"], ids=doc_name)
def test_the_docs_speak_of_hardware_and_software_not_of_where_they_were_written(doc):
    text = doc.read_text().lower()
    # how the figures were reached (a machine's start, the tool that lent it) and issue numbers: patterns, so
    # a phrase broken across lines is caught too
    for pattern in (r"machine\s+starts?", r"device\s+tool", r"issue\s+#?\d"):
        assert not re.search(pattern, text), f"{doc_name(doc)} matches {pattern!r}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_name)
def test_every_code_fence_is_closed(doc):
    fences = [line for line in doc.read_text().splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{doc_name(doc)} has an unclosed ``` fence"
