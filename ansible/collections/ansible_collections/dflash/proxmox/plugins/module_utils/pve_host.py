# What the API can't do, done over SSH on the Proxmox host: GPU and device-major discovery,
# raw lxc.* lines in /etc/pve/lxc/<vmid>.conf, and commands inside a container via `pct`.
# The parsers are pure functions (unit-tested); HostShell is the only part that runs anything.
from __future__ import annotations

import os
import re
import shlex
import subprocess

from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveError

NVIDIA_MAJOR = 195  # nvidia0..N (minor N), nvidiactl 195:255, nvidia-modeset 195:254
DRIVER_VERSION = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")
LS_LINE = re.compile(r"^(?P<type>[cbdlps-])(?P<mode>[rwxsStT-]{9})[.+@]?\s+\d+\s+\S+\s+\S+\s+"
                     r"(?:(?P<major>\d+),\s*(?P<minor>\d+)|\d+)\s+\S+\s+\S+\s+\S+\s+(?P<name>.+)$")
SMI_GPU = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*(?:\(UUID:\s*([^)]+)\))?\s*$")


# ---- parsers ----------------------------------------------------------------------------------------
def parse_driver_version(text):
    """'/proc/driver/nvidia/version' -> '580.95.05'; a clear error when no NVIDIA module is loaded."""
    m = DRIVER_VERSION.search(text or "")
    if not m:
        raise PveError("no NVIDIA kernel module on the Proxmox host (/proc/driver/nvidia/version is "
                       "missing or unreadable): install the host driver and load it before provisioning "
                       "GPU containers, or set proxmox_gpu_enabled: false")
    return m.group(1)


def parse_proc_devices(text):
    """The 'Character devices' section of /proc/devices -> {name: major}."""
    majors, section = {}, None
    for line in (text or "").splitlines():
        line = line.strip()
        if line.endswith(":"):
            section = line[:-1].lower()
            continue
        parts = line.split()
        if section and section.startswith("character") and len(parts) == 2 and parts[0].isdigit():
            majors[parts[1]] = int(parts[0])
    return majors


def parse_ls_l(text):
    """`ls -l /dev/nvidia*` -> [{'path', 'type', 'major', 'minor', 'mode'}] for every character device.

    Directories given on the command line (/dev/nvidia-caps) are listed as 'dir:' sections whose
    entries are relative names, which we make absolute.
    """
    out, base = [], "/dev"
    for raw in (text or "").splitlines():
        line = raw.rstrip()
        if not line or line.startswith("total "):
            continue
        if line.endswith(":") and " " not in line:
            base = line[:-1]
            continue
        m = LS_LINE.match(line)
        if not m or m.group("type") != "c" or m.group("major") is None:
            continue
        name = m.group("name").strip()
        path = name if name.startswith("/") else f"{base.rstrip('/')}/{name}"
        out.append({"path": path, "type": "c", "major": int(m.group("major")),
                    "minor": int(m.group("minor")), "mode": m.group("mode")})
    return out


def parse_nvidia_smi_l(text):
    """`nvidia-smi -L` -> [{'index', 'name', 'uuid'}]."""
    gpus = []
    for line in (text or "").splitlines():
        m = SMI_GPU.match(line.strip())
        if m:
            gpus.append({"index": int(m.group(1)), "name": m.group(2), "uuid": m.group(3)})
    return gpus


def select_gpu_nodes(nodes, gpus="all"):
    """The /dev/nvidiaN nodes for the chosen GPU minors ('all' or a list of indices), in minor order."""
    gpu_nodes = sorted((n for n in nodes if re.fullmatch(r"/dev/nvidia\d+", n["path"])), key=lambda n: n["minor"])
    if gpus in (None, "all", ["all"]):
        return gpu_nodes
    wanted = [int(g) for g in gpus]
    by_minor = {n["minor"]: n for n in gpu_nodes}
    missing = [g for g in wanted if g not in by_minor]
    if missing:
        raise PveError(f"GPU(s) {missing} not found on the host (it has /dev/nvidia minors "
                       f"{sorted(by_minor)}); fix proxmox_gpu_devices")
    return [by_minor[g] for g in wanted]


