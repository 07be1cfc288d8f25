"""The node side of a container: PVE config -> real LXC container (create, start, stop, destroy, exec).

Runs inside the test host's mount namespace, where /etc/pve, /var/lib/vz and the lxcpath (/var/lib/lxc-<id>) are the
host's own (bind mounts from its state directory) and /dev holds the stand-in NVIDIA nodes.
Both the API server and `pct` use these functions; the config file is the only state.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import re
import shutil
import stat
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import pveconf, schema

# What PVE's create writes when a key is not given (pve-container API2/LXC.pm create_vm).
CREATE_DEFAULTS = {"arch": "amd64", "memory": "512", "swap": "512"}
UNPRIV_MAP = (100000, 65536)  # lxc.idmap base and size PVE uses for unprivileged CTs
BRIDGES = {"vmbr0"}  # the bridges this node has (net[n] bridge= must name one)
# Changes that a running CT takes at once; everything else becomes pending until the next start
# (pve-container LXC/Config.pm: $LXC_FASTPLUG_OPTIONS, and the cgroup limits vmconfig_hotplug_pending
# changes in place). PVE also hot-plugs net[n], new mp[n] and new dev[n]; the test host leaves those
# pending (README, Known limits).
HOTPLUG = {"description", "onboot", "startup", "protection", "hostname", "hookscript", "cores", "tags", "lock",
           "memory", "swap", "cpulimit", "cpuunits"}
# update_pct_config: 'unprivileged' cannot change after creation, these three cannot be deleted.
READ_ONLY = {"unprivileged"}
REQUIRED = {"memory", "rootfs", "ostype"}
# Keys numbered from 0: mount points, network interfaces, device passthroughs.
MP_KEY, NET_KEY, DEV_KEY = re.compile(r"mp\d+"), re.compile(r"net\d+"), re.compile(r"dev\d+")
# The environment pct exec and the API's exec give a command inside a CT.
ATTACH_ENV = ["--clear-env", "--set-var", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "--set-var", "HOME=/root"]


# pve-storage: Plugin.pm parse_volume_id, parse_volname; Storage.pm $VZTMPL_EXT_RE_1, $ISO_EXT_RE_0
VOLUME_ID_RE = re.compile(r"([a-z][a-z0-9\-_.]*[a-z0-9]):(.+)", re.IGNORECASE)
TEMPLATE_FILE_RE = re.compile(r"[^/]+\.(?:(tar)(?!\.)|tar\.(gz|xz|zst|bz2))")  # groups: the format
VOLNAME_RE = {
    "images": r"\d+/((?:base|vm)-\d+-\S+\.(?:raw|qcow2|vmdk|subvol))",
    "iso": r"iso/([^/]+\.(?i:iso|img))",
    "vztmpl": rf"vztmpl/({TEMPLATE_FILE_RE.pattern})",
    "backup": r"backup/([^/]+\.(?:tgz|(?:tar|vma)(?:\.(?:gz|lzo|zst|bz2|xz))?))",
    "snippets": r"snippets/([^/]+)",
}


class PveError(Exception):
    """An error PVE reports as HTTP 500 with this text (or a failed task's exitstatus)."""


class PermError(Exception):
    """HTTP 403 'Permission check failed (...)'."""


@dataclass(frozen=True)
class NodePaths:
    etc_pve: Path = Path("/etc/pve")
    storage: Path = Path("/var/lib/vz")
    lxcpath: Path = Path("/var/lib/lxc")
    devroot: Path = Path("/dev")
    procfs: Path | None = None  # stand-in /proc/driver and /proc/devices to show inside the CTs

    def conf(self, vmid: int) -> Path:
        return self.etc_pve / "lxc" / f"{vmid}.conf"

    def template_dir(self) -> Path:
        return self.storage / "template" / "cache"

    def images(self, vmid: int) -> Path:
        return self.storage / "images" / str(vmid)


def parse_size(text: str | None) -> int:
    """pve-common JSONSchema.pm parse_size: '8G' -> bytes (0 when there is no size)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT](?:iB)?)?", text or "")
    if not m:
        return 0
    return int(float(m[1]) * 1024 ** ("BKMGT".index(m[2][0]) if m[2] else 0))


def process_uptime(pid: int) -> int:
    """Seconds since pid started, as vmstatus computes it from /proc/uptime and /proc/<pid>/stat."""
    try:
        started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0
    return max(0, int(uptime - started / os.sysconf("SC_CLK_TCK")))


def indexed_keys(values: dict, pattern: re.Pattern) -> list[str]:
    """The keys of values that pattern matches (net0, net1 ...), in their numeric order."""
    return sorted((k for k in values if pattern.fullmatch(k)), key=lambda k: int(re.sub(r"\D", "", k)))


def cgroup_layout() -> str:
    """'unified' on a pure cgroup v2 host (like PVE 8/9), else 'legacy' (devices controller in v1)."""
    return "unified" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "legacy"


def lxcpath_for(state: str | os.PathLike | None) -> Path:
    """The LXC path of the host with this state dir: /var/lib/lxc-<hash of the state dir>.

    LXC names a container's command socket after its lxcpath and name, machine-wide; a path of
    its own keeps CT 100 of this host apart from CT 100 of another test host running beside it,
    and stays the same across restarts so that a restart can still stop a dead run's CTs.
    """
    if state is None:
        return Path("/var/lib/lxc")
    digest = hashlib.sha1(str(Path(state).resolve()).encode()).hexdigest()[:8]
    return Path(f"/var/lib/lxc-{digest}")


def default_paths() -> NodePaths:
    lxcpath = lxcpath_for(os.environ.get("PVE_TESTHOST_STATE"))
    # The stand-ins live under the lxcpath so an unprivileged CT's root can reach them (the state
    # dir itself may sit below a 0700 directory such as pytest's tmp).
    procfs = lxcpath / ".procfs"
    return NodePaths(lxcpath=lxcpath, procfs=procfs if (procfs / "devices").exists() else None)


def check_changeable(new: dict[str, str], delete: list[str]) -> None:
    """update_pct_config: required keys cannot go, read-only ones cannot change."""
    for key in delete:
        if key in REQUIRED:
            raise PveError(f"unable to delete required option '{key}'")
        if key in READ_ONLY:
            raise PveError(f"unable to delete read-only option: '{key}'")
    for key in new:
        if key in READ_ONLY:
            raise PveError(f"unable to modify read-only option: '{key}'")


def set_value(conf: pveconf.CtConfig, key: str, value: str, running: bool) -> None:
    """A running CT takes the hot-pluggable keys at once; the others wait in [pve:pending] for a start."""
    if key == "description":
        conf.description = value  # a comment block, fast-plugged
    elif running and key not in HOTPLUG:
        conf.pending[key] = value
    else:
        conf.values[key] = value


def delete_value(conf: pveconf.CtConfig, key: str, running: bool) -> None:
    if key == "description":
        conf.description = ""
    elif running and key not in HOTPLUG:
        if key not in conf.pending_delete:
            conf.pending_delete.append(key)
    else:
        conf.values.pop(key, None)
        conf.pending.pop(key, None)


def net_lines(v: dict[str, str]) -> list[str]:
    """net[n]: veth pairs in the order of their numbers (the host side gets LXC's random vethXXXXXX name)."""
    nets = indexed_keys(v, NET_KEY)
    lines = []
    for i, key in enumerate(nets):
        net = schema.parse_config_value(key, v[key])
        if net.get("bridge") and net["bridge"] not in BRIDGES:
            raise PveError(f"bridge '{net['bridge']}' does not exist")
        lines += [f"lxc.net.{i}.type = veth", f"lxc.net.{i}.name = {net['name']}",
                  f"lxc.net.{i}.hwaddr = {net['hwaddr']}"]
        if not net.get("link_down"):
            lines.append(f"lxc.net.{i}.flags = up")
    return lines or ["lxc.net.0.type = empty"]


def raw_lxc_lines(conf: pveconf.CtConfig, layout: str, log) -> list[str]:
    """Raw lines from /etc/pve/lxc/<vmid>.conf take effect as written (PVE appends them last)."""
    lines = []
    for key, value in conf.lxc:
        if key.startswith("lxc.cgroup."):
            log(f"WARN: '{key}' is a cgroup v1 key and has no effect on this (cgroup v2) node; "
                f"use 'lxc.cgroup2.{key[len('lxc.cgroup.'):]}'")
            continue
        if key.startswith("lxc.cgroup2.") and layout == "legacy" and key.startswith("lxc.cgroup2.devices."):
            # This machine keeps the devices controller in cgroup v1; the rule means the same there.
            key = "lxc.cgroup." + key[len("lxc.cgroup2."):]
        lines.append(f"{key} = {value}")
    return lines


class Node:
    def __init__(self, paths: NodePaths | None = None, name: str = "pve", storage_id: str = "local"):
        paths = paths or default_paths()
        self.paths = paths
        self.name = name
        self.storage_id = storage_id
        (paths.etc_pve / "lxc").mkdir(parents=True, exist_ok=True)
        paths.template_dir().mkdir(parents=True, exist_ok=True)
        (paths.storage / "images").mkdir(parents=True, exist_ok=True)
        (paths.lxcpath / ".locks").mkdir(parents=True, exist_ok=True)

    # --- config ------------------------------------------------------------------------------------
    def exists(self, vmid: int) -> bool:
        return self.paths.conf(vmid).exists()

    def vmids(self) -> list[int]:
        return sorted(int(p.stem) for p in (self.paths.etc_pve / "lxc").glob("*.conf") if p.stem.isdigit())

    def read(self, vmid: int) -> pveconf.CtConfig:
        try:
            return pveconf.read(self.paths.conf(vmid))
        except FileNotFoundError:
            raise PveError(f"Configuration file 'nodes/{self.name}/lxc/{vmid}.conf' does not exist") from None

    @contextmanager
    def locked(self, vmid: int):
        with open(self.paths.lxcpath / ".locks" / f"{vmid}.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    # --- volumes -----------------------------------------------------------------------------------
    def volume_path(self, volid: str) -> Path:
        """local:<vmid>/vm-<vmid>-disk-N.raw -> a directory under images/ (we back disks with dirs)."""
        storage, _, name = volid.partition(":")
        if storage != self.storage_id:
            raise PveError(f"storage '{storage}' does not exist")
        return self.paths.storage / "images" / name

    def volume_type(self, volid: str) -> tuple[str, str]:
        """(content type, file name) of a volume id of our storage (pve-storage Plugin.pm parse_volname)."""
        storage, _, volname = volid.partition(":")
        if storage != self.storage_id:
            raise PveError(f"storage '{storage}' does not exist")
        for vtype, rx in VOLNAME_RE.items():
            if m := re.fullmatch(rx, volname):
                return vtype, m[1]
        raise PveError(f"unable to parse directory volume name '{volname}'")

    def check_volume_access(self, volid: str, user: str, content: str) -> None:
        """What PVE checks before a create task starts (pve-storage Storage.pm check_volume_access)."""
        if not VOLUME_ID_RE.fullmatch(volid):
            if user != "root@pam":
                raise PveError("Only root can pass arbitrary filesystem paths.")
            return
        vtype, _ = self.volume_type(volid)
        if vtype != content:
            raise PveError(f"unable to use volume {volid} - content type needs to be '{content}'")

    def template_path(self, volid: str) -> Path:
        """The file of a template, as the create task finds it (Storage.pm abs_filesystem_path)."""
        if not VOLUME_ID_RE.fullmatch(volid):
            if not Path(volid).is_file():
                raise PveError(f"can't find file '{volid}'")
            return Path(volid).resolve()
        vtype, name = self.volume_type(volid)
        path = self.paths.template_dir() / name if vtype == "vztmpl" else self.paths.storage / volid.partition(":")[2]
        if not path.exists():  # Plugin.pm activate_volume
            raise PveError(f"volume '{volid}' does not exist")
        return path

    def allocate_disk(self, vmid: int, size: str, index: int) -> str:
        name = f"{vmid}/vm-{vmid}-disk-{index}.raw"
        path = self.paths.storage / "images" / name
        path.mkdir(parents=True, exist_ok=True)
        return f"{self.storage_id}:{name}"

    def normalise_mountpoint(self, vmid: int, key: str, value: str, index: int) -> str:
        """`local:8` (allocate) becomes `local:<vmid>/vm-<vmid>-disk-N.raw,size=8G`, as in PVE."""
        data = schema.parse_config_value(key, value)
        vol = data.get("volume", "")
        m = schema.NEW_DISK_RE.match(vol)
        if m:
            size = m[2]
            data["volume"] = self.allocate_disk(vmid, size, index)
            data["size"] = f"{size}G" if re.fullmatch(r"\d+", size) else size
        elif schema.mountpoint_type(vol) == "bind" and not Path(vol).is_dir():
            raise PveError(f"mount point '{vol}' does not exist")
        return schema.print_config_value(key, data)

    def next_disk_index(self, conf: pveconf.CtConfig) -> int:
        used = [int(m[1]) for v in list(conf.values.values()) + list(conf.pending.values())
                if (m := re.search(r"vm-\d+-disk-(\d+)", v))]
        return max(used, default=-1) + 1

    # --- permission rules (pve-container PVE::LXC::check_ct_modify_config_perm) ----------------------
    @staticmethod
    def check_modify_perm(user: str, old: pveconf.CtConfig | None, new: dict[str, str], delete: list[str],
                          unprivileged: bool) -> None:
        if user == "root@pam":
            return
        items = [(k, v, False) for k, v in new.items()] + [(k, None, True) for k in delete]
        for key, value, is_delete in items:
            if (key == "rootfs" or MP_KEY.fullmatch(key)) and not is_delete:
                mtype = schema.mountpoint_type(schema.parse_config_value(key, value).get("volume", ""))
                if mtype != "volume":
                    raise PermError(f"mount point type {mtype} is only allowed for root@pam")
            elif DEV_KEY.fullmatch(key):
                raise PermError("configuring device passthrough is only allowed for root@pam")
            elif key == "hookscript":
                raise PermError("changing the hookscript is only allowed for root@pam")
            elif key == "features":
                Node.check_features_perm(old, value, is_delete, unprivileged)

    @staticmethod
    def check_features_perm(old: pveconf.CtConfig | None, value: str | None, is_delete: bool,
                            unprivileged: bool) -> None:
        """A user other than root@pam may only switch nesting, and only on an unprivileged CT."""
        if not unprivileged:
            raise PermError("changing feature flags for privileged container is only allowed for root@pam")
        oldf = schema.parse_config_value("features", old.values["features"]) \
            if old is not None and old.values.get("features") else {}
        newf = {} if is_delete else schema.parse_config_value("features", value)
        changed = {k for k in set(oldf) | set(newf) if str(oldf.get(k, "")) != str(newf.get(k, ""))}
        if is_delete:
            changed = set(oldf)
        if changed - {"nesting"}:
            raise PermError("changing feature flags (except nesting) is only allowed for root@pam")

    # --- create --------------------------------------------------------------------------------------
    def create(self, vmid: int, params: dict, user: str, log) -> None:
        """The vzcreate task: unpack the template into the rootfs and write the PVE config.

        Errors come without PVE's "unable to create CT <vmid> - " prefix; the API's task adds it.
        """
        unpriv = bool(int(params.get("unprivileged", 1)))
        conf = self.initial_config(vmid, params, unpriv)
        rootfs = self.volume_path(schema.parse_config_value("rootfs", conf.values["rootfs"])["volume"])
        base = UNPRIV_MAP[0] if unpriv else 0
        os.chown(rootfs, base, base)
        self.unpack_template(vmid, params, rootfs, unpriv, log)
        ostype = self.detect_ostype(rootfs)
        log(f"Detected OS distribution as '{ostype}'")
        conf.values.setdefault("ostype", ostype)
        self.setup_guest(rootfs, conf, params, base)
        pveconf.write(self.paths.conf(vmid), conf)

    def initial_config(self, vmid: int, params: dict, unpriv: bool) -> pveconf.CtConfig:
        """The config create_vm writes: the given keys over the defaults, volumes allocated, nets completed."""
        values: dict[str, str] = dict(CREATE_DEFAULTS)
        skip = {"node", "vmid", "ostemplate", "password", "ssh-public-keys", "storage", "start", "force",
                "restore", "unique", "ignore-unpack-errors", "bwlimit", "pool", "ha-managed", "description",
                "unprivileged"}
        for k, v in params.items():
            if k not in skip:
                values[k] = str(v)
        if unpriv:  # create_vm writes the key only for unprivileged CTs
            values["unprivileged"] = "1"
        values.setdefault("hostname", f"CT{vmid}")
        conf = pveconf.CtConfig(values=values, description=str(params.get("description", "")))
        storage = params.get("storage", self.storage_id)
        conf.values["rootfs"] = self.normalise_mountpoint(
            vmid, "rootfs", str(params.get("rootfs", f"{storage}:4")), 0)
        # PVE's order: mount points (as sorted strings), then network interfaces, then devices
        keys = sorted(k for k in values if MP_KEY.fullmatch(k)) + [k for k in values if NET_KEY.fullmatch(k)] \
            + [k for k in values if DEV_KEY.fullmatch(k)]
        for key in keys:
            conf.values[key] = self.normalise_value(vmid, conf, key, conf.values[key])
        return conf

    def unpack_template(self, vmid: int, params: dict, rootfs: Path, unpriv: bool, log) -> None:
        """Extract the ostemplate into rootfs (through the id map for an unprivileged CT)."""
        try:
            template = self.template_path(params["ostemplate"])
        except PveError as exc:
            log(str(exc))  # LXC/Create.pm archive_is_oci_format warns it, restore_archive dies with it
            raise
        log(f"extracting archive '{template}'")
        cmd = ["tar", "xpf", str(template), "--totals", "--one-file-system", "--numeric-owner",
               "-C", str(rootfs), "--skip-old-files", "--anchored", "--exclude", "./dev/*"]
        if unpriv:
            cmd = ["lxc-usernsexec", "-m", f"u:0:{UNPRIV_MAP[0]}:{UNPRIV_MAP[1]}",
                   "-m", f"g:0:{UNPRIV_MAP[0]}:{UNPRIV_MAP[1]}", "--"] + cmd
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        for line in (res.stdout + res.stderr).splitlines():
            log(line)
        if res.returncode != 0 and not params.get("ignore-unpack-errors"):
            shutil.rmtree(self.paths.images(vmid), ignore_errors=True)
            raise PveError(f"command '{' '.join(cmd)}' failed: exit code {res.returncode}")

    @staticmethod
    def detect_ostype(rootfs: Path) -> str:
        osr = rootfs / "etc" / "os-release"
        if osr.is_file():
            m = re.search(r"^ID=\"?([a-z]+)", osr.read_text(errors="replace"), re.MULTILINE)
            if m and m[1] in schema.method_schema("/nodes/{node}/lxc", "POST")["parameters"]["properties"][
                    "ostype"]["enum"]:
                return m[1]
        return "unmanaged"

    @staticmethod
    def setup_guest(rootfs: Path, conf: pveconf.CtConfig, params: dict, base: int) -> None:
        """What PVE's setup plugin does that matters here: hostname and root's authorized_keys."""
        etc = rootfs / "etc"
        if etc.is_dir() and not etc.is_symlink():
            (etc / "hostname").write_text(conf.values["hostname"] + "\n")
            os.chown(etc / "hostname", base, base)
        if params.get("ssh-public-keys"):
            ssh = rootfs / "root" / ".ssh"
            ssh.mkdir(parents=True, exist_ok=True)
            (ssh / "authorized_keys").write_text(str(params["ssh-public-keys"]).strip() + "\n")
            for p in (ssh, ssh / "authorized_keys"):
                os.chown(p, base, base)
            os.chmod(ssh, 0o700)

    def normalise_net(self, value: str) -> str:
        data = schema.parse_config_value("net0", value)
        data.setdefault("type", "veth")
        if "hwaddr" not in data:  # PVE generates one with Proxmox's OUI prefix BC:24:11
            data["hwaddr"] = "BC:24:11:" + ":".join(f"{random.randrange(256):02X}" for _ in range(3))
        return schema.print_config_value("net0", data)

    def check_dev(self, value: str) -> os.stat_result:
        data = schema.parse_config_value("dev0", value)
        path = data.get("path")
        if not path:
            raise PveError("Path is not defined")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise PveError(f"Device {path} does not exist") from None
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise PveError(f"{path} is not a device")  # LXC/Tools.pm get_device_mode_and_rdev
        return st

    # --- config updates (PUT config, pct set) --------------------------------------------------------
    def update_config(self, vmid: int, new: dict[str, str], delete: list[str], user: str,
                      digest: str | None = None, revert: list[str] = (), log=None) -> None:
        """PUT config / pct set (pve-container API2/LXC/Config.pm update_vm, LXC/Config.pm update_pct_config)."""
        with self.locked(vmid):
            conf = self.read(vmid)
            if conf.values.get("lock"):
                raise PveError(f"CT is locked ({conf.values['lock']})")
            if digest and digest != conf.digest:
                raise PveError("detected modified configuration - file changed by other user? Try again.")
            self.check_modify_perm(user, conf, new, delete, conf.values.get("unprivileged") == "1")
            delete = self.deletable_keys(conf, delete, log)
            check_changeable(new, delete)
            running = self.status(vmid) == "running"
            for key in revert:
                conf.pending.pop(key, None)
                if key in conf.pending_delete:
                    conf.pending_delete.remove(key)
            for key, value in new.items():
                set_value(conf, key, self.normalise_value(vmid, conf, key, str(value)), running)
            for key in delete:
                delete_value(conf, key, running)
            pveconf.write(self.paths.conf(vmid), conf)

    @staticmethod
    def deletable_keys(conf: pveconf.CtConfig, delete: list[str], log) -> list[str]:
        """The keys of delete that are set; PVE warns of the others (to its log, not to the caller) and goes on."""
        unset = [k for k in delete if k not in conf.values and k not in conf.pending
                 and not (k == "description" and conf.description)]
        for key in unset:
            if log is not None:
                log(f"cannot delete '{key}' - not set in current configuration!")
        return [k for k in delete if k not in unset]

    def normalise_value(self, vmid: int, conf: pveconf.CtConfig, key: str, value: str) -> str:
        """A new config value as PVE stores it: volumes allocated, a net's hwaddr added, a device checked."""
        if key == "rootfs" or MP_KEY.fullmatch(key):
            return self.normalise_mountpoint(vmid, key, value, self.next_disk_index(conf))
        if NET_KEY.fullmatch(key):
            return self.normalise_net(value)
        if DEV_KEY.fullmatch(key):
            self.check_dev(value)
        return value

    # --- the LXC side ----------------------------------------------------------------------------------
    def lxc_dir(self, vmid: int) -> Path:
        return self.paths.lxcpath / str(vmid)

    def status(self, vmid: int) -> str:
        res = subprocess.run(["lxc-info", "-n", str(vmid), "-P", str(self.paths.lxcpath), "-s", "-H"],
                             capture_output=True, text=True, check=False)
        return "running" if res.stdout.strip() in ("RUNNING", "STARTING", "STOPPING") else "stopped"

    def pid(self, vmid: int) -> int | None:
        res = subprocess.run(["lxc-info", "-n", str(vmid), "-P", str(self.paths.lxcpath), "-p", "-H"],
                             capture_output=True, text=True, check=False)
        return int(res.stdout.strip()) if res.stdout.strip().isdigit() else None

    def lxc_config(self, vmid: int, conf: pveconf.CtConfig, log) -> str:
        """Translate the PVE config into an LXC config, the way PVE's update_lxc_config does."""
        v = conf.values
        unpriv = v.get("unprivileged") == "1"
        base = UNPRIV_MAP[0] if unpriv else 0
        layout = cgroup_layout()
        cg = "lxc.cgroup2" if layout == "unified" else "lxc.cgroup"
        lines = self.base_lines(vmid, v)
        if not any(k == "lxc.idmap" for k, _ in conf.lxc) and unpriv:
            lines += [f"lxc.idmap = u 0 {UNPRIV_MAP[0]} {UNPRIV_MAP[1]}",
                      f"lxc.idmap = g 0 {UNPRIV_MAP[0]} {UNPRIV_MAP[1]}"]
        mem = int(v.get("memory", 512)) * 1024 * 1024
        lines.append(f"{cg}.memory.max = {mem}" if layout == "unified"
                     else f"{cg}.memory.limit_in_bytes = {mem}")
        lines += net_lines(v)
        lines += self.mount_lines(v, base, log)
        lines += self.device_lines(vmid, v, base, cg)
        if self.paths.procfs is not None:
            lines += [f"lxc.mount.entry = {self.paths.procfs / 'driver'} proc/driver none bind,optional 0 0",
                      f"lxc.mount.entry = {self.paths.procfs / 'devices'} proc/devices none bind,optional 0 0"]
        lines += raw_lxc_lines(conf, layout, log)
        return "\n".join(lines) + "\n"

    def base_lines(self, vmid: int, v: dict[str, str]) -> list[str]:
        """The container's name, rootfs, mounts of proc/sys/cgroup, ttys and console."""
        rootfs = self.volume_path(schema.parse_config_value("rootfs", v["rootfs"])["volume"])
        features = schema.parse_config_value("features", v["features"]) if v.get("features") else {}
        return [
            f"# generated by the PVE test host from /etc/pve/lxc/{vmid}.conf",
            f"lxc.uts.name = {v.get('hostname', f'CT{vmid}')}",
            f"lxc.rootfs.path = dir:{rootfs}",
            "lxc.mount.auto = " + ("proc:rw sys:rw cgroup:rw" if features.get("nesting")
                                   else "proc:mixed sys:mixed cgroup:mixed"),
            "lxc.autodev = 1",
            f"lxc.tty.max = {v.get('tty', 2)}",
            "lxc.pty.max = 1024",
            "lxc.signal.halt = SIGPWR",
            # PVE loads its own AppArmor profile; a machine without it (or without AppArmor) runs unconfined.
            "lxc.apparmor.profile = unconfined",
            f"lxc.console.logfile = {self.lxc_dir(vmid) / 'console.log'}",
        ]

    def mount_lines(self, v: dict[str, str], base: int, log) -> list[str]:
        """mp[n]: volumes and host directories bind-mounted in (device mount points are left out)."""
        lines = []
        for key in indexed_keys(v, MP_KEY):
            mp = schema.parse_config_value(key, v[key])
            target = mp["mp"].lstrip("/")
            mtype = schema.mountpoint_type(mp["volume"])
            opts = "ro," if mp.get("ro") else ""
            if mtype == "volume":
                src = self.volume_path(mp["volume"])
                if src.stat().st_uid != base:
                    os.chown(src, base, base)
                lines.append(f"lxc.mount.entry = {src} {target} none {opts}bind,create=dir 0 0")
            elif mtype == "bind":
                lines.append(f"lxc.mount.entry = {mp['volume']} {target} none {opts}rbind,create=dir 0 0")
            else:
                log(f"WARN: device mount point {key} ({mp['volume']}) is not mounted by the test host")
        return lines

    def device_lines(self, vmid: int, v: dict[str, str], base: int, cg: str) -> list[str]:
        """dev[n]: a private node with the requested owner and mode, bind-mounted in, plus a cgroup rule."""
        passdir = self.lxc_dir(vmid) / "passthrough"
        shutil.rmtree(passdir, ignore_errors=True)
        lines = []
        for key in indexed_keys(v, DEV_KEY):
            dev = schema.parse_config_value(key, v[key])
            st = self.check_dev(v[key])
            kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
            rel = dev["path"].removeprefix("/dev/")
            node = passdir / "dev" / rel
            node.parent.mkdir(parents=True, exist_ok=True)
            mode = int(str(dev.get("mode", "0660")), 8)
            os.mknod(node, mode | (stat.S_IFCHR if kind == "c" else stat.S_IFBLK), st.st_rdev)
            os.chmod(node, mode)
            os.chown(node, base + int(dev.get("uid", 0)), base + int(dev.get("gid", 0)))
            access = "r" if dev.get("deny-write") else "rw"
            lines.append(f"{cg}.devices.allow = {kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {access}")
            lines.append(f"lxc.mount.entry = {node} dev/{rel} none bind,create=file 0 0")
        return lines

    def start(self, vmid: int, log) -> None:
        """The vzstart task (pve-container API2/LXC/Status.pm vm_start, LXC.pm vm_start)."""
        with self.locked(vmid):
            if self.status(vmid) == "running":
                raise PveError(f"CT {vmid} already running")
            conf = self.read(vmid)
            if conf.values.get("template") == "1":
                raise PveError("you can't start a CT if it's a template")
            if conf.values.get("lock") and conf.values["lock"] != "mounted":
                raise PveError(f"CT is locked ({conf.values['lock']})")
            if conf.pending or conf.pending_delete:
                pveconf.apply_pending(conf)
                pveconf.write(self.paths.conf(vmid), conf)
            d = self.lxc_dir(vmid)
            d.mkdir(parents=True, exist_ok=True)
            (d / "config").write_text(self.lxc_config(vmid, conf, log))
            logfile = d / "lxc-start.log"
            logfile.unlink(missing_ok=True)
            res = subprocess.run(["lxc-start", "-n", str(vmid), "-P", str(self.paths.lxcpath), "-d",
                                  "-l", "ERROR", "-o", str(logfile)], capture_output=True, text=True, check=False)
            if res.returncode != 0:
                for line in (res.stderr.splitlines()
                             + (logfile.read_text(errors="replace").splitlines() if logfile.exists() else [])):
                    log(line)
                raise PveError(f"startup for container '{vmid}' failed")

    def stop(self, vmid: int, log, *, timeout: int | None = None, force: bool = True,
             check_lock: bool = False) -> None:
        """timeout=None: hard stop (vzstop). Otherwise a clean shutdown, killed after timeout if force
        (pve-container LXC.pm vm_stop: lxc-stop --kill, or [--nokill] --timeout N)."""
        with self.locked(vmid):
            conf = self.read(vmid)
            if check_lock and conf.values.get("lock"):
                raise PveError(f"CT is locked ({conf.values['lock']})")
            if self.status(vmid) != "running":
                return  # vm_stop returns quietly for a CT that is not running
            cmd = ["lxc-stop", "-n", str(vmid)]
            if timeout is None:
                cmd.append("--kill")
            else:
                cmd += ([] if force else ["--nokill"]) + ["--timeout", str(timeout)]
            res = subprocess.run(cmd[:3] + ["-P", str(self.paths.lxcpath)] + cmd[3:], capture_output=True,
                                 text=True, check=False)
            if res.returncode != 0:
                log(f"command '{' '.join(cmd)}' failed: exit code {res.returncode}")
            if self.status(vmid) == "running":
                raise PveError("container did not stop")

    def check_destroy(self, vmid: int, conf: pveconf.CtConfig, force: bool) -> None:
        """destroy_vm's early checks (pve-container API2/LXC.pm): protection, lock, running."""
        if conf.values.get("protection") == "1":
            raise PveError(f"can't remove CT {vmid} - protection mode enabled")
        if conf.values.get("lock"):
            raise PveError(f"CT is locked ({conf.values['lock']})")
        if not force and self.status(vmid) == "running":
            raise PveError(f"unable to destroy CT {vmid} - container is running")

    def destroy(self, vmid: int, log, *, force: bool = False) -> None:
        """The vzdestroy task."""
        with self.locked(vmid):
            conf = self.read(vmid)
            self.check_destroy(vmid, conf, force)
            if self.status(vmid) == "running":
                log(f"forced to stop CT {vmid} before destroying!")
            self.remove(vmid)

    def remove(self, vmid: int) -> None:
        """Stop and delete a CT with no checks (the test host's own cleanup)."""
        if self.status(vmid) == "running":
            subprocess.run(["lxc-stop", "-n", str(vmid), "-P", str(self.paths.lxcpath), "--kill"],
                           capture_output=True, check=False)
        shutil.rmtree(self.paths.images(vmid), ignore_errors=True)
        shutil.rmtree(self.lxc_dir(vmid), ignore_errors=True)
        self.paths.conf(vmid).unlink(missing_ok=True)

    def exec(self, vmid: int, argv: list[str], *, input: bytes | None = None, timeout: float = 120):
        if self.status(vmid) != "running":
            raise PveError(f"CT {vmid} not running")
        return subprocess.run(self.attach_command(vmid, argv), input=input, capture_output=True, timeout=timeout,
                              check=False)

    def attach_command(self, vmid: int, argv: list[str]) -> list[str]:
        """lxc-attach running argv in the CT with a clean environment."""
        return ["lxc-attach", "-n", str(vmid), "-P", str(self.paths.lxcpath)] + ATTACH_ENV + ["--"] + argv

    def status_current(self, vmid: int) -> dict:
        """One CT's entry of pve-container LXC.pm vmstatus (GET status/current, GET /nodes/{node}/lxc)."""
        conf = self.read(vmid)
        v = conf.values
        pid = self.pid(vmid) if self.status(vmid) == "running" else None
        rootfs = schema.parse_config_value("rootfs", v["rootfs"]) if v.get("rootfs") else {}
        d = {"vmid": vmid, "type": "lxc", "status": "running" if pid else "stopped",
             "name": re.sub(r"\s", "", v.get("hostname") or f"CT{vmid}"),
             "cpus": int(v["cores"]) if v.get("cores") else float(v["cpulimit"]) if v.get("cpulimit")
             else os.cpu_count() or 1,
             # a stopped CT reports its rootfs size (4 GiB when it has none); a running one its
             # filesystem as df sees it, which for our directory-backed rootfs is the size as well
             "disk": 0, "maxdisk": parse_size(rootfs.get("size")) or 4 * 1024 ** 3,
             "mem": 0, "swap": 0, "maxmem": int(v.get("memory") or 512) * 1024 * 1024,
             "maxswap": int(v.get("swap") or 0) * 1024 * 1024,
             "uptime": 0, "cpu": 0, "netout": 0, "netin": 0, "diskread": 0, "diskwrite": 0}
        if v.get("tags"):
            d["tags"] = v["tags"]
        if v.get("template") == "1":
            d["template"] = 1
        if v.get("lock"):
            d["lock"] = v["lock"]
        if pid:
            d["pid"] = pid
            d["uptime"] = process_uptime(pid)
            d["mem"], d["swap"] = self.memory_use(vmid)
        return d

    def memory_use(self, vmid: int) -> tuple[int, int]:
        """(mem, swap) as PVE's CGroup::get_memory_stat reads them: memory.current less page cache."""
        def read(key: str) -> str:
            res = subprocess.run(["lxc-cgroup", "-n", str(vmid), "-P", str(self.paths.lxcpath), key],
                                 capture_output=True, text=True, check=False)
            return res.stdout if res.returncode == 0 else ""
        if cgroup_layout() == "unified":
            current, swap, stat_text = read("memory.current"), read("memory.swap.current"), read("memory.stat")
            file_bytes = "file"
        else:
            current, swap, stat_text = read("memory.usage_in_bytes"), "", read("memory.stat")
            file_bytes = "total_cache"
        stat_values = dict(line.split()[:2] for line in stat_text.splitlines() if len(line.split()) >= 2)
        mem = int(current) - int(stat_values.get(file_bytes, 0)) if current.strip().isdigit() else 0
        return max(mem, 0), int(swap) if swap.strip().isdigit() else 0
