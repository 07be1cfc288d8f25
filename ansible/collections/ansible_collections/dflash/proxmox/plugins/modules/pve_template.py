#!/usr/bin/python
# ruff: noqa: EXE001 - Ansible's module shebang, on a file that must not be executable (ansible-test)
# Upload a container template when it is missing or its content differs (sha256 over SSH), not
# only when the name is absent; PVE verifies the checksum of what it receives.
from __future__ import annotations

DOCUMENTATION = r"""
module: pve_template
short_description: Upload an LXC template to Proxmox VE when missing or changed
description:
  - Looks the template up in the storage's C(vztmpl) content. When present, compares its sha256 on the host
    (over SSH) with the local file and uploads again when they differ. Without SSH only the name is checked,
    with a warning.
  - The upload carries the checksum, so PVE rejects a corrupted transfer.
version_added: "0.1.0"
extends_documentation_fragment:
  - dflash.proxmox.pve
  - dflash.proxmox.pve.SSH
options:
  src:
    description:
      - Template file on the controller (C(.tar.gz), C(.tar.xz) or C(.tar.zst)); its name becomes the volume name.
      - A glob picks the newest match (with a warning when there are several), e.g. what C(make image) writes,
        C(build/image/debian-13-dflash-trainenv_*_amd64.tar.zst).
    type: path
    required: true
  compare_content:
    description: Compare the host copy's sha256 with the file's when the name is present (V(false) only
      looks for the name; what the preflight needs).
    type: bool
    default: true
  storage:
    description: Storage with C(vztmpl) content.
    type: str
    default: local
  template_dir:
    description: Directory of that storage's templates on the host, for the checksum (default for C(local)).
    type: str
    default: /var/lib/vz/template/cache
author: dflash-trainer developers
"""

EXAMPLES = r"""
- name: Template on the node
  dflash.proxmox.pve_template:
    api_host: pve.example.org
    node: pve
    src: build/image/debian-13-dflash-trainenv_*_amd64.tar.zst
    storage: local
"""

RETURN = r"""
volid: {description: Volume id of the template, for pve_lxc's template option., type: str, returned: always}
src: {description: The file on the controller (the newest match of a glob)., type: str, returned: always}
sha256: {description: sha256 of the local file (empty when it was not needed)., type: str, returned: always}
reason: {description: Why it was (or would be) uploaded; empty when nothing to do., type: str, returned: always}
"""

import os
import shlex

from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveClient, PveError
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_host import HostShell
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import (
    resolve_src,
    run_module,
    sha256_of,
)

SUFFIXES = (".tar.gz", ".tar.xz", ".tar.zst", ".tgz", ".tar.bz2")


def run(module):
    p = module.params
    src, volid = _template_file(module, p["src"], p["storage"])
    # The file's checksum only when it is needed (a content comparison, an upload): templates are gigabytes.
    result = {"changed": False, "volid": volid, "src": src, "sha256": "", "reason": ""}
    pve = PveClient(p)
    pve.check_node()
    pve.storage(p["storage"], "vztmpl")
    result["reason"], result["sha256"] = _upload_reason(module, pve, src, volid)
    if not result["reason"]:
        return result
    result["changed"] = True
    if module.check_mode and not p["compare_content"]:
        return result  # the preflight: it only needed to know the name is missing
    result["sha256"] = result["sha256"] or sha256_of(src)
    if module._diff:
        result["diff"] = {"before": f"{volid}\n" if "missing" not in result["reason"] else "",
                          "after": f"{volid} sha256={result['sha256']}\n"}
    if module.check_mode:
        return result
    _upload(pve, p["storage"], src, result["sha256"])
    return result


def _template_file(module, src_pattern, storage):
    """(the file on the controller, its volume id); warns when a glob matched several."""
    src, others = resolve_src(src_pattern)
    if others:
        module.warn(f"{len(others) + 1} files match proxmox_template_src {src_pattern}; using the newest, {src} "
                    f"(remove the others or name one)")
    name = os.path.basename(src)
    if not name.endswith(SUFFIXES):
        raise PveError(f"template {name} must end in one of {', '.join(SUFFIXES)} for PVE to accept it")
    return src, f"{storage}:vztmpl/{name}"


def _upload_reason(module, pve, src, volid):
    """(why to upload, '' when not needed; the local sha256 when it was computed for the comparison, else '')."""
    p = module.params
    if volid not in pve.templates(p["storage"]):
        return f"{volid} is missing on node {pve.node}", ""
    if not p["compare_content"]:
        return "", ""
    if not p.get("ssh_host"):
        module.warn(f"{volid} exists; without proxmox_ssh_host its content can't be compared with {src}")
        return "", ""
    path = f"{p['template_dir'].rstrip('/')}/{os.path.basename(src)}"
    _, out, _ = HostShell(p).run(f"sha256sum {shlex.quote(path)}", what=f"sha256sum of {path} on the host")
    remote_sum = out.split()[0] if out.split() else ""
    local_sum = sha256_of(src)
    if remote_sum == local_sum:
        return "", local_sum
    return (f"{volid} on node {pve.node} has sha256 {remote_sum[:12]}..., the local file "
            f"{local_sum[:12]}..."), local_sum


def _upload(pve, storage_name, src, checksum):
    """Upload with its sha256, so that PVE rejects a corrupted transfer; waits for the task."""
    name = os.path.basename(src)
    storage = pve.api.nodes(pve.node).storage(storage_name)
    with open(src, "rb") as fh:
        upid = pve.call(f"uploading {name}", storage.upload.post, content="vztmpl", filename=fh,
                        checksum=checksum, **{"checksum-algorithm": "sha256"})
    pve.wait(upid, f"uploading template {name}")


def main():
    run_module(run, {"src": {"type": "path", "required": True}, "storage": {"type": "str", "default": "local"},
                     "template_dir": {"type": "str", "default": "/var/lib/vz/template/cache"},
                     "compare_content": {"type": "bool", "default": True}})


if __name__ == "__main__":
    main()
