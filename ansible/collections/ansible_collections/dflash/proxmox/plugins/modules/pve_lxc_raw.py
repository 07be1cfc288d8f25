#!/usr/bin/python
# ruff: noqa: EXE001 - Ansible's module shebang, on a file that must not be executable (ansible-test)
# Raw lxc.* lines can't go through the API (no 'lxc' property in its schema), so they are
# written into /etc/pve/lxc/<vmid>.conf on the host, idempotently, with check and diff mode.
from __future__ import annotations

DOCUMENTATION = r"""
module: pve_lxc_raw
short_description: Keep the NVIDIA lxc.* lines of a container's /etc/pve/lxc/<vmid>.conf as wanted
description:
  - Replaces the lines this module manages (C(lxc.mount.entry) of C(/dev/nvidia*) and
    C(lxc.cgroup2.devices.allow) for NVIDIA majors) by O(lines); every other line stays.
  - Returns C(restart_needed) when the file changed and the container runs, since LXC reads raw
    lines only at start.
version_added: "0.1.0"
extends_documentation_fragment:
  - dflash.proxmox.pve
  - dflash.proxmox.pve.SSH
options:
  vmid:
    description: Container id.
    type: int
    required: true
  lines:
    description: "The wanted lines, each C(lxc.key: value); an empty list removes ours."
    type: list
    elements: str
    required: true
  nvidia_majors:
    description: Majors whose device allow lines are ours (195 and the host's dynamic NVIDIA majors).
    type: list
    elements: int
    default: [195]
  conf_dir:
    description: Directory of the container configs on the host.
    type: str
    default: /etc/pve/lxc
author: dflash-trainer developers
"""

EXAMPLES = r"""
- name: GPU lines
  dflash.proxmox.pve_lxc_raw:
    ssh_host: pve.example.org
    vmid: 200
    lines: "{{ host_gpus.raw_lines }}"
    nvidia_majors: "{{ host_gpus.nvidia_majors }}"
"""

RETURN = r"""
restart_needed: {description: The lines changed while the container runs., type: bool, returned: always}
"""

import shlex

from ansible_collections.dflash.proxmox.plugins.module_utils import pve_host
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveError
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import run_module


def run(module):
    p = module.params
    for line in p["lines"]:
        key = line.partition(":")[0].strip()
        if not key.startswith("lxc.") or ":" not in line:
            raise PveError(f"raw line {line!r} is not an 'lxc.<key>: <value>' line")
    shell = pve_host.HostShell(p)
    path = f"{p['conf_dir'].rstrip('/')}/{int(p['vmid'])}.conf"
    rc, before, err = shell.run(f"cat {shlex.quote(path)}", check=False)
    if rc != 0:
        if module.check_mode:
            before = ""  # created by an earlier task that check mode only pretended to run
        else:
            raise PveError(f"container {p['vmid']} has no config at {path} on the host ({err.strip()}); "
                           f"create it first (pve_lxc)")
    after = pve_host.merge_raw_lines(before, p["lines"], set(p["nvidia_majors"]))
    changed = (after != before.rstrip("\n") + "\n") if before else bool(p["lines"])
    result = {"changed": changed, "restart_needed": False, "path": path}
    if module._diff:
        result["diff"] = {"before": before, "after": after, "before_header": path, "after_header": path}
    if not result["changed"] or module.check_mode:
        result["restart_needed"] = result["changed"] and _running(shell, p["vmid"])
        return result
    shell.run(f"cat > {shlex.quote(path)}", stdin=after.encode(), what=f"writing {path}")
    result["restart_needed"] = _running(shell, p["vmid"])
    return result


def _running(shell, vmid):
    rc, out, _ = shell.run(f"pct status {int(vmid)}", check=False)
    return rc == 0 and "running" in out


def main():
    run_module(run, {"vmid": {"type": "int", "required": True}, "lines": {"type": "list", "elements": "str", "required": True},
                         "nvidia_majors": {"type": "list", "elements": "int", "default": [195]},
                         "conf_dir": {"type": "str", "default": "/etc/pve/lxc"}}, details=())


if __name__ == "__main__":
    main()
