# A small layer over proxmoxer: log in with clear errors, wait for tasks failing fast with the
# task's last log lines, and the lookups the modules share. Secrets never reach a message.
from __future__ import annotations

import os
import time

try:
    import proxmoxer
    import requests
    from proxmoxer.core import AuthenticationError, ResourceException
    HAS_PROXMOXER = True
    IMPORT_ERROR = None
except ImportError as exc:  # reported by the module as a clear failure
    HAS_PROXMOXER = False
    IMPORT_ERROR = exc
    AuthenticationError = ResourceException = Exception

# Connection options every module takes (set once through module_defaults: group/dflash.proxmox.pve).
AUTH_ARGSPEC = {
    "api_host": {"type": "str"},
    "api_port": {"type": "int", "default": 8006},
    "api_user": {"type": "str", "default": "root@pam"},
    "api_password": {"type": "str", "no_log": True},
    "api_token_id": {"type": "str"},
    "api_token_secret": {"type": "str", "no_log": True},
    "validate_certs": {"type": "bool", "default": True},
    "ca_path": {"type": "path"},
    "api_timeout": {"type": "int", "default": 30},
    "node": {"type": "str"},
    "task_timeout": {"type": "int", "default": 600},
    "task_log_lines": {"type": "int", "default": 12},
}
SSH_ARGSPEC = {
    "ssh_host": {"type": "str"},
    "ssh_port": {"type": "int", "default": 22},
    "ssh_user": {"type": "str", "default": "root"},
    "ssh_private_key": {"type": "path", "no_log": False},
    "ssh_options": {"type": "list", "elements": "str", "default": []},
    "ssh_timeout": {"type": "int", "default": 600},
}
TASK_OK = ("OK",)


class PveError(Exception):
    """A failure with a message meant for the operator (names the problem and the fix)."""

    def __init__(self, msg, **details):
        super().__init__(msg)
        self.msg = msg
        self.details = details


class TaskFailed(PveError):
    pass


def _auth_mode(p):
    if p.get("api_password"):
        return "ticket"
    if p.get("api_token_id") and p.get("api_token_secret"):
        return "token"
    raise PveError("no Proxmox credentials: set proxmox_api_password (root@pam, from ansible-vault or "
                   "the PROXMOX_PASSWORD environment variable) or proxmox_api_token_id and "
                   "proxmox_api_token_secret (PROXMOX_TOKEN_SECRET)")


