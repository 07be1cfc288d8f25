# -*- coding: utf-8 -*-
# The main() every module of this collection shares: connection options, check mode, and a PveError
# turned into fail_json with the details that help (the task's log lines, its UPID, a command's output).
from __future__ import annotations

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
