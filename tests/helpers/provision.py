"""Provisioning tests' helpers: an inventory for the PVE test host, `ansible-playbook ansible/provision.yml`
with it (secrets from the environment, as a user keeps them), and readers of its output."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.pve_testhost.hostns import STANDIN_DRIVER as DRIVER
from tests.pve_testhost.hostns import standin_installer

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
PLAYBOOK = ANSIBLE_DIR / "provision.yml"


class Provision:
    """Writes an inventory for the test host and runs ansible-playbook with it."""

    def __init__(self, host, workdir: Path, template: Path):
        self.host = host
        self.workdir = workdir
        self.template = template
        self.installer_dir = workdir / "nvidia"
        self.installer_dir.mkdir(exist_ok=True)
        run = self.installer_dir / f"NVIDIA-Linux-x86_64-{DRIVER}.run"
        run.write_text(standin_installer(DRIVER))
        run.chmod(0o755)

    def inventory(self, containers: dict, **group_vars) -> Path:
        h = self.host
        base = {
            "proxmox_api_host": h.api_host, "proxmox_api_port": h.api_port, "proxmox_node": h.node,
            # secrets: none here; the proxmox role's defaults read them from the environment (see run())
            "proxmox_api_ca_path": h.ca_cert, "proxmox_api_user": "root@pam",
            "proxmox_ssh_host": h.api_host, "proxmox_ssh_port": h.ssh_port, "proxmox_ssh_user": h.ssh_user,
            "proxmox_ssh_private_key": h.ssh_key,
            "proxmox_ssh_options": ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"],
            "proxmox_task_timeout": 120,
            "proxmox_template_src": str(self.template), "proxmox_template_storage": h.storage,
            "proxmox_lxc_storage": h.storage, "proxmox_lxc_disk_gb": 1, "proxmox_lxc_cores": 1,
            "proxmox_lxc_memory": 256, "proxmox_lxc_swap": 0,
            "proxmox_lxc_netif": [{"name": "eth0", "bridge": "vmbr0", "ip": "manual"}],
            "proxmox_lxc_features": {"nesting": True}, "proxmox_lxc_tags": ["dflash", "ci"],
            "proxmox_gpu_method": "dev", "nvidia_userspace_installer_dir": str(self.installer_dir),
            "training_venv_enabled": False,
        }
        base.update(group_vars)
        inv = {"all": {"children": {"dflash_containers": {"children": {"testpve": {
            "vars": base, "hosts": containers}}}}}}
        path = self.workdir / f"inventory-{abs(hash(json.dumps(inv, sort_keys=True, default=str)))}.json"
        path.write_text(json.dumps(inv, indent=1, default=str))
        return path

    def run(self, inventory: Path, *args: str, token: bool = False, password: bool = True,
            timeout: int = 600, env_secrets: dict | None = None) -> subprocess.CompletedProcess:
        """ansible-playbook; secrets come from the environment (env_secrets replaces some), as a user keeps them."""
        env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_FORCE_COLOR="0", ANSIBLE_STDOUT_CALLBACK="default", ANSIBLE_LOCAL_TEMP=str(self.workdir / "tmp"),
                   ANSIBLE_HOME=str(self.workdir / "ansible-home"))
        for key in ("PROXMOX_PASSWORD", "PROXMOX_TOKEN_ID", "PROXMOX_TOKEN_SECRET"):
            env.pop(key, None)
        if password:
            env["PROXMOX_PASSWORD"] = self.host.root_password
        if token:
            env["PROXMOX_TOKEN_ID"] = self.host.token_id
            env["PROXMOX_TOKEN_SECRET"] = self.host.token_secret
        env.update(env_secrets or {})
        ansible_playbook = Path(os.sys.executable).parent / "ansible-playbook"
        proc = subprocess.run([str(ansible_playbook), "-i", str(inventory), str(PLAYBOOK), *args],
                              capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO, check=False)
        out = proc.stdout + proc.stderr
        for secret in (self.host.root_password, self.host.token_secret, *(env_secrets or {}).values()):
            assert secret not in out, "a secret was printed by ansible-playbook"
        return proc


def recap(proc) -> dict[str, dict[str, int]]:
    """PLAY RECAP -> {host: {'ok': n, 'changed': n, 'failed': n, ...}}."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+:\s+(ok=.*)$", proc.stdout, re.MULTILINE):
        out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


def failure_text(proc) -> str:
    return proc.stdout + proc.stderr


def api_writes(host) -> list[dict]:
    return [c for c in host.calls() if c["method"] in ("POST", "PUT", "DELETE")]