class PveClient:
    """proxmoxer.ProxmoxAPI plus the calls our modules share."""

    def __init__(self, params):
        _check_connection_params(params)
        self.p = params
        self.node = params["node"]
        self.auth = _auth_mode(params)
        self.url = f"https://{params['api_host']}:{params['api_port']}"
        _check_ca_path(params)
        login_user = params.get("api_user") or "root@pam"
        try:
            self.api, self.user = self._login(params, login_user)
            self.version = self.api.version.get()
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, AuthenticationError,
                ResourceException) as exc:
            raise _login_failure(exc, self.url, login_user, params) from None

    def _login(self, params, login_user):
        """(proxmoxer.ProxmoxAPI, the user it acts as) for a password (ticket) or an API token login."""
        verify = params.get("ca_path") or params.get("validate_certs", True)
        kwargs = {"port": params["api_port"], "verify_ssl": verify, "timeout": params["api_timeout"]}
        if self.auth == "ticket":
            return proxmoxer.ProxmoxAPI(params["api_host"], user=login_user, password=params["api_password"],
                                        **kwargs), login_user
        token = params["api_token_id"]
        token_user, _, token_name = token.rpartition("!") if "!" in token else (login_user, "!", token)
        return proxmoxer.ProxmoxAPI(params["api_host"], user=token_user, token_name=token_name,
                                    token_value=params["api_token_secret"], **kwargs), token_user

    # ---- version and capabilities -------------------------------------------------------------------
    def version_tuple(self):
        parts = str(self.version.get("version", "0")).split(".")
        out = []
        for part in parts[:2]:
            digits = "".join(ch for ch in part if ch.isdigit())
            out.append(int(digits or 0))
        return tuple(out + [0] * (2 - len(out)))

    def can_pass_devices(self):
        """dev[n] needs root@pam with a password/ticket login; API tokens never pass PVE's check."""
        return self.auth == "ticket" and self.user == "root@pam"

    # ---- lookups ------------------------------------------------------------------------------------
    def call(self, what, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ResourceException as exc:
            raise PveError(f"{what} failed: {_resource_msg(exc)}") from None
        except requests.exceptions.RequestException as exc:
            raise PveError(f"{what} failed: {_short(exc)}") from None

    def check_node(self):
        nodes = [n.get("node") for n in self.call("listing nodes", self.api.nodes.get)]
        if self.node not in nodes:
            raise PveError(f"node {self.node!r} is not part of the cluster at {self.url} (nodes: "
                           f"{', '.join(sorted(nodes)) or 'none'}); fix proxmox_node")

    def storage(self, name, content):
        """The storage entry on our node; fails clearly when unknown or lacking that content type."""
        items = self.call(f"listing storages on node {self.node}", self.api.nodes(self.node).storage.get)
        by_name = {s.get("storage"): s for s in items}
        if name not in by_name:
            raise PveError(f"storage {name!r} does not exist on node {self.node} (storages: "
                           f"{', '.join(sorted(by_name)) or 'none'}); fix the storage variable")
        kinds = str(by_name[name].get("content", "")).split(",")
        if content not in kinds:
            raise PveError(f"storage {name!r} on node {self.node} does not hold {content!r} content "
                           f"(it holds: {by_name[name].get('content')}); pick a storage that does or "
                           f"enable {content} on it")
        return by_name[name]

    def templates(self, storage):
        items = self.call(f"listing templates on {storage}",
                          self.api.nodes(self.node).storage(storage).content.get, content="vztmpl")
        return {i.get("volid"): i for i in items}

    def find_guest(self, vmid):
        """{'type': 'lxc'|'qemu', 'node': ..., 'name': ...} for a vmid anywhere in the cluster, or None."""
        for r in self.call("listing guests", self.api.cluster.resources.get, type="vm"):
            if int(r.get("vmid", -1)) == int(vmid):
                return r
        return None

    def lxc(self, vmid):
        return self.api.nodes(self.node).lxc(vmid)

    # ---- tasks --------------------------------------------------------------------------------------
    def wait(self, upid, what, timeout=None):
        """Poll a task until it stops; raise TaskFailed with its last log lines unless it ended OK."""
        if not isinstance(upid, str) or not upid.startswith("UPID:"):
            return None  # a synchronous call answered directly
        node = upid.split(":")[1]
        timeout = timeout or self.p.get("task_timeout", 600)
        deadline = time.monotonic() + timeout
        delay = 0.2
        while True:
            status = self.call(f"polling task {upid}", self.api.nodes(node).tasks(upid).status.get)
            if status.get("status") == "stopped":
                exit_status = str(status.get("exitstatus", ""))
                if exit_status in TASK_OK or exit_status.startswith("WARNINGS"):
                    return status
                lines = self.task_log_tail(node, upid)
                raise TaskFailed(f"{what} failed on node {node}: {exit_status}. Last lines of the task log:\n"
                                 + "\n".join(lines), task_log=lines, upid=upid)
            if time.monotonic() > deadline:
                lines = self.task_log_tail(node, upid)
                raise TaskFailed(f"{what} still running after {timeout} s (task {upid}); raise "
                                 f"proxmox_task_timeout if the host is slow. Last log lines:\n" + "\n".join(lines),
                                 task_log=lines, upid=upid)
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    def task_log_tail(self, node, upid):
        try:
            log = self.api.nodes(node).tasks(upid).log.get(start=0, limit=100000)
        except (ResourceException, requests.exceptions.RequestException, ValueError):  # a courtesy: the failure is known
            return ["(task log unavailable)"]
        lines = [str(entry.get("t", "")) for entry in sorted(log or [], key=lambda e: int(e.get("n", 0)))]
        return lines[-int(self.p.get("task_log_lines", 12)):]


def _check_connection_params(params):
    if not HAS_PROXMOXER:
        raise PveError(f"the Python library proxmoxer (and requests) is needed on the controller: "
                       f"pip install 'proxmoxer>=2.1' requests ({IMPORT_ERROR})")
    for key in ("api_host", "node"):
        if not params.get(key):
            raise PveError(f"{key} is not set (proxmox_{key} in the inventory)")


def _check_ca_path(params):
    if params.get("ca_path") and not os.path.isfile(params["ca_path"]):
        raise PveError(f"the CA file {params['ca_path']} does not exist: copy /etc/pve/pve-root-ca.pem from "
                       f"a node there, or fix proxmox_api_ca_path")


def _login_failure(exc, url, login_user, params):
    """The operator's message for an exception of the login call (checked most specific first)."""
    if isinstance(exc, requests.exceptions.SSLError):
        return PveError(f"TLS verification of {url} failed ({_short(exc)}). Point proxmox_api_ca_path "
                        f"at the CA that signed the host's certificate (on the host: "
                        f"/etc/pve/pve-root-ca.pem); set proxmox_api_validate_certs: false only on a "
                        f"trusted network")
    if isinstance(exc, requests.exceptions.ConnectionError):
        return PveError(f"cannot reach the Proxmox API at {url} ({_short(exc)}); check "
                        f"proxmox_api_host and proxmox_api_port")
    if isinstance(exc, requests.exceptions.Timeout):
        return PveError(f"the Proxmox API at {url} did not answer within {params['api_timeout']} s")
    if isinstance(exc, AuthenticationError):
        return PveError(f"login to {url} as {login_user} failed: wrong user or password "
                        f"(check proxmox_api_user and the vaulted proxmox_api_password)")
    if exc.status_code in (401, 403):
        return PveError(f"the API token {params.get('api_token_id')} was rejected by {url} "
                        f"(HTTP {exc.status_code}): check proxmox_api_token_id and "
                        f"proxmox_api_token_secret")
    return PveError(f"{url}: {_resource_msg(exc)}")


def _resource_msg(exc):
    errors = getattr(exc, "errors", None)
    text = f"HTTP {exc.status_code} {exc.status_message}"
    if errors:
        text += ": " + "; ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
    elif getattr(exc, "content", None):
        text += f": {str(exc.content).strip()[:300]}"
    return text


def _short(exc):
    text = str(exc)
    for marker in ("certificate verify failed", "hostname mismatch", "Connection refused",
                   "Name or service not known", "timed out"):
        if marker in text:
            return marker
    return text[:200]