def passthrough_nodes(nodes, gpus="all"):
    """Every device node a CUDA container needs: the chosen GPUs, control, UVM, modeset and caps."""
    chosen = select_gpu_nodes(nodes, gpus)
    if not chosen:
        raise PveError("the Proxmox host shows no /dev/nvidia[0-9]* device nodes; is the NVIDIA driver loaded "
                       "(nvidia-smi on the host)?")
    shared = [n for n in nodes if n["path"] in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                                "/dev/nvidia-modeset")
              or n["path"].startswith("/dev/nvidia-caps/")]
    if not any(n["path"] == "/dev/nvidia-uvm" for n in shared):
        raise PveError("/dev/nvidia-uvm is missing on the Proxmox host, so CUDA can't work in the container: "
                       "load nvidia-uvm at boot (echo nvidia-uvm > /etc/modules-load.d/nvidia.conf; "
                       "nvidia-modprobe -u -c0)")
    order = {"/dev/nvidiactl": 0, "/dev/nvidia-uvm": 1, "/dev/nvidia-uvm-tools": 2, "/dev/nvidia-modeset": 3}
    shared.sort(key=lambda n: (order.get(n["path"], 9), n["path"]))
    return chosen + shared


def dev_entries(nodes, mode="0666"):
    """Nodes -> dev[n] entries (dicts) for pve_lxc; PVE finds majors itself at each start."""
    return [{"path": n["path"], "mode": mode} for n in nodes]


def raw_lxc_lines(nodes):
    """Nodes -> the lxc.cgroup2.devices.allow and lxc.mount.entry lines of the raw-config method."""
    allow = []
    for n in nodes:
        if n["major"] == NVIDIA_MAJOR:
            rule = f"c {n['major']}:{n['minor']} rwm"
        else:  # nvidia-uvm / nvidia-caps: dynamic majors, all minors
            rule = f"c {n['major']}:* rwm"
        if rule not in allow:
            allow.append(rule)
    lines = [f"lxc.cgroup2.devices.allow: {rule}" for rule in allow]
    caps_done = False
    for n in nodes:
        if n["path"].startswith("/dev/nvidia-caps/"):
            if not caps_done:
                lines.append("lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir")
                caps_done = True
            continue
        lines.append(f"lxc.mount.entry: {n['path']} {n['path'][1:]} none bind,optional,create=file")
    return lines


def is_managed_raw_line(line, nvidia_majors):
    """Is this conf line one of ours (so we may replace it)? Mount entries of /dev/nvidia* and
    device allows for NVIDIA majors (195 and the host's current uvm/caps majors)."""
    key, _, value = line.partition(":")
    key, value = key.strip(), value.strip()
    if key == "lxc.mount.entry":
        return value.startswith("/dev/nvidia")
    if key == "lxc.cgroup2.devices.allow":
        m = re.match(r"^c\s+(\d+):", value)
        return bool(m) and int(m.group(1)) in nvidia_majors
    return False


def merge_raw_lines(conf_text, desired, nvidia_majors):
    """Put exactly `desired` raw lines in the main section of a PVE container conf.

    Our old lines are dropped, everything else (other lxc.* lines, snapshots) is kept in place; the
    lines go at the end of the main section, before the first [snapshot] section.
    """
    lines = (conf_text or "").splitlines()
    cut = next((i for i, line in enumerate(lines) if line.startswith("[")), len(lines))
    main, rest = lines[:cut], lines[cut:]
    kept = [line for line in main if not is_managed_raw_line(line, nvidia_majors)]
    while kept and not kept[-1].strip():
        kept.pop()
    new = kept + list(desired)
    if rest:
        new += [""] + rest
    return "\n".join(new) + "\n"


