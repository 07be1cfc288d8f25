#!/usr/bin/python
# ruff: noqa: EXE001 - Ansible's module shebang, on a file that must not be executable (ansible-test)
# Commands and file copies inside a container through `pct` on the host: the container needs
# no network, no SSH server and no Python.
from __future__ import annotations

DOCUMENTATION = r"""
module: pve_pct_exec
short_description: Run a command in, or push a file into, a Proxmox VE container through pct
description:
  - O(argv) runs through C(pct exec <vmid> --) on the host over SSH. Reports changed unless O(read_only);
    read-only probes also run in check mode.
  - O(push_src) copies a controller file to the host, then C(pct push)es it to O(push_dest); skipped when
    the container already has a file with the same sha256.
version_added: "0.1.0"
extends_documentation_fragment:
  - dflash.proxmox.pve
  - dflash.proxmox.pve.SSH
options:
  vmid: {description: Container id., type: int, required: true}
  argv: {description: Command and arguments to run in the container., type: list, elements: str}
  read_only: {description: The command changes nothing (a probe); run it in check mode and report no change., type: bool, default: false}
  allow_failure: {description: Return a non-zero exit status instead of failing., type: bool, default: false}
  push_src: {description: Controller file to copy into the container., type: path}
  push_dest: {description: Destination path in the container., type: str}
  push_mode: {description: Octal mode of the pushed file., type: str, default: "0644"}
  host_src: {description: Host file (already on the Proxmox host) to push instead of O(push_src)., type: str}
author: dflash-trainer developers
"""

EXAMPLES = r"""
- name: Driver version inside
  dflash.proxmox.pve_pct_exec:
    ssh_host: pve.example.org
    vmid: 200
    argv: [nvidia-smi, -L]
    read_only: true
"""

RETURN = r"""
rc: {description: Exit status., type: int, returned: when argv is given}
stdout: {description: Standard output., type: str, returned: when argv is given}
stderr: {description: Standard error., type: str, returned: when argv is given}
"""

import os
import shlex
import uuid

from ansible_collections.dflash.proxmox.plugins.module_utils import pve_host
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveError
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import run_module, sha256_of


def push(module, shell):
    p = module.params
    vmid, dest = p["vmid"], p["push_dest"]
    if p["push_src"] and not os.path.isfile(p["push_src"]):
        raise PveError(f"{p['push_src']} does not exist on the controller")
    if p["push_src"]:
        want = sha256_of(p["push_src"])
    else:
        _, out, _ = shell.run(f"sha256sum {shlex.quote(p['host_src'])}", what=f"reading {p['host_src']} on the host")
        want = out.split()[0]
    rc, out, _ = shell.pct_exec(vmid, ["sha256sum", dest], check=False)
    if rc == 0 and out.split() and out.split()[0] == want:
        return {"changed": False, "dest": dest, "sha256": want}
    if module.check_mode:
        return {"changed": True, "dest": dest, "sha256": want}
    staged = p["host_src"]
    if p["push_src"]:
        staged = f"/var/tmp/dflash-push-{uuid.uuid4().hex}"
        shell.run_file_stdin(f"cat > {staged}", p["push_src"], what=f"copying {p['push_src']} to the host")
    try:
        shell.run(f"pct push {int(vmid)} {shlex.quote(staged)} {shlex.quote(dest)} --perms {p['push_mode']}",
                  what=f"pct push to {dest}")
    finally:
        if p["push_src"]:
            shell.run(f"rm -f {staged}", check=False)
    return {"changed": True, "dest": dest, "sha256": want}


def run(module):
    p = module.params
    shell = pve_host.HostShell(p)
    if p["push_dest"]:
        return push(module, shell)
    if module.check_mode and not p["read_only"]:
        return {"changed": True, "skipped_in_check_mode": True, "rc": 0, "stdout": "", "stderr": ""}
    rc, out, err = shell.pct_exec(p["vmid"], p["argv"], check=False)
    if rc != 0 and not p["allow_failure"]:
        raise PveError(f"{' '.join(p['argv'])} failed in container {p['vmid']} (exit {rc}): "
                       f"{(err or out).strip()[-1500:]}", rc=rc, stdout=out, stderr=err)
    # failed=False: Ansible would call any result with rc != 0 a failure, even with allow_failure
    return {"changed": not p["read_only"], "rc": rc, "stdout": out, "stderr": err, "failed": False,
                "stdout_lines": out.splitlines()}


def validate(module):
    if module.params["push_dest"] and not (module.params["push_src"] or module.params["host_src"]):
        module.fail_json(msg="push_dest needs push_src (a controller file) or host_src (a file on the host)")


def main():
    run_module(run, {"vmid": {"type": "int", "required": True}, "argv": {"type": "list", "elements": "str"},
                         "read_only": {"type": "bool", "default": False}, "allow_failure": {"type": "bool", "default": False},
                         "push_src": {"type": "path"}, "push_dest": {"type": "str"},
                         "push_mode": {"type": "str", "default": "0644"}, "host_src": {"type": "str"}},
               details=("rc", "stdout", "stderr"), validate=validate,
               required_one_of=[("argv", "push_dest")],
               mutually_exclusive=[("argv", "push_dest"), ("push_src", "host_src")],
               required_by={"push_dest": ("vmid",)})


if __name__ == "__main__":
    main()
