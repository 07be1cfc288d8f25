"""Static checks of the provisioning stage: ansible-lint (production profile), module documentation,
and the example inventory resolving per-node settings for several nodes and containers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible" / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
           PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
MODULES = ["pve_lxc", "pve_template", "pve_host_facts", "pve_lxc_raw", "pve_pct_exec", "pve_lxc_power"]


def test_ansible_lint_production_profile_is_clean():
    proc = subprocess.run([str(BIN / "ansible-lint"), "--profile", "production", "provision.yml", "roles"],
                          cwd=REPO / "ansible", env=ENV, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr


def test_every_module_documents_its_options():
    proc = subprocess.run([str(BIN / "ansible-doc"), "--json"] + [f"dflash.proxmox.{m}" for m in MODULES],
                          env=ENV, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    for m in MODULES:
        doc = docs[f"dflash.proxmox.{m}"]["doc"]
        assert "api_host" in doc["options"] and "ssh_host" in doc["options"]  # the shared fragment
    assert "devices" in docs["dflash.proxmox.pve_lxc"]["doc"]["options"]


def test_example_inventory_resolves_each_node_and_container():
    def host(name):
        proc = subprocess.run([str(BIN / "ansible-inventory"), "-i", str(REPO / "inventory/example/hosts.yml"),
                               "--host", name], env=dict(ENV, PROXMOX_PASSWORD=""), capture_output=True,
                              text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    t1, t2, t3 = host("trainer1"), host("trainer2"), host("trainer3")
    assert (t1["proxmox_node"], t1["proxmox_lxc_vmid"], t1["proxmox_gpu_devices"]) == ("pve1", 200, [0, 1, 2, 3])
    assert (t2["proxmox_node"], t2["proxmox_lxc_vmid"]) == ("pve1", 201)
    assert (t3["proxmox_node"], t3["proxmox_api_host"], t3["proxmox_gpu_method"]) == ("pve2", "pve2.example.org", "raw")
    assert t1.get("proxmox_gpu_method") == "dev"
    # secrets are references to the vault or the environment, never values in the inventory
    assert "vault_proxmox_api_password" in t1["proxmox_api_password"]
