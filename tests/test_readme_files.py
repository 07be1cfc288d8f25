"""The architecture tour's trainer file list (docs/architecture.md) matches the tree: every module of
dflash_trainer (and of regenerate/) is named, and every file it names exists."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "dflash" / "dflash_trainer"


def readme_file_list() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## The trainer, file by file")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_names_every_trainer_module_and_only_those():
    """Each row names a folder (or "(top)") and its files; every module is named under its folder."""
    named = set()
    for row in readme_file_list().splitlines():
        cells = row.split("|")
        if len(cells) < 4 or cells[1].strip() in ("folder", "---"):
            continue
        folder = cells[1].strip().strip("`")
        prefix = "" if folder == "(top)" else folder
        named |= {prefix + name for name in re.findall(r"`([a-z0-9_]+\.py|[a-z0-9_]+/)`", cells[2])}
        if prefix:
            named.add(prefix)
    modules = {str(p.relative_to(TRAINER)) for p in TRAINER.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    folders = {str(p.relative_to(TRAINER)) + "/" for p in TRAINER.rglob("*")
               if p.is_dir() and not p.name.startswith("__") and (p.parent == TRAINER or any(p.glob("*.py")))}
    missing = (modules | folders) - named
    assert not missing, f"docs/architecture.md's trainer file list lacks {sorted(missing)}"
    unknown = named - modules - folders
    assert not unknown, f"docs/architecture.md's trainer file list names files that are not there: {sorted(unknown)}"
