"""Request validation against the PVE 9.1 API schema subset (lxc-endpoints.json), with PVE's messages.

PVE checks every parameter with PVE::JSONSchema before a handler runs; the messages below are the
ones it produces, so a client sees the same 400 body from us as from a real node.
"""

from __future__ import annotations

import ipaddress
import json
import re
from functools import cache
from pathlib import Path

SCHEMA_FILE = Path(__file__).with_name("lxc-endpoints.json")

# How many of each indexed key PVE allows (pve-container: MAX_LXC_NETWORKS, MAX_MOUNT_POINTS,
# MAX_UNUSED_DISKS, MAX_DEVICES).
INDEXED_LIMITS = {"net": 32, "mp": 256, "unused": 256, "dev": 256}

UNKNOWN_KEY = "property is not defined in schema and the schema does not allow additional properties"
MISSING_KEY = "property is missing and it is not optional"


class ParamError(Exception):
    """HTTP 400 'Parameter verification failed.' with one message per parameter."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


@cache
def endpoints() -> dict:
    return json.loads(SCHEMA_FILE.read_text())["endpoints"]


def method_schema(path_template: str, method: str) -> dict:
    return endpoints()[path_template][method]


def property_schema(props: dict, key: str) -> dict | None:
    """The schema of `key`, resolving indexed keys (dev0 -> dev[n])."""
    if key in props:
        return props[key]
    m = re.fullmatch(r"([a-z]+)(\d+)", key)
    if m and f"{m[1]}[n]" in props:
        limit = INDEXED_LIMITS.get(m[1], 256)
        if int(m[2]) < limit and str(int(m[2])) == m[2]:
            return props[f"{m[1]}[n]"]
    return None


# --- scalar checks -------------------------------------------------------------------------------

_BOOL_TRUE = re.compile(r"^(1|true|yes|on)$", re.IGNORECASE)
_BOOL_FALSE = re.compile(r"^(0|false|no|off)$", re.IGNORECASE)


def _perl_regex(pattern: str) -> str:
    # The schema keeps Perl's stringified regexes: (?^:...) means "default flags".
    return pattern.replace("(?^:", "(?:")


def _fmt_ipv4_config(v: str) -> bool:
    if v in ("dhcp", "manual"):
        return True
    try:
        ipaddress.IPv4Interface(v)
        return "/" in v
    except ValueError:
        return False


def _fmt_ipv6_config(v: str) -> bool:
    if v in ("dhcp", "auto", "manual"):
        return True
    try:
        ipaddress.IPv6Interface(v)
        return "/" in v
    except ValueError:
        return False


def _is_ip(v: str, cls) -> bool:
    try:
        cls(v)
        return True
    except ValueError:
        return False


_DNS_LABEL = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9\-]*[a-zA-Z0-9])?)"
_DNS_NAME = re.compile(rf"^(?:{_DNS_LABEL}\.)*{_DNS_LABEL}$")

# format name -> (check, what PVE calls it in "value does not look like a valid ...")
NAMED_FORMATS = {
    "pve-node": (lambda v: re.fullmatch(r"(?i:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?)", v), "node name"),
    "pve-storage-id": (lambda v: re.fullmatch(r"(?i:[a-z][a-z0-9\-_.]*[a-z0-9])", v), "storage ID"),
    "pve-poolid": (lambda v: re.fullmatch(r"[A-Za-z0-9_\-/]+", v), "pool ID"),
    "pve-vmid": (lambda v: re.fullmatch(r"[1-9][0-9]{2,8}", v), "VM ID"),
    "dns-name": (lambda v: _DNS_NAME.match(v), "DNS name"),
    "dns-name-list": (lambda v: all(_DNS_NAME.match(x) for x in re.split(r"[,;\s]+", v) if x), "DNS name list"),
    "ipv4": (lambda v: _is_ip(v, ipaddress.IPv4Address), "IPv4 address"),
    "ipv6": (lambda v: _is_ip(v, ipaddress.IPv6Address), "IPv6 address"),
    "pve-ipv4-config": (_fmt_ipv4_config, "IPv4 network configuration"),
    "pve-ipv6-config": (_fmt_ipv6_config, "IPv6 network configuration"),
    "mac-addr": (lambda v: re.fullmatch(r"(?i:[a-f0-9][02468ace](?::[a-f0-9]{2}){5})", v), "MAC address"),
    "lxc-ip-with-ll-iface-list": (
        lambda v: all(_is_ip(x.split("%")[0], ipaddress.ip_address) for x in re.split(r"[,;\s]+", v) if x),
        "IP address list",
    ),
    "pve-tag-list": (lambda v: re.fullmatch(r"[a-zA-Z0-9_+.\-]+(?:[;, ][a-zA-Z0-9_+.\-]+)*", v), "tag list"),
    "disk-size": (lambda v: re.fullmatch(r"\d+(\.\d+)?[KMGT]?", v), "disk size"),
    "pve-startup-order": (
        lambda v: re.fullmatch(r"(?:(?:order=\d+|up=\d+|down=\d+)(?:,|$))+", v), "startup order"),
    "pve-ct-timezone": (lambda v: re.fullmatch(r"(?:host|[A-Za-z0-9_+\-/]+)", v), "timezone"),
    "pve-volume-id": (lambda v: re.fullmatch(r"[a-z][a-z0-9\-_.]*[a-z0-9]:.+", v, re.IGNORECASE), "volume ID"),
    "pve-lxc-dev-string": (lambda v: v.startswith("/dev/") and "/../" not in v and "\0" not in v, "device path"),
    "pve-lxc-mp-string": (
        lambda v: not re.search(r"(?:^|/)\.\.?(?:/|$)", v) and "," not in v and "\0" not in v, "mount point"),
    "pve-storage-content-list": (lambda v: re.fullmatch(r"[a-z]+(?:,[a-z]+)*", v), "content list"),
}


def check_value(sch: dict, value, *, for_format: bool = False):
    """Coerce and check one value; returns the typed value or raises ValueError(PVE message)."""
    typ = sch.get("type", "string")
    if isinstance(value, bool):
        value = int(value)
    text = str(value)
    if typ == "integer":
        if not re.fullmatch(r"[+-]?\d+", text.strip()):
            raise ValueError(f"type check ('integer') failed - got '{text}'")
        out = int(text)
    elif typ == "number":
        if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text.strip()):
            raise ValueError(f"type check ('number') failed - got '{text}'")
        out = float(text)
    elif typ == "boolean":
        if _BOOL_TRUE.match(text):
            out = 1
        elif _BOOL_FALSE.match(text):
            out = 0
        else:
            raise ValueError(f"type check ('boolean') failed - got '{text}'")
    elif typ in ("string", "object", "array", "null", "any"):
        out = text
    else:  # pragma: no cover - the schema only uses the types above
        raise ValueError(f"unknown type '{typ}'")

    if typ in ("integer", "number"):
        if "minimum" in sch and out < float(sch["minimum"]):
            raise ValueError(f"value must have a minimum value of {sch['minimum']}")
        if "maximum" in sch and out > float(sch["maximum"]):
            raise ValueError(f"value must have a maximum value of {sch['maximum']}")
    if typ == "string":
        if "maxLength" in sch and len(out) > sch["maxLength"]:
            raise ValueError(f"value may only be {sch['maxLength']} characters long")
        if "minLength" in sch and len(out) < sch["minLength"]:
            raise ValueError(f"value must be at least {sch['minLength']} characters long")
        if "enum" in sch and out not in sch["enum"]:
            raise ValueError(f"value '{out}' does not have a value in the enumeration '{', '.join(sch['enum'])}'")
        if "pattern" in sch and not re.fullmatch(_perl_regex(sch["pattern"]), out, re.DOTALL):
            raise ValueError("value does not match the regex pattern")
        fmt = sch.get("format")
        if isinstance(fmt, dict):
            parse_property_string(fmt, out)
        elif isinstance(fmt, str) and fmt in NAMED_FORMATS:
            check, what = NAMED_FORMATS[fmt]
            if not check(out):
                raise ValueError(f"invalid format - value '{out}' does not look like a valid {what}")
    return out


# --- property strings ----------------------------------------------------------------------------

def _split_property_string(value: str) -> list[str]:
    # PVE splits on commas; a double-quoted value may contain commas.
    parts, cur, quoted = [], "", False
    for ch in value:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p != ""]


def default_key(fmt: dict) -> str | None:
    return next((k for k, v in fmt.items() if v.get("default_key")), None)


def parse_property_string(fmt: dict, value: str) -> dict:
    """Parse 'a=1,b=x' (plus an optional bare default-key value) into a dict of typed values."""
    res: dict = {}
    dkey = default_key(fmt)
    for part in _split_property_string(value):
        if "=" in part:
            k, v = part.split("=", 1)
        elif dkey is not None and dkey not in res:
            k, v = dkey, part
        else:
            raise ValueError("invalid format - value without key, but schema does not define a default key")
        v = v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v
        if k in res:
            raise ValueError(f"invalid format - duplicate key in comma-separated list property: {k}")
        sub = fmt.get(k)
        if sub is None:
            raise ValueError(f"invalid format - format error\n{k}: {UNKNOWN_KEY}")
        try:
            res[k] = check_value(sub, v, for_format=True)
        except ValueError as exc:
            raise ValueError(f"invalid format - format error\n{k}: {exc}") from None
    for k, sub in fmt.items():
        if not sub.get("optional") and k not in res:
            raise ValueError(f"invalid format - format error\n{k}: {MISSING_KEY}")
    return res


def print_property_string(fmt: dict, data: dict) -> str:
    """PVE's order: the default key bare, then required keys sorted, then the rest sorted."""
    out, done = [], set()
    dkey = default_key(fmt)
    if dkey is not None and dkey in data:
        out.append(str(data[dkey]))
        done.add(dkey)
    for required in (True, False):
        for k in sorted(data):
            if k in done or data[k] is None:
                continue
            if required and fmt.get(k, {}).get("optional"):
                continue
            v = data[k]
            out.append(f"{k}={v}")
            done.add(k)
    return ",".join(out)


