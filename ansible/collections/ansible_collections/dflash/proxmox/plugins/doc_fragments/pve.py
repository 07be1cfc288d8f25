# Shared connection options of the dflash.proxmox modules.
from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  api_host:
    description: Proxmox VE API host name or address (required by modules that use the API).
    type: str
  api_port:
    description: API port.
    type: int
    default: 8006
  api_user:
    description: User for password (ticket) login. C(dev[n]) passthrough needs C(root@pam).
    type: str
    default: root@pam
  api_password:
    description: Password for O(api_user); ticket login. Takes precedence over a token.
    type: str
  api_token_id:
    description: Full API token id C(user@realm!name). Tokens can never set C(dev[n]).
    type: str
  api_token_secret:
    description: Secret of O(api_token_id).
    type: str
  validate_certs:
    description: Verify the API's TLS certificate.
    type: bool
    default: true
  ca_path:
    description: CA bundle (PEM) to verify the API certificate with.
    type: path
  api_timeout:
    description: Seconds to wait for one API request.
    type: int
    default: 30
  node:
    description: The Proxmox VE node to work on (required by modules that use the API).
    type: str
  task_timeout:
    description: Seconds to wait for a PVE task (create, start, upload, reboot). Failures end the wait at once.
    type: int
    default: 600
  task_log_lines:
    description: How many of a failed task's last log lines to show.
    type: int
    default: 12
"""

    SSH = r"""
options:
  ssh_host:
    description: Host to SSH to for what the API can't do (the PVE node's address).
    type: str
  ssh_port:
    description: SSH port.
    type: int
    default: 22
  ssh_user:
    description: SSH user; needs root rights for C(pct) and C(/etc/pve).
    type: str
    default: root
  ssh_private_key:
    description: Private key file for SSH.
    type: path
  ssh_options:
    description: Extra C(ssh -o) options, e.g. C(UserKnownHostsFile=...).
    type: list
    elements: str
    default: []
  ssh_timeout:
    description: Seconds one SSH command may take.
    type: int
    default: 600
"""
