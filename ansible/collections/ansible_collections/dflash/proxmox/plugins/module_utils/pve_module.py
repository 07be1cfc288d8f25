# -*- coding: utf-8 -*-
# What the modules of this collection share: their main() (connection options, check mode, and a
# PveError turned into fail_json with the details that help: the task's log lines, its UPID, a command's
# output) and the checksum of a controller file.
from __future__ import annotations

import hashlib

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import AUTH_ARGSPEC, SSH_ARGSPEC, PveError

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
