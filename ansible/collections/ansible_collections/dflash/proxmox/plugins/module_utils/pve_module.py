# What the modules of this collection share: their main() (connection options, check mode, and a
# PveError turned into fail_json with the details that help: the task's log lines, its UPID, a command's
# output), and the controller's files: a checksum, a template named by a glob.
from __future__ import annotations

import glob
import hashlib
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import (
    AUTH_ARGSPEC,
    SSH_ARGSPEC,
    PveError,
)

TASK_DETAILS = ("task_log", "upid")


def run_module(run, options, details=TASK_DETAILS, validate=None, **module_kwargs):
    """Build the AnsibleModule (auth + SSH options + `options`), then exit_json(**run(module)).

    validate(module) may fail the module before anything runs; module_kwargs go to AnsibleModule
    (required_one_of, mutually_exclusive, ...).
    """
    module = AnsibleModule(argument_spec=dict(AUTH_ARGSPEC, **SSH_ARGSPEC, **options), supports_check_mode=True,
                           **module_kwargs)
    if validate is not None:
        validate(module)
    try:
        result = run(module)
    except PveError as exc:
        module.fail_json(msg=exc.msg, **{k: v for k, v in exc.details.items() if k in details})
    module.exit_json(**result)


def sha256_of(path):
    """A controller file's checksum (compared with the host's copy to skip a transfer)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_src(src):
    """A controller file, or the newest match of a glob: (path, the other matches).

    The example inventory names the template `make image` writes by a glob, since its name carries the
    trainer version and the lock hash (debian-13-dflash-trainenv_<version>-<lock>_amd64.tar.zst).
    """
    if not any(ch in src for ch in "*?["):
        if not os.path.isfile(src):
            raise PveError(f"template file {src} does not exist on the controller: build it with `make image` "
                           f"(it writes build/image/debian-13-dflash-trainenv_<version>-<lock>_amd64.tar.zst) or "
                           f"fix proxmox_template_src")
        return src, []
    matches = sorted((p for p in glob.glob(src) if os.path.isfile(p)),
                     key=lambda p: (os.path.getmtime(p), p), reverse=True)
    if not matches:
        raise PveError(f"no template file matches {src} on the controller: build it with `make image` (it writes "
                       f"build/image/debian-13-dflash-trainenv_<version>-<lock>_amd64.tar.zst) or set "
                       f"proxmox_template_src to an existing template")
    return matches[0], matches[1:]
