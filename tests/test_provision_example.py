"""The example inventory as a user keeps it: `make provision`, then `make deploy` and `make doctor`, with
inventory/example/group_vars/all/proxmox.yml as shipped and every role default; only the node's file
(group_vars/<node>/: its API and SSH address, its root-disk storage) and hosts.yml (one container) are the
site's own. The venv path, the run root, the template and the trainer come from the defaults alone, so a
default that one role changes and another does not follow breaks this test.

What differs from a real site, said plainly:
- the frozen template is a stand-in (build_frozen_template of tests/helpers/frozen.py: the python test
  template with /opt/venv built from the stand-in lock by the image stage's own rebuild command), put where
  `make image` writes it under the name image/build.py gives it;
- the node is the PVE test host: one node, storage `local`, two stand-in GPUs, NVIDIA's stand-in installer
  in /root (where the nvidia_userspace role looks by default).
"""
from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.deploy import make_with, venv_inputs
from tests.helpers.frozen import build_frozen_template
from tests.helpers.provision import REPO, failure_text, recap

pytest_plugins = ["tests.image_standins"]
pytestmark = [pytest.mark.lxc, pytest.mark.slow]

VMID = 9401
EXAMPLE = REPO / "inventory" / "example"


def frozen_template_name(standins) -> str:
    """What `make image` calls the template of this lock and trainer wheel (image/build.py)."""
    from dflash_image import build, rootfs, template

    version = standins.trainer_wheel.name.split("-")[1]
    return template.template_name(rootfs.load_config()["release"], version, build.lock_digest(standins.project))


class Site:
    """A copy of inventory/example in <tmp>/inventory/site, the repository's layout (build/image beside it)."""

    def __init__(self, host, root: Path):
        self.host, self.root = host, root
        self.dir = root / "inventory" / "site"
        (self.dir / "group_vars").mkdir(parents=True)
        shutil.copytree(EXAMPLE / "group_vars" / "all", self.dir / "group_vars" / "all")  # as shipped
        node = {"proxmox_api_host": host.api_host, "proxmox_api_port": host.api_port, "proxmox_node": host.node,
                "proxmox_ssh_host": host.api_host, "proxmox_ssh_port": host.ssh_port, "proxmox_ssh_user": host.ssh_user,
                "proxmox_ssh_private_key": host.ssh_key,
                "proxmox_ssh_options": ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"],
                "proxmox_lxc_storage": host.storage}
        (self.dir / "group_vars" / "testpve").mkdir()
        (self.dir / "group_vars" / "testpve" / "proxmox.yml").write_text("---\n" + yaml.safe_dump(node))
        hosts = {"all": {"children": {"dflash_containers": {"children": {"testpve": {"hosts": {
            f"trainer{VMID}": {"proxmox_lxc_vmid": VMID, "proxmox_lxc_hostname": f"trainer{VMID}"}}}}}}}}
        (self.dir / "hosts.yml").write_text("---\n" + yaml.safe_dump(hosts))
        shutil.copy2(host.ca_cert, self.dir / "pve-root-ca.pem")  # as the README says: the node's CA, copied here
        self.image_out = root / "build" / "image"  # {{ inventory_dir }}/../../build/image, as in the repository

    def make(self, *targets: str, timeout: int = 600) -> subprocess.CompletedProcess:
        return make_with(self.host, self.dir / "hosts.yml", self.root, *targets, timeout=timeout)


@pytest.fixture(scope="module")
def site(pve_host, tmp_path_factory, standins, stocked_wheelhouse):
    root = tmp_path_factory.mktemp("example")
    s = Site(pve_host, root)
    built = build_frozen_template(root / "frozen", venv_inputs(standins, stocked_wheelhouse))
    s.image_out.mkdir(parents=True)
    shutil.move(built, s.image_out / frozen_template_name(standins))
    yield s
    if pve_host.container_exists(VMID):
        pve_host.ssh(f"pct stop {VMID}; pct destroy {VMID}")


def test_provision_then_deploy_with_the_example_defaults(site, standins):
    host = site.host
    assert filecmp.cmp(site.dir / "group_vars/all/proxmox.yml", EXAMPLE / "group_vars/all/proxmox.yml", shallow=False)

    # ---- make provision: the template from build/image, the container, its GPUs, the userspace, the doctor
    proc = site.make("provision")
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    template = frozen_template_name(standins)
    uploads = [c for c in host.calls() if c["path"].endswith("/upload")]
    assert [u["params"].get("filename") for u in uploads][-1:] == [template], uploads
    conf = host.pve_conf(VMID).read_text()
    assert "memory: 262144" in conf and "cores: 32" in conf and "dev0: /dev/nvidia0" in conf  # the example's
    assert "TASK [training_venv : Run the drift doctor]" in proc.stdout and "rebuild.yml" not in proc.stdout
    doctor = host.exec_in_container(VMID, ["/opt/venv/bin/python", "-m", "dflash_image.doctor"])
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr  # the venv the frozen template has, clean

    # ---- make deploy: the same venv, found by the defaults; the run under the default run root
    proc = site.make("deploy")
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    run_toml = host.exec_in_container(VMID, ["cat", "/srv/dflash/runs/default/run.toml"])
    assert run_toml.returncode == 0, run_toml.stderr
    assert 'path = "/srv/dflash/models/Qwen3-8B"' in run_toml.stdout
    assert 'compile_cache_dir = "/srv/dflash/compile-cache"' in run_toml.stdout
    assert "steps = 20000" in run_toml.stdout
    assert site.make("doctor").returncode == 0

    # ---- a second provision and deploy change nothing
    again = site.make("provision")
    assert again.returncode == 0 and all(r["changed"] == 0 for r in recap(again).values()), failure_text(again)[-4000:]
    again = site.make("deploy")
    assert again.returncode == 0 and "changed=0" in again.stdout, failure_text(again)[-4000:]
