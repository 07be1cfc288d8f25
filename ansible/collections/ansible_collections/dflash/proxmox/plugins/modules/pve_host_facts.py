#!/usr/bin/python
# ruff: noqa: EXE001 - Ansible's module shebang, on a file that must not be executable (ansible-test)
# GPU discovery on the Proxmox host over SSH: driver version, device nodes and their (dynamic)
# majors, and the passthrough entries both methods need. Read-only, so it runs in check mode too.
from __future__ import annotations

DOCUMENTATION = r"""
module: pve_host_facts
short_description: Discover the NVIDIA driver, GPUs and device majors of a Proxmox VE host over SSH
description:
  - Reads C(/proc/driver/nvidia/version), C(/proc/devices), C(ls -l /dev/nvidia*) and C(nvidia-smi -L) on the host.
  - Returns the C(dev[n]) entries and the raw C(lxc.*) lines for the chosen GPUs; C(nvidia-uvm) and
    C(nvidia-caps) majors are read from the host, never assumed.
version_added: "0.1.0"
extends_documentation_fragment:
  - dflash.proxmox.pve
  - dflash.proxmox.pve.SSH
options:
  gpus:
    description: V(all), or a list of GPU indices (the /dev/nvidiaN minors) to pass through.
    type: raw
    default: all
  device_mode:
    description: Mode of the device nodes inside the container (C(dev[n]) method).
    type: str
    default: "0666"
  discover:
    description: Discover the driver and GPUs; V(false) only looks for O(files).
    type: bool
    default: true
  files:
    description: Files on the host to look for (such as the NVIDIA installer); the missing ones are returned.
    type: list
    elements: str
    default: []
author: dflash-trainer developers
"""

EXAMPLES = r"""
- name: GPUs of the host
  dflash.proxmox.pve_host_facts:
    ssh_host: pve.example.org
    gpus: [0, 1]
  register: host_gpus
"""

RETURN = r"""
driver_version:
  description: Host kernel module version (such as 580.95.05).
  type: str
  returned: when discover is true
gpus:
  description: GPUs from nvidia-smi -L (index, name, uuid).
  type: list
  returned: when discover is true
majors:
  description: Character device majors of the NVIDIA drivers from /proc/devices.
  type: dict
  returned: when discover is true
device_nodes:
  description: The nodes to pass through (path, major, minor).
  type: list
  returned: when discover is true
dev_entries:
  description: dev[n] entries for the devices option of pve_lxc.
  type: list
  returned: when discover is true
raw_lines:
  description: lxc.cgroup2.devices.allow and lxc.mount.entry lines for pve_lxc_raw.
  type: list
  returned: when discover is true
nvidia_majors:
  description: All NVIDIA majors (195 and the dynamic ones).
  type: list
  returned: when discover is true
files_missing:
  description: Those of O(files) that are not regular files on the host (the other keys need O(discover)).
  type: list
  returned: always
"""

import shlex

from ansible_collections.dflash.proxmox.plugins.module_utils import pve_host
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import run_module


def missing_files(shell, files):
    if not files:
        return []
    _, out, _ = shell.run("for f in " + " ".join(shlex.quote(f) for f in files)
                          + '; do [ -f "$f" ] || printf "%s\\n" "$f"; done', what="looking for files on the host")
    return out.splitlines()


def run(params):
    shell = pve_host.HostShell(params)
    if not params["discover"]:
        return {"changed": False, "files_missing": missing_files(shell, params["files"])}
    rc, version_text, _ = shell.run("cat /proc/driver/nvidia/version", check=False)
    version = pve_host.parse_driver_version(version_text if rc == 0 else "")
    _, devices_text, _ = shell.run("cat /proc/devices", what="reading /proc/devices")
    majors = {k: v for k, v in pve_host.parse_proc_devices(devices_text).items() if "nvidia" in k}
    _, ls_text, _ = shell.run("ls -l /dev/nvidia*", check=False)
    nodes = pve_host.parse_ls_l(ls_text)
    rc, smi_text, smi_err = shell.run("nvidia-smi -L", check=False)
    gpus = pve_host.parse_nvidia_smi_l(smi_text) if rc == 0 else []
    chosen = pve_host.passthrough_nodes(nodes, params["gpus"])
    nvidia_majors = sorted({pve_host.NVIDIA_MAJOR, *majors.values(), *(n["major"] for n in nodes)})
    missing = missing_files(shell, params["files"])
    return {"changed": False, "driver_version": version, "gpus": gpus, "majors": majors, "device_nodes": chosen,
                "dev_entries": pve_host.dev_entries(chosen, params["device_mode"]),
                "raw_lines": pve_host.raw_lxc_lines(chosen), "nvidia_majors": nvidia_majors,
                "nvidia_smi_error": smi_err.strip() if rc != 0 else "", "files_missing": missing}


def main():
    run_module(lambda module: run(module.params),
               {"gpus": {"type": "raw", "default": "all"}, "device_mode": {"type": "str", "default": "0666"},
                "discover": {"type": "bool", "default": True},
                "files": {"type": "list", "elements": "str", "default": []}}, details=())


if __name__ == "__main__":
    main()
