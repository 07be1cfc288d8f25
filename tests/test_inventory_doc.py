"""The settings' documentation (inventory/example/group_vars/all/proxmox.yml) is generated from the roles'
meta/argument_specs.yml and defaults/main.yml by `make inventory-doc`: it is current, it names every
setting of every role, and the specs agree with the defaults they document."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("inventory_doc", REPO / "ansible" / "inventory_doc.py")
doc = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(doc)


def test_example_settings_file_is_current(tmp_path):
    # on a copy: a stale example is reported, not rewritten in the checkout (the next run would then pass)
    copy = tmp_path / "proxmox.yml"
    shutil.copyfile(doc.EXAMPLE, copy)
    proc = subprocess.run(["make", "--no-print-directory", "-s", "-o", ".venv/.installed", "inventory-doc",
                           f"INVENTORY_DOC={copy}", "PY=" + str(Path(sys.executable))],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "", f"make inventory-doc changed the example: {proc.stdout}; commit the result"
    assert copy.read_text() == doc.EXAMPLE.read_text()
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


# ---- bad input: a clear message, no traceback, nothing written ----------------------------------------
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path, capsys):
    wrong = tmp_path / "proxmox.yml"
    wrong.write_text("- proxmox_lxc_cores: 4\n")
    assert doc.main([str(wrong)]) == 2
    assert "its top level is a list, not a mapping of setting: value" in capsys.readouterr().err
    assert wrong.read_text() == "- proxmox_lxc_cores: 4\n"
    with pytest.raises(doc.DocError, match="top level is a str"):
        doc.read_values("just a sentence")


def test_an_output_folder_that_does_not_exist_is_named(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "proxmox.yml"
    assert doc.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {missing}" in err and f"create its folder ({missing.parent})" in err
    assert not missing.parent.exists()


def test_inline_vault_values_are_kept_tagged(tmp_path):
    ciphertext = ("$ANSIBLE_VAULT;1.1;AES256\n"
                  "62313365396662343061393464336163383764373764613633653634306231386433626436623361\n"
                  "6134333665353966363534333632666535333761666131620a663537646436643936616236353362\n")
    mine = tmp_path / "proxmox.yml"
    mine.write_text("proxmox_api_password: !vault |\n" + "".join("  " + line + "\n" for line in ciphertext.splitlines())
                    + "proxmox_lxc_cores: 16\n")
    assert doc.main([str(mine)]) == 0
    text = mine.read_text()
    assert "proxmox_api_password: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n" in text
    values = doc.read_values(text)
    assert values == {"proxmox_api_password": ciphertext, "proxmox_lxc_cores": 16}
    assert isinstance(values["proxmox_api_password"], doc.Vaulted)
    assert doc.main(["--check", str(mine)]) == 0
    # Ansible's own loader reads it back as the same vaulted value
    from ansible.parsing.vault import EncryptedString
    from ansible.parsing.yaml.loader import AnsibleLoader
    loaded = AnsibleLoader(text).get_single_data()["proxmox_api_password"]
    assert isinstance(loaded, EncryptedString) and loaded._ciphertext == ciphertext
