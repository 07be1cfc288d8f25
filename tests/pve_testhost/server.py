"""`serve`: the test host's main process (inside its mount namespace): HTTPS API, sshd, cleanup on SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import ssl
import threading
from pathlib import Path

import trustme
from werkzeug.serving import make_server

from . import hostns
from .api import Credentials, PveApi
from .containers import Node
from .tasks import TaskManager

TOKEN_ID = "root@pam!ci"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tls(state: Path) -> tuple[Path, Path]:
    """A CA of our own and a server certificate for 127.0.0.1 and localhost, signed by it."""
    ca_pem, server_pem = state / "ca.pem", state / "server.pem"
    if not ca_pem.exists() or not server_pem.exists():
        ca = trustme.CA(organization_name="PVE test host CA")
        cert = ca.issue_cert("127.0.0.1", "localhost", "pve")
        ca.cert_pem.write_to_path(str(ca_pem))
        cert.private_key_and_cert_chain_pem.write_to_path(str(server_pem))
        os.chmod(server_pem, 0o600)
    return ca_pem, server_pem


def load_or_make_secrets(state: Path) -> dict:
    f = state / "secrets.json"
    if f.exists():
        return json.loads(f.read_text())
    data = {"root_password": secrets.token_urlsafe(18), "token_secret": str(secrets.token_hex(16)),
            "ticket_key": secrets.token_hex(32)}
    f.touch(mode=0o600)
    f.write_text(json.dumps(data))
    return data


def stop_leftovers(node: Node, log) -> None:
    """Stop and remove every container this host made (also those of a run that died)."""
    for vmid in node.vmids():
        try:
            node.remove(vmid)
        except Exception as exc:  # noqa: BLE001 - keep going: one stuck CT must not keep the others alive
            log(f"cleanup of CT {vmid} failed: {exc}")


def check_prerequisites() -> None:
    """Root and the tools the test host runs; exits naming what is missing and how to get it."""
    if os.geteuid() != 0:
        raise SystemExit("pve_testhost: needs root (it runs LXC containers and mounts overlays); "
                         "run it as root or skip the lxc-marked tests")
    for tool in ("lxc-start", "/usr/sbin/sshd", "unshare", "busybox"):
        if not any((Path(d) / tool).exists() for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin")) \
                and not Path(tool).exists():
            raise SystemExit(f"pve_testhost: '{tool}' is missing; install the Debian packages "
                             "lxc openssh-server busybox-static (see .ci/setup-lxc.sh)")


def make_httpd(state: Path, node: Node, sec: dict, api_port: int, server_pem: Path):
    """The HTTPS server of the API, calls recorded to <state>/calls.jsonl, tasks kept under <state>/tasks."""
    (state / "control").mkdir(exist_ok=True)
    calls = state / "calls.jsonl"
    calls.touch()
    creds = Credentials(root_password=sec["root_password"], token_id=TOKEN_ID, token_secret=sec["token_secret"],
                        ticket_key=bytes.fromhex(sec["ticket_key"]))
    tasks = TaskManager("pve", state / "control", state / "tasks")
    app = PveApi(node, creds, tasks, calls)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(server_pem))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    return make_server("127.0.0.1", api_port, app, threaded=True, ssl_context=ctx)


def connection_info(state: Path, sec: dict, ca_pem: Path, api_port: int, ssh_port: int, info: dict | None) -> dict:
    """What a client needs (and `up` prints): URLs, ports, CA, credentials, the stand-in GPUs."""
    return {
        "api_host": "127.0.0.1", "api_port": api_port, "api_url": f"https://127.0.0.1:{api_port}/api2/json",
        "ca_cert": str(ca_pem), "node": "pve", "storage": "local", "root_password": sec["root_password"],
        "token_id": TOKEN_ID, "token_secret": sec["token_secret"], "ssh_port": ssh_port, "ssh_user": "root",
        "ssh_key": str(state / "ssh" / "id_ed25519"), "state_dir": str(state), "pid": os.getpid(),
        "gpus": [{"index": g["index"], "minor": g["minor"]} for g in info["gpus"]] if info else [],
    }


def serve(state: Path, api_port: int = 0, ssh_port: int = 0) -> None:
    state = state.resolve()
    if os.environ.get("PVE_TESTHOST_NS") != "1":
        check_prerequisites()
        state.mkdir(parents=True, exist_ok=True)
        hostns.enter_private_namespace(["-m", "tests.pve_testhost", "serve", "--state-dir", str(state),
                                        "--api-port", str(api_port), "--ssh-port", str(ssh_port)])
    logging.basicConfig(filename=state / "server.log", level=logging.INFO,
                        format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger("pve_testhost").info
    info = hostns.setup_namespace(state)
    os.environ["PVE_TESTHOST_STATE"] = str(state)
    node = Node()
    stop_leftovers(node, log)
    sec = load_or_make_secrets(state)
    ca_pem, server_pem = make_tls(state)
    api_port = api_port or free_port()
    ssh_port = ssh_port or free_port()
    sshd = hostns.start_sshd(state, ssh_port)
    httpd = make_httpd(state, node, sec, api_port, server_pem)
    conn = connection_info(state, sec, ca_pem, api_port, ssh_port, info)
    conn_file = state / "connection.json"
    conn_file.touch(mode=0o600)
    conn_file.write_text(json.dumps(conn, indent=1))

    def shutdown(*_):
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(json.dumps(conn), flush=True)
    try:
        httpd.serve_forever()
    finally:
        log("shutting down: removing containers")
        stop_leftovers(node, log)
        sshd.terminate()
        sshd.wait(timeout=10)
        conn_file.unlink(missing_ok=True)
