"""Nothing is written before every input of every container is checked: real `ansible/provision.yml` runs
against the Proxmox VE test host with bad inventories. The host's recorded write calls (PveHost.calls()),
its container configs and its template storage are compared before and after each run: no change. Every
run names a template the node does not have yet, so a check that came after the upload would show as a
write; a last run of the same inventory made good (its password from a real ansible-vault file) shows the
writes this comparison sees.

Containers use vmids 92xx so they never collide with other tests on the same test host.
"""
from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.provision import Provision, api_writes, failure_text
from tests.pve_testhost.templates import build_test_template

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

OWNER, NEW, OTHER = 9201, 9202, 9203
NAMES = itertools.count()


def snapshot(host) -> dict:
    """What a write would change on the node: container configs (raw lines too) and stored templates."""
    state = Path(host.state_dir)
    return {"confs": {p.name: p.read_text() for p in sorted((state / "pve" / "lxc").glob("*.conf"))},
            "templates": sorted(p.name for p in (state / "vz" / "template" / "cache").glob("*")),
            "writes": api_writes(host)}


def container(vmid: int, hostname: str | None = None, **host_vars) -> dict:
    return {f"ct{vmid}": {"proxmox_lxc_vmid": vmid, "proxmox_lxc_hostname": hostname or f"ct{vmid}",
                          "proxmox_gpu_devices": [0], **host_vars}}


class Preflight:
    def __init__(self, prov: Provision, work: Path):
        self.prov, self.work = prov, work

    def fresh_template(self) -> Path:
        """The test template under a name the node does not have: a late check would upload it."""
        path = self.work / f"debian-12-preflight{next(NAMES)}_1.0-1_amd64.tar.zst"
        shutil.copyfile(self.prov.template, path)
        return path

    def inventory(self, containers: dict, files: dict[str, str] | None = None, **group_vars) -> Path:
        """The test host's inventory with a fresh template; `files` (group_vars/..., host_vars/...) beside it."""
        inv = self.prov.inventory(containers, **{"proxmox_template_src": str(self.fresh_template()), **group_vars})
        site = self.work / f"site{next(NAMES)}"
        site.mkdir()
        for rel, text in (files or {}).items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(text)
        return Path(shutil.move(inv, site / "hosts.json"))


@pytest.fixture(scope="module")
def pre(pve_host, tmp_path_factory):
    work = tmp_path_factory.mktemp("preflight")
    prov = Provision(pve_host, work, build_test_template())
    proc = prov.run(prov.inventory(container(OWNER)))  # a container that owns its vmid
    assert proc.returncode == 0, failure_text(proc)[-4000:]
    yield Preflight(prov, work)
    for vmid in (OWNER, NEW, OTHER):
        if pve_host.container_exists(vmid):
            pve_host.ssh(f"pct stop {vmid}; pct destroy {vmid}")


# (case, containers, group vars, files beside the inventory, run options, what the refusal says)
BAD = [
    ("gpu-index", container(NEW, proxmox_gpu_devices=[0, 7]), {}, {}, {},
     "GPU(s) [7] not found on the host (it has /dev/nvidia minors [0, 1]); fix proxmox_gpu_devices"),
    ("vmid-owned", container(OWNER, "intruder"), {}, {}, {},
     f"vmid {OWNER} is already used by container 'ct{OWNER}'"),
    # every setting of the wrong type or outside its choices, all named in one message
    ("types-choices", container(NEW, proxmox_lxc_cores="four"), {"proxmox_lxc_state": "running"}, {}, {},
     ("argument 'proxmox_lxc_cores' is of type str and we were unable to convert to int: \"'four'\" cannot be "
      "converted to an int\n- value of proxmox_lxc_state must be one of: started, present, stopped, restarted")),
    ("vmid-range", container(42), {}, {}, {}, "vmid '42' is out of range"),
    ("template-file", container(NEW), {"proxmox_template_src": "/nonexistent/debian-13-x_1_amd64.tar.zst"}, {}, {},
     "template file /nonexistent/debian-13-x_1_amd64.tar.zst does not exist on the controller"),
    ("storage", container(NEW), {"proxmox_lxc_storage": "nosuchstore"}, {}, {},
     "storage 'nosuchstore' does not exist on node pve"),
    ("token-dev", container(NEW), {}, {}, {"token": True, "password": False},
     "can only be set by root@pam with a password (ticket) login"),
    ("installer", container(NEW), {"nvidia_userspace_installer_dir": "/nonexistent-installers"}, {}, {},
     "/nonexistent-installers/NVIDIA-Linux-x86_64-580.95.05.run is missing on the controller"),
    ("rebuild-inputs", container(NEW), {"training_venv_enabled": True, "training_venv_lock_dir": "/nonexistent-lock"},
     {}, {}, "training_venv_lock_dir is set, so the rebuild also needs training_venv_wheelhouse"),
    ("plain-password", container(NEW), {}, {"group_vars/all/proxmox.yml": "proxmox_api_password: hunter2-plain\n"}, {},
     "proxmox_api_password is plain text in"),
    ("unencrypted-vault", container(NEW), {}, {"group_vars/all/vault.yml": "vault_proxmox_api_password: hunter2-vault\n"},
     {}, "vault.yml is not encrypted, yet it holds vault_proxmox_api_password"),
    # one good container beside a bad one: the good one is not touched either
    ("one-of-two", {**container(NEW), **container(OTHER, proxmox_gpu_devices=[9])}, {}, {}, {},
     "GPU(s) [9] not found on the host"),
]


@pytest.mark.parametrize("case, containers, group_vars, files, options, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_inventory_changes_nothing(pre, case, containers, group_vars, files, options, needle):
    host = pre.prov.host
    inv = pre.inventory(containers, files, **group_vars)
    host.reset_calls()
    before = snapshot(host)
    proc = pre.prov.run(inv, **options)
    text = failure_text(proc)
    assert proc.returncode != 0, text[-4000:]
    assert needle in text, (needle, text[-4000:])
    assert "Traceback" not in text and "hunter2" not in text
    assert snapshot(host) == before, text[-3000:]
    assert before["writes"] == []
    assert not host.container_exists(NEW) and not host.container_exists(OTHER)


def test_the_same_inventory_made_good_writes_and_the_vault_is_read(pre, tmp_path):
    """The control: what the comparison above sees when the checks pass (upload, create, start), with the
    root password from a real ansible-vault file and nothing in the environment."""
    host = pre.prov.host
    password_file = tmp_path / "vault-pass"
    password_file.write_text("correct horse battery staple\n")
    inv = pre.inventory(container(NEW), {"group_vars/all/vault.yml": yaml.safe_dump(
        {"vault_proxmox_api_password": host.root_password})})
    vault_file = inv.parent / "group_vars" / "all" / "vault.yml"
    subprocess.run([str(Path(sys.executable).parent / "ansible-vault"), "encrypt", "--vault-password-file",
                    str(password_file), str(vault_file)], check=True, capture_output=True)
    host.reset_calls()
    before = snapshot(host)
    proc = pre.prov.run(inv, "--vault-password-file", str(password_file), password=False)
    assert proc.returncode == 0, failure_text(proc)[-4000:]
    after = snapshot(host)
    assert after != before and host.container_exists(NEW)
    paths = [c["path"] for c in after["writes"]]
    assert paths[0].endswith("/upload") and "/nodes/pve/lxc" in paths  # the template first, then the create
