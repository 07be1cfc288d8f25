"""Secrets only from ansible-vault or the environment (the proxmox role's inventory_secrets check): real
ansible-playbook runs over inventories on disk, with files encrypted by the real ansible-vault.

A root password in a plain group_vars file, a vault.yml never encrypted, a plain secret in host_vars or in
hosts.yml, and a template that refers to a plain variable are refused, naming the variable, the file and
the fix, before anything runs; a vaulted file, an inline !vault value and the environment pass. No value
is ever printed. No node is needed: the refusals come before any connection (127.0.0.1:1 answers nothing).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SECRETS = {name: f"s3cret-{name}-{os.urandom(6).hex()}" for name in
           ("plain", "unvaulted", "indirect", "hostvars", "inline_host", "vaulted", "inline", "env")}


def run_playbook(inventory: Path, playbook: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible" / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                    ANSIBLE_STDOUT_CALLBACK="default", ANSIBLE_CALLBACK_RESULT_FORMAT="json",
                    ANSIBLE_CALLBACK_FORMAT_PRETTY="false", ANSIBLE_HOME=str(inventory.parent / ".ansible"),
                    ANSIBLE_LOCAL_TEMP=str(inventory.parent / ".ansible-tmp"), **(env or {}))
    for key in ("PROXMOX_PASSWORD", "PROXMOX_TOKEN_ID", "PROXMOX_TOKEN_SECRET"):
        if key not in (env or {}):
            full_env.pop(key, None)
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), str(playbook), *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=300, check=False)
    for secret in SECRETS.values():
        assert secret not in proc.stdout + proc.stderr, "a secret was printed"
    return proc


def vault(*argv: str, stdin: str | None = None) -> str:
    proc = subprocess.run([str(BIN / "ansible-vault"), *argv], input=stdin, capture_output=True, text=True,
                          timeout=60, check=True)
    return proc.stdout


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """One inventory, one container per case, each in its own group (its own group_vars)."""
    root = tmp_path_factory.mktemp("secrets") / "inventory" / "site"
    password_file = write(root.parent.parent / "vault-pass", "correct horse battery staple\n")
    gv = root / "group_vars"
    write(gv / "plain" / "proxmox.yml", f"proxmox_api_password: {SECRETS['plain']}\nproxmox_lxc_cores: 4\n")
    write(gv / "unvaulted" / "vault.yml", f"vault_proxmox_api_password: {SECRETS['unvaulted']}\n")
    write(gv / "indirect" / "proxmox.yml",
          f'proxmox_api_password: "{{{{ site_root_pw }}}}"\nsite_root_pw: {SECRETS["indirect"]}\n')
    write(root / "host_vars" / "ct_hostvars.yml", f"proxmox_api_token_secret: {SECRETS['hostvars']}\n")
    vaulted = write(gv / "vaulted" / "vault.yml", f"vault_proxmox_api_password: {SECRETS['vaulted']}\n")
    vault("encrypt", "--vault-password-file", str(password_file), str(vaulted))
    inline = vault("encrypt_string", "--vault-password-file", str(password_file), "--name", "proxmox_api_password",
                   SECRETS["inline"])
    write(gv / "inline" / "proxmox.yml", inline)
    groups = {name: {"hosts": {f"ct_{name}": {"proxmox_lxc_vmid": 9900 + i, "proxmox_lxc_hostname": f"ct-{i}"}}}
              for i, name in enumerate(("plain", "unvaulted", "indirect", "hostvars", "vaulted", "inline", "env"))}
    inv = write(root / "hosts.yml", inventory_text(groups))
    # a plain secret in the inventory file itself concerns every host of it: a second inventory
    other = write(root.parent / "other" / "hosts.yml", inventory_text({"inline_host": {"hosts": {"ct_inline_host": {
        "proxmox_lxc_vmid": 9990, "proxmox_lxc_hostname": "ct-x", "proxmox_lxc_password": SECRETS["inline_host"]}}}}))
    return {"root": root, "inventory": inv, "other": other, "password_file": password_file}


def inventory_text(groups: dict) -> str:
    return yaml.safe_dump({"all": {
        "vars": {"proxmox_api_host": "127.0.0.1", "proxmox_api_port": 1, "proxmox_node": "pve",
                 "proxmox_template_src": "", "proxmox_lxc_template": "local:vztmpl/none.tar.zst"},
        "children": {"dflash_containers": {"children": groups}}}})


def results(proc) -> dict[str, dict]:
    """The result of the secrets task per host (failed or ok), from the one-line JSON results."""
    out = {}
    section = proc.stdout.split("TASK [proxmox : Refuse secrets kept in plain files", 1)[1].split("\nTASK [", 1)[0]
    for m in re.finditer(r"^(fatal|ok): \[([^\]]+)\](?:: FAILED!)?(?: => (\{.*\}))?$", section, re.MULTILINE):
        out[m.group(2)] = dict(json.loads(m.group(3) or "{}"), refused=m.group(1) == "fatal")
    return out


@pytest.fixture(scope="module")
def checked(site, tmp_path_factory):
    """The proxmox role (what both playbooks import first) over every case, in one run."""
    play = write(tmp_path_factory.mktemp("play") / "play.yml", yaml.safe_dump([{
        "hosts": "dflash_containers", "connection": "local", "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable},
        "roles": ["proxmox"]}]))
    by_host = {}
    for inventory in (site["inventory"], site["other"]):
        proc = run_playbook(inventory, play, "--vault-password-file", str(site["password_file"]),
                            env={"PROXMOX_PASSWORD": SECRETS["env"]})
        by_host.update(results(proc))
    return proc, by_host


@pytest.mark.parametrize("host, variable, file, fix", [
    ("ct_plain", "proxmox_api_password", "group_vars/plain/proxmox.yml", "or delete it and export PROXMOX_PASSWORD"),
    ("ct_indirect", "proxmox_api_password has the value of site_root_pw", "group_vars/indirect/proxmox.yml",
     "ansible-vault encrypt"),
    ("ct_hostvars", "proxmox_api_token_secret", "host_vars/ct_hostvars.yml", "export PROXMOX_TOKEN_SECRET"),
    ("ct_inline_host", "proxmox_lxc_password", "../other/hosts.yml", "ansible-vault encrypt_string --name proxmox_lxc_password"),
])
def test_plain_secret_is_refused_naming_variable_file_and_fix(checked, site, host, variable, file, fix):
    _, by_host = checked
    result = by_host[host]
    assert result["refused"], result
    msg = result["msg"]
    assert variable in msg and os.path.normpath(site["root"] / file) in msg and fix in msg, msg
    assert "nothing was changed" in msg


def test_unencrypted_vault_file_is_refused(checked, site):
    _, by_host = checked
    assert by_host["ct_unvaulted"]["refused"]
    msg = by_host["ct_unvaulted"]["msg"]
    path = site["root"] / "group_vars/unvaulted/vault.yml"
    assert f"{path} is not encrypted, yet it holds vault_proxmox_api_password" in msg
    assert f"ansible-vault encrypt {path}" in msg


@pytest.mark.parametrize("host", ["ct_vaulted", "ct_inline", "ct_env"])
def test_vault_and_environment_pass(checked, host):
    _, by_host = checked
    assert not by_host[host]["refused"], by_host[host]


def test_the_playbooks_refuse_before_anything_else(site):
    """provision.yml and training.yml (make provision / make deploy) stop at the secrets check, for every
    container: not one module ran, not even a read (127.0.0.1:1 would have said 'cannot reach')."""
    for playbook, extra in (("provision.yml", ()), ("training.yml", ("-e", "training_run_action=deploy"))):
        proc = run_playbook(site["inventory"], REPO / "ansible" / playbook, "--vault-password-file",
                            str(site["password_file"]), *extra, env={"PROXMOX_PASSWORD": SECRETS["env"]})
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert "proxmox_api_password is plain text in" in out
        assert "cannot reach" not in out and "TASK [proxmox_template" not in out and "TASK [training_run" not in out
        assert re.search(r"^ct_vaulted\s+: ok=\d+ .*failed=0", proc.stdout, re.MULTILINE)  # stopped, not failed
