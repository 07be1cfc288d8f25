"""Functions a reader can hold in their head: at most 60 lines each, in every shipped module and the test
host (ruff's C901 rule, with no file exempt, bounds their branches; test functions may tell a longer story)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [ROOT / "dflash", ROOT / "image", ROOT / "ansible" / "collections", ROOT / "tests" / "pve_testhost"]
MAX_LINES = 60


def long_functions(paths: list[Path], root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    found = []
    for top in paths:
        for path in sorted(top.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_is_longer_than_60_lines():
    found = long_functions(CHECKED)
    assert not found, f"split these into named steps (<= {MAX_LINES} lines each):\n" + "\n".join(found)


def test_no_file_is_exempt_from_the_complexity_rule():
    import tomllib

    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C901" in lint["extend-select"]
    exempt = [f for f, rules in lint.get("per-file-ignores", {}).items() if "C901" in rules]
    assert not exempt, f"files exempt from the complexity rule: {exempt}"


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    found = long_functions([tmp_path], root=tmp_path)
    assert len(found) == 1 and "long: 61 lines" in found[0]
