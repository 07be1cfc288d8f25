#!/usr/bin/python
# ruff: noqa: EXE001 - Ansible's module shebang, on a file that must not be executable (ansible-test)
# Power actions only (no config): the controlled reboot after raw lxc.* lines changed, which
# LXC reads only at start, without touching the container's settings.
from __future__ import annotations

DOCUMENTATION = r"""
module: pve_lxc_power
short_description: Start, stop or reboot a Proxmox VE container without changing its config
description:
  - V(rebooted) reboots a running container (a stopped one is only started when O(start_stopped)).
version_added: "0.1.0"
extends_documentation_fragment:
  - dflash.proxmox.pve
  - dflash.proxmox.pve.SSH
options:
  vmid: {description: Container id., type: int, required: true}
  state:
    description: Wanted power state.
    type: str
    choices: [started, stopped, rebooted]
    default: rebooted
  start_stopped: {description: With V(rebooted), start a stopped container., type: bool, default: false}
author: dflash-trainer developers
"""

EXAMPLES = r"""
- name: Apply raw lxc lines
  dflash.proxmox.pve_lxc_power:
    api_host: pve.example.org
    node: pve
    vmid: 200
    state: rebooted
"""

RETURN = r"""
status: {description: Status afterwards., type: str, returned: always}
"""

from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveClient, PveError
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import run_module


def run(module):
    p = module.params
    pve = PveClient(p)
    guest = pve.find_guest(p["vmid"])
    if guest is None or guest.get("type") != "lxc":
        if module.check_mode:
            return {"changed": True, "status": "absent"}
        raise PveError(f"container {p['vmid']} does not exist on node {pve.node}")
    ct = pve.lxc(p["vmid"])
    status = pve.call("reading status", ct.status.current.get).get("status")
    action = None
    if p["state"] == "started" and status != "running":
        action, after = "start", "running"
    elif p["state"] == "stopped" and status == "running":
        action, after = "shutdown", "stopped"
    elif p["state"] == "rebooted" and status == "running":
        action, after = "reboot", "running"
    elif p["state"] == "rebooted" and p["start_stopped"]:
        action, after = "start", "running"
    if action is None:
        return {"changed": False, "status": status}
    if not module.check_mode:
        upid = pve.call(f"{action} of container {p['vmid']}", getattr(ct.status, action).post)
        pve.wait(upid, f"{action} of container {p['vmid']}")
    return {"changed": True, "status": after, "action": action}


def main():
    run_module(run, {"vmid": {"type": "int", "required": True},
                         "state": {"type": "str", "default": "rebooted", "choices": ["started", "stopped", "rebooted"]},
                         "start_stopped": {"type": "bool", "default": False}})


if __name__ == "__main__":
    main()
