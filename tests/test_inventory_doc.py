"""The settings' documentation (inventory/example/group_vars/all/proxmox.yml) is generated from the roles'
meta/argument_specs.yml and defaults/main.yml by `make inventory-doc`: it is current, it names every
setting of every role, and the specs agree with the defaults they document."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("inventory_doc", REPO / "ansible" / "inventory_doc.py")
doc = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(doc)


def test_example_settings_file_is_current():
    proc = subprocess.run(["make", "--no-print-directory", "-s", "-o", ".venv/.installed", "inventory-doc",
                           f"INVENTORY_DOC={doc.EXAMPLE}", "PY=" + str(Path(__import__("sys").executable))],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "", f"make inventory-doc changed the example: {proc.stdout}; commit the result"
    assert doc.main(["--check", str(doc.EXAMPLE)]) == 0


def test_every_role_is_documented():
    roles = {p.parent.parent.name for p in (REPO / "ansible" / "roles").glob("*/meta/argument_specs.yml")}
    assert roles == set(doc.ROLES)
    assert {p.name for p in (REPO / "ansible" / "roles").iterdir() if p.is_dir()} == roles  # each has specs


def test_every_setting_of_every_role_is_in_the_example():
    text = doc.EXAMPLE.read_text()
    named = set(re.findall(r"^(?:# )?([a-z][a-z0-9_]*):", text, re.MULTILINE))
    for role in doc.ROLES:
        missing = (set(doc.role_options(role)) | set(doc.role_defaults(role))) - named
        assert not missing, (role, missing)
    # among them the ones the README tells users to set
    assert {"proxmox_lxc_reboot_for_pending", "training_venv_on_drift", "training_run_require_mount"} <= named


@pytest.mark.parametrize("role", doc.ROLES)
def test_specs_agree_with_the_defaults(role):
    options, defaults = doc.role_options(role), doc.role_defaults(role)
    undocumented = set(defaults) - set(options)
    assert not undocumented, f"{role}: defaults without an argument spec (so without a description): {undocumented}"
    for name, spec in options.items():
        assert str(spec.get("description", "")).strip(), f"{role}: {name} has no description"
        if "default" in spec and name in defaults:
            assert spec["default"] == defaults[name], (role, name, spec["default"], defaults[name])


def test_a_setting_no_role_reads_is_refused(tmp_path):
    wrong = tmp_path / "proxmox.yml"
    wrong.write_text(yaml.safe_dump({"proxmox_lxc_core": 4, "proxmox_lxc_cores": 4}))
    assert doc.main([str(wrong)]) == 2
    assert wrong.read_text() == yaml.safe_dump({"proxmox_lxc_core": 4, "proxmox_lxc_cores": 4})  # untouched
    with pytest.raises(doc.DocError, match="proxmox_lxc_core: not a setting of any role"):
        doc.render({"proxmox_lxc_core": 4})


def test_regenerating_keeps_values_and_fills_in_the_rest(tmp_path):
    mine = tmp_path / "proxmox.yml"
    mine.write_text("proxmox_lxc_cores: 16\ntraining_run_settings:\n  train: {steps: 10}\n")
    assert doc.main([str(mine)]) == 0
    values = yaml.safe_load(mine.read_text())
    assert values == {"proxmox_lxc_cores": 16, "training_run_settings": {"train": {"steps": 10}}}
    assert "# proxmox_lxc_memory: 65536" in mine.read_text()  # a default, commented out
    assert doc.main(["--check", str(mine)]) == 0
