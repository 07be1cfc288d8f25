"""The architecture tour's trainer file list (docs/architecture.md) matches the tree: every module of
dflash_trainer (and of regenerate/) is named, and every file it names exists."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "dflash" / "dflash_trainer"


def readme_file_list() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("One file per concept")
    return text[start:text.index("\n## ", start)]


def test_the_readme_names_every_trainer_module_and_only_those():
    named = set(re.findall(r"`([a-z0-9_]+\.py|[a-z0-9_]+/)`", readme_file_list()))
    modules = {p.name for p in TRAINER.glob("*.py") if p.name != "__init__.py"}
    folders = {p.name + "/" for p in TRAINER.iterdir() if p.is_dir() and not p.name.startswith("__")}
    regenerate = {p.name for p in (TRAINER / "regenerate").glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    missing = (modules | folders | regenerate) - named
    assert not missing, f"docs/architecture.md's trainer file list lacks {sorted(missing)}"
    unknown = named - modules - folders - regenerate
    assert not unknown, f"docs/architecture.md's trainer file list names files that are not there: {sorted(unknown)}"
