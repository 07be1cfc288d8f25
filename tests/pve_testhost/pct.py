"""`pct` on the test host (exec, push, pull, start, stop, shutdown, reboot, config, set, status, list, destroy).

Runs as root@pam on the node, like the real one: the root-only options are allowed, the schema
still applies (raw lxc.* keys are refused; edit /etc/pve/lxc/<vmid>.conf for those).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys

from . import pveconf, schema
from .containers import Node, PermError, PveError


def _print_config(node: Node, vmid: int, current: bool) -> None:
    conf = node.read(vmid)
    values = dict(conf.values)
    if not current:
        for k in conf.pending_delete:
            values.pop(k, None)
        values.update(conf.pending)
    if conf.description:  # pve-container CLI/pct.pm config: the description on one line, encoded
        values["description"] = pveconf.encode_text(conf.description)
    for k in sorted(values):
        print(f"{k}: {values[k]}")
    for k, v in conf.lxc:
        print(f"{k}: {v}")


def _parse_set_options(vmid: int, args: list[str]) -> tuple[dict, list[str], list[str]]:
    new, delete, revert = {}, [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or i + 1 >= len(args):
            raise schema.ParamError({arg.lstrip("-") or "option": "expected '-key value'"})
        key, value = re.sub(r"^--?", "", arg), args[i + 1]
        if key == "delete":
            delete += [k for k in re.split(r"[,;\s]+", value) if k]
        elif key == "revert":
            revert += [k for k in re.split(r"[,;\s]+", value) if k]
        else:
            new[key] = value
        i += 2
    params = {**new, "node": "pve", "vmid": str(vmid)}
    if delete:
        params["delete"] = ",".join(delete)
    schema.validate("/nodes/{node}/lxc/{vmid}/config", "PUT", params)
    return new, delete, revert


def _log(line: str) -> None:
    print(line, file=sys.stderr)


def _list(node: Node) -> int:
    print(f"{'VMID':<10} {'Status':<10} {'Lock':<12} Name")
    for vmid in node.vmids():
        conf = node.read(vmid)
        print(f"{vmid:<10} {node.status(vmid):<10} {conf.values.get('lock', ''):<12} "
              f"{conf.values.get('hostname', '')}")
    return 0


def _exec(node: Node, vmid: int, rest: list[str]) -> int:
    rest = rest[1:] if rest[:1] == ["--"] else rest
    node.read(vmid)
    if node.status(vmid) != "running":
        raise PveError(f"CT {vmid} not running")
    return subprocess.run(node.attach_command(vmid, rest), check=False).returncode


def _push(node: Node, vmid: int, rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pct push")
    p.add_argument("file")
    p.add_argument("destination")
    p.add_argument("--perms", "-perms")
    p.add_argument("--user", "-user")
    p.add_argument("--group", "-group")
    a = p.parse_args(rest)
    with open(a.file, "rb") as fh:
        data = fh.read()
    script = 'cat > "$1"'
    if a.perms:
        script += ' && chmod "$2" "$1"'
    if a.user or a.group:
        script += ' && chown "$3" "$1"'
    owner = f"{a.user or ''}{':' + a.group if a.group else ''}"
    res = node.exec(vmid, ["/bin/sh", "-c", script, "sh", a.destination, a.perms or "", owner], input=data)
    sys.stderr.write(res.stderr.decode(errors="replace"))
    return res.returncode


def _pull(node: Node, vmid: int, rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pct pull")
    p.add_argument("path")
    p.add_argument("destination")
    a = p.parse_args(rest)
    res = node.exec(vmid, ["/bin/cat", a.path])
    if res.returncode != 0:
        sys.stderr.write(res.stderr.decode(errors="replace"))
        return res.returncode
    with open(a.destination, "wb") as fh:
        fh.write(res.stdout)
    return 0


def _start(node: Node, vmid: int, rest: list[str]) -> int:
    node.start(vmid, _log)
    return 0


def _require_running(node: Node, vmid: int, kind: str = "CT") -> None:
    if not node.exists(vmid) or node.status(vmid) != "running":
        raise PveError(f"{kind} {vmid} not running")


def _stop(node: Node, vmid: int, rest: list[str]) -> int:
    _require_running(node, vmid)
    node.stop(vmid, _log, check_lock=True)
    return 0


def _shutdown(node: Node, vmid: int, rest: list[str]) -> int:
    _require_running(node, vmid)
    timeout = int(rest[rest.index("--timeout") + 1]) if "--timeout" in rest else 60
    node.stop(vmid, _log, timeout=timeout, force="--forceStop" in rest, check_lock=True)
    return 0


def _reboot(node: Node, vmid: int, rest: list[str]) -> int:
    _require_running(node, vmid, "VM")  # pct reboot's message says VM, as PVE's does
    node.stop(vmid, _log, timeout=60, force=True)
    node.start(vmid, _log)
    return 0


def _status(node: Node, vmid: int, rest: list[str]) -> int:
    print(f"status: {node.status(vmid) if node.exists(vmid) else 'unknown'}")
    if not node.exists(vmid):
        raise PveError(f"Configuration file 'nodes/{node.name}/lxc/{vmid}.conf' does not exist")
    return 0


def _config(node: Node, vmid: int, rest: list[str]) -> int:
    _print_config(node, vmid, "--current" in rest or "-current" in rest)
    return 0


def _set(node: Node, vmid: int, rest: list[str]) -> int:
    new, delete, revert = _parse_set_options(vmid, rest)
    node.update_config(vmid, new, delete, "root@pam", revert=revert, log=_log)
    return 0


def _destroy(node: Node, vmid: int, rest: list[str]) -> int:
    node.destroy(vmid, _log, force="--force" in rest)
    return 0


# The commands that take a vmid: (node, vmid, the arguments after it) -> exit status.
VMID_COMMANDS = {"exec": _exec, "push": _push, "pull": _pull, "start": _start, "stop": _stop,
                 "shutdown": _shutdown, "reboot": _reboot, "status": _status, "config": _config, "set": _set,
                 "destroy": _destroy}


def _run(node: Node, cmd: str, rest: list[str]) -> int:
    if cmd == "list":
        return _list(node)
    if not rest or not rest[0].isdigit():
        raise schema.ParamError({"vmid": "type check ('integer') failed - got '%s'" % (rest[0] if rest else '')})
    vmid, rest = int(rest[0]), rest[1:]
    command = VMID_COMMANDS.get(cmd)
    if command is None:
        print(f"unknown command 'pct {cmd}'", file=sys.stderr)
        return 255
    return command(node, vmid, rest)


def main(argv: list[str]) -> int:
    node = Node()
    if not argv:
        print("USAGE: pct <COMMAND> [ARGS] [OPTIONS]  (exec push pull start stop shutdown reboot config set "
              "status list destroy)", file=sys.stderr)
        return 255
    cmd = argv[0]
    try:
        return _run(node, cmd, argv[1:])
    except schema.ParamError as exc:
        print("400 Parameter verification failed.", file=sys.stderr)
        for k, v in exc.errors.items():
            print(f"{k}: {v}", file=sys.stderr)
        print(f"pct {cmd} {' '.join(shlex.quote(a) for a in argv[1:])}", file=sys.stderr)
        return 255
    except PermError as exc:
        print(f"Permission check failed ({exc})", file=sys.stderr)
        return 255
    except (PveError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 255
