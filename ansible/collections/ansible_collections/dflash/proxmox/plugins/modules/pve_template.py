#!/usr/bin/python
# -*- coding: utf-8 -*-
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
    description: Template file on the controller (C(.tar.gz), C(.tar.xz) or C(.tar.zst)); its name becomes the volume name.
    type: path
    required: true
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
    src: build/image/dflash-train.tar.zst
    storage: local
"""

RETURN = r"""
volid: {description: Volume id of the template, for pve_lxc's template option., type: str, returned: always}
sha256: {description: sha256 of the local file., type: str, returned: always}
reason: {description: Why it was (or would be) uploaded; empty when nothing to do., type: str, returned: always}
"""

import os  # noqa: E402
import shlex  # noqa: E402

from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveClient, PveError  # noqa: E402
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import run_module, sha256_of  # noqa: E402
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_host import HostShell  # noqa: E402

SUFFIXES = (".tar.gz", ".tar.xz", ".tar.zst", ".tgz", ".tar.bz2")


def run(module):
    p = module.params
    src = p["src"]
    if not os.path.isfile(src):
        raise PveError(f"template file {src} does not exist on the controller; build it (make image-template) "
                       f"or fix proxmox_template_src")
    name = os.path.basename(src)
    if not name.endswith(SUFFIXES):
        raise PveError(f"template {name} must end in one of {', '.join(SUFFIXES)} for PVE to accept it")
    volid = f"{p['storage']}:vztmpl/{name}"
    local_sum = sha256_of(src)
    result = dict(changed=False, volid=volid, sha256=local_sum, reason="")
    pve = PveClient(p)
    pve.check_node()
    pve.storage(p["storage"], "vztmpl")
    if volid not in pve.templates(p["storage"]):
        result["reason"] = f"{volid} is missing on node {pve.node}"
    elif p.get("ssh_host"):
        path = f"{p['template_dir'].rstrip('/')}/{name}"
        _, out, _ = HostShell(p).run(f"sha256sum {shlex.quote(path)}", what=f"sha256sum of {path} on the host")
        remote_sum = out.split()[0] if out.split() else ""
        if remote_sum != local_sum:
            result["reason"] = f"{volid} on node {pve.node} has sha256 {remote_sum[:12]}..., the local file {local_sum[:12]}..."
    else:
        module.warn(f"{volid} exists; without proxmox_ssh_host its content can't be compared with {src}")
    if not result["reason"]:
        return result
    result["changed"] = True
    if module._diff:
        result["diff"] = dict(before=f"{volid}\n" if "missing" not in result["reason"] else "",
                              after=f"{volid} sha256={local_sum}\n")
    if module.check_mode:
        return result
    storage = pve.api.nodes(pve.node).storage(p["storage"])
    with open(src, "rb") as fh:
        upid = pve.call(f"uploading {name}", storage.upload.post, content="vztmpl", filename=fh,
                        checksum=local_sum, **{"checksum-algorithm": "sha256"})
    pve.wait(upid, f"uploading template {name}")
    return result


def main():
    run_module(run, dict(src=dict(type="path", required=True), storage=dict(type="str", default="local"),
                         template_dir=dict(type="str", default="/var/lib/vz/template/cache")))


if __name__ == "__main__":
    main()
