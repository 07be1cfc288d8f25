# Pure logic for LXC configs: PVE property strings, the desired config built from module
# parameters, and the diff against what the API reports. No I/O here, so it is unit-tested alone.
from __future__ import annotations

import re

# Keys PVE fills in itself when absent from a request; absent from the desired value means "don't care".
AUTO_FILLED = {"net": {"hwaddr", "type"}}
# What GET config omits when the value is PVE's default.
DEFAULTS = {"memory": "512", "swap": "512", "onboot": "0", "unprivileged": "0", "protection": "0"}
# Only settable at creation; a different value on an existing container is an error, not an update.
CREATE_ONLY = ("unprivileged", "ostype", "arch")
# Changes PVE applies to a running container at once; anything else waits as a pending change
# (pve-container $LXC_FASTPLUG_OPTIONS and the cgroup limits; nameserver, searchdomain, timezone wait).
HOTPLUG = {"memory", "swap", "cores", "cpulimit", "cpuunits", "onboot", "startup", "tags",
           "description", "protection", "hostname"}
# Keys whose indexed families we own completely: extra netN / devN entries are deleted.
OWNED_FAMILIES = ("net", "dev")
DNS_NAME = re.compile(r"^(?=.{1,255}$)[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*$")
SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)$")
MODE = re.compile(r"^0[0-7]{3}$")
VMID_MIN, VMID_MAX = 100, 999999999


class ConfigError(ValueError):
    """A bad input value; the message names the variable and the fix."""


def family(key):
    """'net0' -> 'net', 'memory' -> 'memory'."""
    m = re.match(r"^([a-z]+?)(\d+)$", key)
    return m.group(1) if m else key


def parse_propstring(text, default_key=None):
    """'/dev/nvidia0,mode=0666' -> {'path': '/dev/nvidia0', 'mode': '0666'}."""
    out = {}
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
        elif default_key:
            out[default_key] = item
        else:
            raise ConfigError(f"property string {text!r}: item {item!r} is not key=value")
    return out


def build_propstring(props, default_key=None):
    """Inverse of parse_propstring; the default key goes first without 'key=', the rest sorted."""
    parts = []
    if default_key and props.get(default_key) is not None:
        parts.append(str(props[default_key]))
    for k in sorted(props):
        if k == default_key or props[k] is None:
            continue
        parts.append(f"{k}={_scalar(props[k])}")
    return ",".join(parts)