# --- whole requests ------------------------------------------------------------------------------

def validate(path_template: str, method: str, params: dict[str, str]) -> dict:
    """Check a request's parameters (path ones included); returns typed values or raises ParamError."""
    spec = method_schema(path_template, method).get("parameters", {})
    props = spec.get("properties", {})
    errors: dict[str, str] = {}
    out: dict = {}
    for key, raw in params.items():
        sch = property_schema(props, key)
        if sch is None:
            if spec.get("additionalProperties", 0) == 0:
                errors[key] = UNKNOWN_KEY
            continue
        try:
            out[key] = check_value(sch, raw)
        except ValueError as exc:
            errors[key] = str(exc)
    for key, sch in props.items():
        if "[n]" in key or sch.get("optional") or key in params:
            continue
        errors[key] = MISSING_KEY
    for key in params:
        sch = property_schema(props, key)
        if sch and sch.get("requires") and sch["requires"] not in params and key not in errors:
            errors[key] = f"parameter '{key}' requires '{sch['requires']}'"
    if errors:
        raise ParamError(errors)
    return out


def config_format(key: str) -> dict | None:
    """The property-string format of a CT config key (dev0, net1, rootfs, features ...), if any."""
    props = method_schema("/nodes/{node}/lxc", "POST")["parameters"]["properties"]
    sch = property_schema(props, key)
    return sch.get("format") if sch and isinstance(sch.get("format"), dict) else None


def parse_config_value(key: str, value: str) -> dict:
    fmt = config_format(key)
    if fmt is None:
        raise KeyError(f"{key} is not a property-string key")
    return parse_property_string(fmt, value)


def print_config_value(key: str, data: dict) -> str:
    fmt = config_format(key)
    if fmt is None:
        raise KeyError(f"{key} is not a property-string key")
    return print_property_string(fmt, data)


def mountpoint_type(volume: str) -> str:
    """PVE's classify_mountpoint: 'device' (/dev/...), 'bind' (other absolute paths) or 'volume'."""
    if volume.startswith("/dev/"):
        return "device"
    if volume.startswith("/"):
        return "bind"
    return "volume"


NEW_DISK_RE = re.compile(r"^(?:([a-z][a-z0-9\-_.]*[a-z0-9]):)?(\d+(?:\.\d+)?)$", re.IGNORECASE)
