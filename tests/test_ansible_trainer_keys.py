"""The Ansible side names trainer settings (the run.toml the training_run role renders, training_run_settings in
the role defaults and the inventories, section.key in their comments and argument specs): every one of them is a
key of the run config, so a renamed or removed key fails here rather than at a deploy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from dflash_trainer.config import RunConfig, setting

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "ansible/roles/training_run/templates/run.toml.j2"
VARIABLE_FILES = sorted([*ROOT.glob("ansible/roles/*/defaults/*.yml"), *ROOT.glob("ansible/roles/*/meta/*.yml"),
                         *ROOT.glob("inventory/*/group_vars/**/*.yml")])
SECTIONS = tuple(name for name, value in RunConfig().to_dict().items() if isinstance(value, dict))
# section.key written in prose; a file name such as eval.json or train.jsonl is no key
DOTTED = re.compile(rf"\b(?:{'|'.join(SECTIONS)})\.[a-z_]+\b(?![.\w/-])")
FILE_SUFFIXES = {"json", "jsonl", "png", "toml", "yml", "yaml", "py"}


def is_key(dotted: str) -> bool:
    try:
        setting(dotted)
    except KeyError:
        return False
    return True


def template_keys(text: str) -> list[str]:
    """The keys the template writes by name: `key = {{ ... }}` under a literal [section] (loops over
    training_run_settings write what the inventory holds, checked below)."""
    keys, section = [], ""
    for line in text.splitlines():
        if match := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section = match.group(1) + "."
        elif match := re.match(r"(\w+) = \{\{", line):
            keys.append(section + match.group(1))
    return keys


def settings_keys(values: dict, prefix: str = "") -> list[str]:
    """The dotted leaves of a training_run_settings mapping."""
    keys = []
    for name, value in (values or {}).items():
        keys += settings_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [prefix + name]
    return keys


def test_the_template_writes_only_run_config_keys():
    keys = template_keys(TEMPLATE.read_text())
    assert {"output_dir", "target.path", "parallel.target_ranks", "data.train", "train.compile_cache_dir"} <= set(keys)
    assert [key for key in keys if not is_key(key)] == [], f"{TEMPLATE}: rename these to the run config's keys"


@pytest.mark.parametrize("path", VARIABLE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_training_run_settings_name_run_config_keys(path):
    values = yaml.safe_load(path.read_text()) or {}
    settings = values.get("training_run_settings") if isinstance(values, dict) else None
    unknown = [key for key in settings_keys(settings) if not is_key(key)] if isinstance(settings, dict) else []
    assert unknown == [], f"{path}: training_run_settings names {unknown}, which the run config lacks"


@pytest.mark.parametrize("path", [*VARIABLE_FILES, TEMPLATE], ids=lambda p: str(p.relative_to(ROOT)))
def test_keys_named_in_comments_and_specs_exist(path):
    named = {m for m in DOTTED.findall(path.read_text()) if m.rsplit(".", 1)[1] not in FILE_SUFFIXES}
    assert sorted(key for key in named if not is_key(key)) == [], f"{path}: these keys are not in the run config"


def test_a_renamed_key_is_caught():
    assert template_keys("[train]\nstepz = {{ value(x) }}\n") == ["train.stepz"] and not is_key("train.stepz")
    assert settings_keys({"train": {"steps": 1, "lrr": 2}}) == ["train.steps", "train.lrr"] and not is_key("train.lrr")
    assert DOTTED.findall("see data.features_dirs (not eval.json)") == ["data.features_dirs", "eval.json"]
