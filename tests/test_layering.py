"""The trainer's import graph follows the layers docs/architecture.md draws, and has no loop.

Every import counts: at module level, inside functions, and under TYPE_CHECKING (a lazy import is still a
dependency; hiding a loop inside a function only delays it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash" / "dflash_trainer"
DESIGN_NOTE = ROOT / "docs" / "architecture.md"


def layers() -> list[str]:
    """The fenced block after the "## Layers" heading: one unit per line, lowest first."""
    text = DESIGN_NOTE.read_text()
    block = re.search(r"^## Layers\n.*?```text\n(.*?)```", text, re.DOTALL | re.MULTILINE)
    assert block, f"{DESIGN_NOTE}: no '## Layers' section with a ```text block of units"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports (relative or absolute), anywhere in the file."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if name else []
    package = here if is_package else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module and node.module.split(".")[0] == "dflash_trainer":
                target = node.module.removeprefix("dflash_trainer").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dflash_trainer":
                    found.add(alias.name.removeprefix("dflash_trainer").lstrip("."))
    return {m for m in found if m in known and m != name}


def unit_of(module: str, units: list[str]) -> str:
    for unit in units:
        if unit.endswith("/") and (module == unit[:-1] or module.startswith(unit[:-1] + ".")):
            return unit
        if unit.endswith(".py") and module == unit[:-3]:
            return unit
    return ""


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def test_every_module_sits_in_one_layer():
    units = layers()
    homeless = sorted(m for m in modules() if m and not unit_of(m, units))
    assert not homeless, f"modules in no layer of {DESIGN_NOTE.name}'s '## Layers': {homeless}"


def test_imports_go_down_the_layers_only():
    units = layers()
    rank = {unit: i for i, unit in enumerate(units)}
    upward = []
    for importer, targets in graph().items():
        if not importer:
            continue
        mine = unit_of(importer, units)
        for target in targets:
            theirs = unit_of(target, units)
            if theirs != mine and rank[theirs] >= rank[mine]:
                upward.append(f"{importer} ({mine}) imports {target} ({theirs})")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_loop_hidden_or_not():
    cycle = find_cycle(graph())
    assert cycle is None, "import loop: " + " -> ".join(cycle)


@pytest.mark.parametrize("edges,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"a2"}, "a2": set(), "x": {"y"}, "y": {"x"}}, ["x", "y", "x"]),
])
def test_the_loop_finder_finds_loops(edges, expected):
    assert find_cycle(edges) == expected


def test_the_wheel_ships_every_subpackage():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {"dflash_trainer" + "".join("." + part for part in p.parent.relative_to(PACKAGE).parts)
               for p in PACKAGE.rglob("__init__.py")}
    assert present <= listed, f"pyproject.toml's [tool.setuptools] packages lacks {sorted(present - listed)}"
