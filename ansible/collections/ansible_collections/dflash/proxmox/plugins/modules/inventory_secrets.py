# The documentation of the inventory_secrets action (plugins/action/inventory_secrets.py), which runs on
# the controller and has no module code.
from __future__ import annotations

DOCUMENTATION = r"""
module: inventory_secrets
short_description: Refuse secrets kept in plain text in the inventory
description:
  - Reads every file Ansible loads variables from for the host (the inventory sources, C(group_vars/) and
    C(host_vars/) beside them and beside the playbook) and fails when a secret is plain text there.
  - A secret is a variable named C(vault_*), C(*_password) or C(*_secret) anywhere in those files, and any
    plain value equal to the effective value of one of O(variables) (so a template that refers to a plain
    variable, C({{ my_pw }}), is caught too).
  - A file encrypted with C(ansible-vault encrypt), an inline C(!vault) value, a template that refers to
    one, and the environment pass. A file named C(vault.yml) that is not encrypted fails.
  - Messages name the variable, the file and the fix; they never contain the value.
version_added: "0.2.0"
options:
  variables:
    description: Secret variables whose effective values are looked for, each with the environment variable
      that may hold it instead (empty when there is none).
    type: dict
    required: true
author: dflash-trainer developers
"""

EXAMPLES = r"""
- name: Refuse secrets kept in plain files
  dflash.proxmox.inventory_secrets:
    variables:
      proxmox_api_password: PROXMOX_PASSWORD
      proxmox_api_token_secret: PROXMOX_TOKEN_SECRET
"""

RETURN = r"""
checked_files: {description: The files that were read., type: list, elements: str, returned: always}
problems: {description: One sentence per plain-text secret (variable, file, fix)., type: list, elements: str, returned: failure}
"""