SSH_ERRORS = ("ssh:", "Permission denied (", "Host key verification failed", "Connection closed by",
              "Connection reset by", "kex_exchange_identification", "Could not resolve hostname")


def _ssh_failed(stderr):
    """Exit 255 is ssh's own failure, but also what a remote command may return (pct exec)."""
    return any(marker in stderr for marker in SSH_ERRORS)


# ---- running things on the host ---------------------------------------------------------------------
class HostShell:
    """Runs commands on the Proxmox host with the system ssh client (BatchMode: never prompts)."""

    def __init__(self, params):
        if not params.get("ssh_host"):
            raise PveError("this step needs SSH to the Proxmox host: set proxmox_ssh_host (and "
                           "proxmox_ssh_user, proxmox_ssh_port, proxmox_ssh_private_key)")
        self.target = f"{params.get('ssh_user') or 'root'}@{params['ssh_host']}"
        self.port = params.get("ssh_port") or 22
        self.timeout = params.get("ssh_timeout") or 600
        self.base = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-p", str(self.port)]
        if params.get("ssh_private_key"):
            self.base += ["-i", params["ssh_private_key"], "-o", "IdentitiesOnly=yes"]
        options = list(params.get("ssh_options") or [])
        if not any(o.lower().startswith("controlmaster") for o in options):
            # one connection per host for the many short commands (each handshake costs ~0.5 s)
            cp_dir = os.path.expanduser("~/.ansible/cp")
            os.makedirs(cp_dir, mode=0o700, exist_ok=True)
            options += ["ControlMaster=auto", f"ControlPath={cp_dir}/dflash-%C", "ControlPersist=60"]
        for opt in options:
            self.base += ["-o", opt]

    def run(self, command, stdin=None, check=True, what=None):
        """Run a shell command line on the host; returns (rc, stdout, stderr) as text."""
        try:
            proc = subprocess.run(self.base + [self.target, "--", command], input=stdin, capture_output=True,
                                  timeout=self.timeout, stdin=None if stdin is not None else subprocess.DEVNULL,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise PveError(f"{what or command!r} on {self.target} did not finish within {self.timeout} s") from None
        except FileNotFoundError:
            raise PveError("the ssh client is missing on the controller (apt-get install openssh-client)") from None
        out = proc.stdout.decode("utf-8", "replace")
        err = proc.stderr.decode("utf-8", "replace")
        if proc.returncode == 255 and _ssh_failed(err):
            raise PveError(f"SSH to {self.target} port {self.port} failed: {err.strip()[-400:]} (check "
                           f"proxmox_ssh_host, proxmox_ssh_port, proxmox_ssh_user, proxmox_ssh_private_key)")
        if check and proc.returncode != 0:
            raise PveError(f"{what or command!r} failed on {self.target} (exit {proc.returncode}): "
                           f"{(err or out).strip()[-1500:]}", rc=proc.returncode, stdout=out, stderr=err)
        return proc.returncode, out, err

    def run_file_stdin(self, command, path, what=None):
        """Run a command with a local file as stdin (streams; installers are hundreds of MB)."""
        with open(path, "rb") as fh:
            try:
                proc = subprocess.run(self.base + [self.target, "--", command], stdin=fh, capture_output=True,
                                      timeout=self.timeout, check=False)
            except subprocess.TimeoutExpired:
                raise PveError(f"{what or command!r} on {self.target} timed out") from None
        if proc.returncode != 0:
            raise PveError(f"{what or command!r} failed on {self.target} (exit {proc.returncode}): "
                           f"{proc.stderr.decode('utf-8', 'replace').strip()[-800:]}")

    def pct_exec(self, vmid, argv, check=True, what=None):
        """Run argv inside container vmid through `pct exec` (works with no network or SSH inside)."""
        cmd = f"pct exec {int(vmid)} -- " + " ".join(shlex.quote(str(a)) for a in argv)
        return self.run(cmd, check=check, what=what or f"pct exec {vmid} -- {' '.join(map(str, argv))}")
