"""python -m tests.pve_testhost serve|up|down|pct|template (see README.md)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.pve_testhost")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the test host in the foreground until SIGTERM")
    s.add_argument("--state-dir", required=True, type=Path)
    s.add_argument("--api-port", type=int, default=0)
    s.add_argument("--ssh-port", type=int, default=0)
    u = sub.add_parser("up", help="start it in the background; print the connection info")
    u.add_argument("--state-dir", required=True, type=Path)
    d = sub.add_parser("down", help="stop a host started with 'up' (removes its containers)")
    d.add_argument("--state-dir", required=True, type=Path)
    t = sub.add_parser("template", help="build the tiny test CT template; print its path")
    t.add_argument("--dest-dir", type=Path, default=None)
    return p


def serve(a: argparse.Namespace) -> int:
    from .server import serve as serve_host
    serve_host(a.state_dir, a.api_port, a.ssh_port)
    return 0


def template(a: argparse.Namespace) -> int:
    from .templates import DEFAULT_CACHE, build_test_template
    print(build_test_template(a.dest_dir or DEFAULT_CACHE))
    return 0


def up(a: argparse.Namespace) -> int:
    state = a.state_dir.resolve()
    conn = state / "connection.json"
    if conn.exists():
        pid = json.loads(conn.read_text())["pid"]
        if Path(f"/proc/{pid}").exists():
            print(f"already running (pid {pid}); connection info in {conn}")
            return 0
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "serve.stderr", "w") as err, open(os.devnull, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.pve_testhost", "serve", "--state-dir", str(state)],
                                stdout=out, stderr=err, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not conn.exists():
        time.sleep(0.2)
    if not conn.exists():
        print(f"the PVE test host did not start; see {state / 'serve.stderr'}:\n"
              f"{(state / 'serve.stderr').read_text()[-2000:]}", file=sys.stderr)
        return 1
    info = json.loads(conn.read_text())
    print(f"PVE test host up: {info['api_url']} (ssh -p {info['ssh_port']} -i {info['ssh_key']} root@127.0.0.1)")
    print(f"connection info (with secrets): {conn}")
    return 0


def down(a: argparse.Namespace) -> int:
    state = a.state_dir.resolve()
    conn = state / "connection.json"
    if not conn.exists():
        print(f"no PVE test host running in {state}")
        return 0
    from .fixture import stop
    stop(json.loads(conn.read_text())["pid"])
    print("PVE test host stopped; its containers are removed")
    return 0


COMMANDS = {"serve": serve, "template": template, "up": up, "down": down}


def main(argv: list[str]) -> int:
    if argv[:1] == ["pct"]:
        from .pct import main as pct_main
        return pct_main(argv[1:])
    a = parser().parse_args(argv)
    return COMMANDS[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