def _scalar(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def size_in_gib(text):
    """PVE disk sizes ('8G', '8192M', '1T', '0.5G', bare number = GiB for requests) -> float GiB."""
    m = SIZE.match(str(text).strip())
    if not m:
        raise ConfigError(f"disk size {text!r} is not a size such as 8G or 8192M")
    factor = {"": 1, "K": 1 / (1024 * 1024), "M": 1 / 1024, "G": 1, "T": 1024}[m.group(2)]
    return float(m.group(1)) * factor


def validate_vmid(vmid):
    try:
        value = int(vmid)
    except (TypeError, ValueError):
        raise ConfigError(f"vmid {vmid!r} is not a number; set proxmox_lxc_vmid to an integer "
                          f"between {VMID_MIN} and {VMID_MAX}") from None
    if not VMID_MIN <= value <= VMID_MAX or str(vmid).strip() != str(value):
        raise ConfigError(f"vmid {vmid!r} is out of range; Proxmox VE accepts {VMID_MIN}..{VMID_MAX} "
                          f"(set proxmox_lxc_vmid)")
    return value


def normalize_device(dev):
    """A device entry (dict or 'path,key=val' string) -> normalized dict with string values."""
    props = parse_propstring(dev, "path") if isinstance(dev, str) else dict(dev)
    props = {k.replace("_", "-"): v for k, v in props.items() if v is not None}
    path = str(props.get("path", ""))
    if not path.startswith("/dev/"):
        raise ConfigError(f"device {dev!r}: path must be a device node under /dev/")
    if "mode" in props:
        props["mode"] = str(props["mode"])
        if not MODE.match(props["mode"]):
            raise ConfigError(f"device {path}: mode {props['mode']!r} must be octal like 0666 (quote it in YAML)")
    for k in ("uid", "gid"):
        if k in props:
            props[k] = str(int(props[k]))
    if "deny-write" in props:
        props["deny-write"] = _scalar(bool(int(props["deny-write"])) if str(props["deny-write"]).isdigit()
                                      else bool(props["deny-write"]))
    unknown = set(props) - {"path", "mode", "uid", "gid", "deny-write"}
    if unknown:
        raise ConfigError(f"device {path}: unknown option(s) {sorted(unknown)}; allowed: mode, uid, gid, deny_write")
    return props


def normalize_net(net):
    props = parse_propstring(net) if isinstance(net, str) else dict(net)
    props = {k: _scalar(v) for k, v in props.items() if v is not None}
    if "name" not in props:
        raise ConfigError(f"network {net!r} needs a name (e.g. name: eth0)")
    return props


# Plain options in the order they enter the config: numbers and flags when set (0 and false count),
# text when not empty.
NUMBER_OPTIONS = ("cores", "memory", "swap", "cpulimit", "cpuunits")
FLAG_OPTIONS = ("onboot", "unprivileged")
TEXT_OPTIONS = ("nameserver", "searchdomain", "timezone", "ostype", "arch", "startup")


def desired_config(p):
    """Module parameters -> {key: PVE string value} for the keys we manage (create-only ones too)."""
    _check_host_and_limits(p)
    cfg = {"hostname": p["hostname"]}
    cfg.update(_plain_options(p))
    cfg.update(_structured_options(p))
    return cfg


def _check_host_and_limits(p):
    if not DNS_NAME.match(p["hostname"] or ""):
        raise ConfigError(f"hostname {p['hostname']!r} is not a valid DNS name (set proxmox_lxc_hostname)")
    if p.get("memory") is not None and int(p["memory"]) < 16:
        raise ConfigError(f"memory {p['memory']} MiB is below PVE's minimum of 16")
    if p.get("cores") is not None and not 1 <= int(p["cores"]) <= 8192:
        raise ConfigError(f"cores {p['cores']} must be between 1 and 8192")


def _plain_options(p):
    cfg = {key: str(p[key]) for key in NUMBER_OPTIONS if p.get(key) is not None}
    cfg.update({key: _scalar(bool(p[key])) for key in FLAG_OPTIONS if p.get(key) is not None})
    cfg.update({key: str(p[key]) for key in TEXT_OPTIONS if p.get(key)})
    return cfg


def _structured_options(p):
    """Tags, features and the indexed netN / devN entries as PVE property strings."""
    cfg = {}
    if p.get("tags"):
        cfg["tags"] = ";".join(sorted({str(t).strip() for t in p["tags"]}))
    if p.get("features"):
        cfg["features"] = build_propstring({k: _scalar(v) for k, v in p["features"].items()})
    for i, net in enumerate(p.get("netif") or []):
        cfg[f"net{i}"] = build_propstring(normalize_net(net))
    for i, dev in enumerate(p.get("devices") or []):
        cfg[f"dev{i}"] = build_propstring(normalize_device(dev), "path")
    return cfg


def normalize_current(key, value):
    """A value as GET config returns it -> the form desired_config builds, for comparison."""
    fam = family(key)
    if fam == "tags":
        return ";".join(sorted({t for t in re.split(r"[;, ]+", str(value)) if t}))
    if fam == "features":
        return build_propstring(parse_propstring(value))
    if fam == "net":
        return build_propstring(parse_propstring(value))
    if fam == "dev":
        return build_propstring(normalize_device(str(value)), "path")
    return _scalar(value)


def _net_equal(want, have):
    w, h = parse_propstring(want), parse_propstring(have)
    for auto in AUTO_FILLED["net"]:
        if auto not in w:
            h.pop(auto, None)
    return w == h


def diff_config(desired, current):
    """Compare desired against GET config.

    Returns (updates {key: value}, deletes [keys], conflicts [messages]). Create-only keys that
    differ are conflicts; owned families (netN, devN) lose entries the desired config lacks.
    """
    updates, deletes, conflicts = {}, [], []
    for key, want in desired.items():
        have = current.get(key, DEFAULTS.get(key))
        have_n = None if have is None else normalize_current(key, have)
        same = _net_equal(want, have_n) if (family(key) == "net" and have_n is not None) else want == have_n
        if same:
            continue
        if key in CREATE_ONLY:
            conflicts.append(f"{key} is {have_n!r} on the existing container but {want!r} is wanted; "
                             f"it can only be set at creation (recreate the container or change the inventory)")
            continue
        updates[key] = want
    for key in current:
        if family(key) in OWNED_FAMILIES and re.match(r"^[a-z]+\d+$", key) and key not in desired:
            deletes.append(key)
    return updates, sorted(deletes), conflicts


def needs_restart(updates, deletes):
    """Keys (predicted) that PVE can't apply to a running container and would leave pending."""
    return sorted(k for k in list(updates) + list(deletes) if k not in HOTPLUG)


def render_config(cfg):
    """{key: value} -> 'key: value' lines like /etc/pve/lxc/<vmid>.conf, for --diff output."""
    lines = []
    for key in sorted(cfg, key=_sort_key):
        if key in ("digest", "lxc"):
            continue
        lines.append(f"{key}: {cfg[key]}")
    for k, v in cfg.get("lxc") or []:
        lines.append(f"{k}: {v}")
    return "\n".join(lines) + ("\n" if lines else "")


def _sort_key(key):
    m = re.match(r"^([a-z]+?)(\d+)$", key)
    return (m.group(1), int(m.group(2))) if m else (key, -1)


def apply_changes(current, updates, deletes):
    """The config as it will be after a PUT with these updates and deletes (for the diff 'after')."""
    after = {k: v for k, v in current.items() if k not in deletes}
    after.update(updates)
    return after


def rootfs_plan(desired_gib, current_rootfs):
    """Return the GiB to grow to, or None when the current size is enough; shrinking is an error."""
    if desired_gib is None or not current_rootfs:
        return None
    have = size_in_gib(parse_propstring(current_rootfs, "volume").get("size", "0G"))
    if desired_gib > have + 1e-9:
        return desired_gib
    if desired_gib < have - 1e-9:
        raise ConfigError(f"disk {desired_gib:g} GiB is smaller than the existing rootfs ({have:g} GiB); "
                          f"PVE can't shrink a container disk, raise proxmox_lxc_disk_gb instead")
    return None
