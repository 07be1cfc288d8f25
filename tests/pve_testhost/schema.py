"""Request validation against the PVE 9.1 API schema subset (lxc-endpoints.json), with PVE's messages.

PVE checks every parameter with PVE::JSONSchema before a handler runs (pve-common
src/PVE/JSONSchema.pm: check_object, check_prop, check_type, check_format, parse_property_string).
This module follows that code step by step: the same order of checks (type, format, pattern, length,
range, enum), the same texts, the same trailing newlines (PVE's `die "...\\n"`), so a client sees the
same 400 body from us as from a real node.
"""

from __future__ import annotations

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


class FormatError(ValueError):
    """A format check's `die` text (it ends in a newline, as PVE's do)."""


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


# --- named formats (register_format in pve-common, pve-container, pve-storage, pve-access-control) ----

# pve-common src/PVE/ParseUtils.pm
_IPV4OCTET = r"(?:25[0-5]|(?:2[0-4]|1[0-9]|[1-9])?[0-9])"
IPV4RE = rf"(?:(?:{_IPV4OCTET}\.){{3}}{_IPV4OCTET})"
_H16 = r"(?:[0-9a-fA-F]{1,4})"
_LS32 = rf"(?:(?:{IPV4RE}|{_H16}:{_H16}))"
IPV6RE = ("(?:"
          rf"(?:(?:(?:{_H16}:){{6}}){_LS32})|"
          rf"(?:(?:::(?:{_H16}:){{5}}){_LS32})|"
          rf"(?:(?:(?:{_H16})?::(?:{_H16}:){{4}}){_LS32})|"
          rf"(?:(?:(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}){_LS32})|"
          rf"(?:(?:(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}){_LS32})|"
          rf"(?:(?:(?:(?:{_H16}:){{0,3}}{_H16})?::(?:{_H16}:){{1}}){_LS32})|"
          rf"(?:(?:(?:(?:{_H16}:){{0,4}}{_H16})?::){_LS32})|"
          rf"(?:(?:(?:(?:{_H16}:){{0,5}}{_H16})?::){_H16})|"
          rf"(?:(?:(?:(?:{_H16}:){{0,6}}{_H16})?::))"
          ")")
_DNS_LABEL = r"([a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?)"
_ZONE_TAB = Path("/usr/share/zoneinfo/zone.tab")
# pve-storage Plugin::valid_content_types('dir') (dir holds every type) plus 'import'
_CONTENT_TYPES = {"images", "rootdir", "vztmpl", "iso", "backup", "snippets", "none", "import"}


def _check(ok, message: str) -> None:
    if not ok:
        raise FormatError(message + "\n")


def _cidr(value: str, addr_re: str, bits: int) -> bool:
    m = re.fullmatch(rf"(?:{addr_re})/(\d+)", value)
    return bool(m) and 7 < int(m[1]) <= bits  # pve_verify_cidrv4/-v6: prefix 8..32 (..128)


def _storage_id(v: str) -> None:  # parse_id($id, 'storage')
    _check(len(v) >= 2, f"storage ID '{v}' cannot be shorter than 2 characters")
    _check(re.fullmatch(r"[a-z][a-z0-9\-_.]*[a-z0-9]", v, re.IGNORECASE), f"storage ID '{v}' contains illegal characters")


def _poolid(v: str) -> None:  # pve-access-control AccessControl.pm verify_poolname
    _check(len([p for p in v.split("/") if p]) <= 3, f"pool name '{v}' nested too deeply (max levels = 3)")
    _check(re.fullmatch(r"[A-Za-z0-9.\-_]+(?:/[A-Za-z0-9.\-_]+){0,2}", v), f"pool name '{v}' contains invalid characters")


def _ip_with_ll_iface(v: str) -> None:  # pve-container LXC/Config.pm verify_ip_with_ll_iface
    m = re.fullmatch(r"(fe80:[^%]+)%(.*)", v)
    if m and re.fullmatch(rf"(?:{IPV4RE})|(?:{IPV6RE})", m[1]) and re.fullmatch(
            r"[a-z][a-z0-9_]{1,20}([:.]\d+)?", m[2], re.IGNORECASE):
        return
    _check(re.fullmatch(rf"(?:{IPV4RE})|(?:{IPV6RE})", v), "value does not look like a valid IP address")


def _startup_order(v: str) -> None:  # pve_parse_startup_order
    parts = [p for p in v.split(",") if not re.fullmatch(r"\s*", p)]
    ok = bool(v) and all(re.fullmatch(r"(?:order=)?\d+|up=\d+|down=\d+", p) for p in parts)
    _check(ok, "unable to parse startup options")


def _ct_timezone(v: str) -> None:  # pve-container verify_ct_timezone -> pve_verify_timezone
    if v in ("host", "UTC"):
        return
    zones = set()
    if _ZONE_TAB.is_file():
        zones = {ln.split("\t")[2] for ln in _ZONE_TAB.read_text().splitlines()
                 if ln.strip() and not ln.lstrip().startswith("#") and len(ln.split("\t")) > 2}
    _check(v in zones, f"invalid time zone '{v}'")


FORMATS = {
    "pve-node": lambda v: _check(re.fullmatch(r"[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?", v),
                                 "value does not look like a valid node name"),
    "pve-vmid": lambda v: _check(re.fullmatch(r"[1-9][0-9]{2,8}", v), "value does not look like a valid VM ID"),
    "pve-storage-id": _storage_id,
    "pve-poolid": _poolid,
    "pve-configid": lambda v: _check(re.fullmatch(r"[a-z][a-z0-9_-]+", v, re.IGNORECASE),
                                     f"invalid configuration ID '{v}'"),
    "dns-name": lambda v: _check(re.fullmatch(rf"({_DNS_LABEL}\.)*{_DNS_LABEL}", v),
                                 "value does not look like a valid DNS name"),
    "ipv4": lambda v: _check(re.fullmatch(IPV4RE, v), "value does not look like a valid IPv4 address"),
    "ipv6": lambda v: _check(re.fullmatch(IPV6RE, v), "value does not look like a valid IPv6 address"),
    "pve-ipv4-config": lambda v: _check(v in ("dhcp", "manual") or _cidr(v, IPV4RE, 32),
                                        "value does not look like a valid ipv4 network configuration"),
    "pve-ipv6-config": lambda v: _check(v in ("auto", "dhcp", "manual") or _cidr(v, IPV6RE, 128),
                                        "value does not look like a valid ipv6 network configuration"),
    "mac-addr": lambda v: _check(re.fullmatch(r"[a-f0-9][02468ace](?::[a-f0-9]{2}){5}", v, re.IGNORECASE),
                                 "value does not look like a valid unicast MAC address"),
    "lxc-ip-with-ll-iface": _ip_with_ll_iface,
    "pve-tag": lambda v: _check(re.fullmatch(r"[a-z0-9_][a-z0-9_\-+.]*", v, re.IGNORECASE),
                                "invalid characters in tag"),
    "disk-size": lambda v: _check(re.fullmatch(r"\d+(\.\d+)?([KMGT](?:iB)?)?", v),
                                  f"value does not look like a valid disk size: {v}"),
    "pve-startup-order": _startup_order,
    "pve-ct-timezone": _ct_timezone,
    "pve-volume-id": lambda v: _check(re.fullmatch(r"[a-z][a-z0-9\-_.]*[a-z0-9]:.+", v, re.IGNORECASE),
                                      f"unable to parse volume ID '{v}'"),
    "pve-lxc-dev-string": lambda v: _check(not re.search(r"/\.\.?(?:/|$)", v) and v.startswith("/dev/"),
                                           f"{v} is not a valid device path"),
    "pve-lxc-mp-string": lambda v: _check(not re.search(r"/\.\.?/|/\.\.?$|^\.\./", v),
                                          f"{v} contains illegal character sequences"),
    "pve-storage-content": lambda v: _check(v in _CONTENT_TYPES, f"invalid content type '{v}'"),
    "pve-task-status-type": lambda v: _check(re.fullmatch(r"ok|error|warning|unknown", v, re.IGNORECASE),
                                             f"invalid status '{v}'"),
}


def split_list(text: str) -> list[str]:
    """pve-common ParseUtils::split_list: NUL-separated, else on commas, semicolons and blanks."""
    if "\0" in text:
        return text.split("\0")
    return re.sub(r"[,;]", " ", text).split()


def check_format(fmt, value: str, path: str) -> None:
    """JSONSchema::check_format: a property-string format (dict) or a named one, with -list / -opt."""
    if isinstance(fmt, dict):
        parse_property_string(fmt, value, path)
        return
    if fmt == "regex":
        return
    m = re.fullmatch(r"(.*?)(?:-(list|opt))?", fmt)
    name, kind = m[1], m[2]
    if name not in FORMATS:
        raise FormatError(f"undefined format '{fmt}'\n")
    if kind == "list":
        for item in split_list(value):
            FORMATS[name](item)
    elif kind == "opt":
        if value:
            FORMATS[name](value)
    else:
        FORMATS[name](value)


# --- the checks, in check_prop's order -----------------------------------------------------------

_BOOL_TRUE = re.compile(r"(1|on|yes|true)", re.IGNORECASE)
_BOOL_FALSE = re.compile(r"(0|off|no|false)", re.IGNORECASE)
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.\d+|\d+\.|\.\d+|\d+)([eE][+-]?\d+)?")


def _perl_regex(pattern: str) -> str:
    # The schema keeps Perl's stringified regexes: (?^:...) means "default flags".
    return pattern.replace("(?^:", "(?:")


def _perl_num(x) -> str:
    """A number as Perl prints it in "...$max" (100, not 100.0)."""
    f = float(x)
    return str(int(f)) if f.is_integer() else repr(f)


def add_error(errors: dict, path: str, msg: str) -> None:
    path = path or "_root"
    # JSONSchema::add_error joins with '\n' in single quotes: a backslash and an n, not a newline.
    errors[path] = f"{errors[path]}\\n{msg}" if path in errors else msg


def check_prop(value, sch: dict, path: str, errors: dict) -> None:
    """JSONSchema::check_prop for the flat schemas of this API subset (value: str or None)."""
    if value is None:
        if not sch.get("optional"):
            add_error(errors, path, MISSING_KEY)
        return
    if (msg := _violation(str(value), sch, path)) is not None:
        add_error(errors, path, msg)


def _type_violation(text: str, sch: dict, path: str) -> str | None:
    typ = sch.get("type", "string")
    if typ == "boolean" and text not in ("0", "1"):  # the top level takes 0/1 only (JSON true/false too)
        return f"type check ('boolean') failed - got '{text}'"
    if (typ == "integer" and not _INTEGER.fullmatch(text)) or (typ == "number" and not _NUMBER.fullmatch(text)):
        return f"type check ('{typ}') failed - got '{text}'"
    return None


def _format_violation(text: str, sch: dict, path: str) -> str | None:
    if fmt := sch.get("format"):
        try:
            check_format(fmt, text, path)
        except FormatError as exc:
            return f"invalid format - {exc}"
    return None


def _pattern_violation(text: str, sch: dict, path: str) -> str | None:
    if (pattern := sch.get("pattern")) and not re.match(rf"^(?:{_perl_regex(pattern)})$", text):
        return "value does not match the regex pattern"
    return None


def _length_violation(text: str, sch: dict, path: str) -> str | None:
    if "maxLength" in sch and len(text) > int(sch["maxLength"]):
        return f"value may only be {sch['maxLength']} characters long"
    if "minLength" in sch and len(text) < int(sch["minLength"]):
        return f"value must be at least {sch['minLength']} characters long"
    return None


def _range_violation(text: str, sch: dict, path: str) -> str | None:
    if not _NUMBER.fullmatch(text):
        return None
    if "maximum" in sch and float(text) > float(sch["maximum"]):
        return f"value must have a maximum value of {_perl_num(sch['maximum'])}"
    if "minimum" in sch and float(text) < float(sch["minimum"]):
        return f"value must have a minimum value of {_perl_num(sch['minimum'])}"
    return None


def _enum_violation(text: str, sch: dict, path: str) -> str | None:
    if "enum" in sch and text not in [str(e) for e in sch["enum"]]:
        return (f"value '{text}' does not have a value in the enumeration "
                f"'{', '.join(str(e) for e in sch['enum'])}'")
    return None


# check_prop's checks in JSONSchema.pm's order; PVE reports only the first that fails.
_CHECKS = (_type_violation, _format_violation, _pattern_violation, _length_violation, _range_violation,
           _enum_violation)


def _violation(text: str, sch: dict, path: str) -> str | None:
    """The first check of check_prop's sequence that the value fails (type, format, pattern, lengths,
    range, enum, in JSONSchema.pm's order: PVE reports only that one), or None."""
    for check in _CHECKS:
        if (msg := check(text, sch, path)) is not None:
            return msg
    return None


def _schema_keys(props: dict, values: dict) -> list[tuple[str, dict]]:
    """The keys check_object walks: every schema key, with net[n] expanded to the net0.. given."""
    out = []
    for key, sch in props.items():
        if key.endswith("[n]"):
            out += [(k, sch) for k in values if property_schema({key: sch}, k) is sch]
        else:
            out.append((key, sch))
    return out


def check_object(path: str, props: dict, values: dict, additional, errors: dict) -> None:
    """JSONSchema::check_object: each schema key, then requires and unknown keys of the values."""
    for key, sch in _schema_keys(props, values):
        check_prop(values.get(key), sch, f"{path}.{key}" if path else key, errors)
    for key in values:
        newpath = f"{path}.{key}" if path else key
        sch = property_schema(props, key)
        if sch is not None:
            req = sch.get("requires")
            if isinstance(req, str) and values.get(req) is None:
                add_error(errors, f"{path}.{req}" if path else req, f"missing property required by '{newpath}'")
            continue
        if additional is not None and not additional:
            add_error(errors, newpath, UNKNOWN_KEY)


# --- property strings ----------------------------------------------------------------------------

def default_key(fmt: dict) -> str | None:
    return next((k for k, v in fmt.items() if v.get("default_key")), None)


def _parse_boolean(v: str):
    if _BOOL_TRUE.fullmatch(v):
        return "1"
    if _BOOL_FALSE.fullmatch(v):
        return "0"
    return v


def coerce(sch: dict, value):
    """The typed value of a checked one: ints for integers and booleans, floats for numbers."""
    typ = sch.get("type", "string")
    text = str(value)
    if typ in ("integer", "boolean") and _INTEGER.fullmatch(text):
        return int(text)
    if typ == "number" and _NUMBER.fullmatch(text):
        f = float(text)
        return int(f) if f.is_integer() and "." not in text else f
    return text


def parse_property_string(fmt: dict, value: str, path: str = "") -> dict:
    """JSONSchema::parse_property_string: 'a=1,b=x' (plus a bare default-key value) -> typed dict.

    Raises FormatError with PVE's text: a plain `die` line, or "format error\\n" followed by one
    "<path>.<key>: <message>\\n" line per bad key (PVE::Exception::stringify).
    """
    res: dict[str, str] = {}
    dkey = None
    for part in str(value).split(","):
        if re.fullmatch(r"\s*", part):
            continue
        if m := re.fullmatch(r"([^=]+)=(.+)", part):
            k, v = m[1], m[2]
            if k in res:
                raise FormatError(f"duplicate key in comma-separated list property: {k}\n")
            # an unknown key is kept: check_object below reports it
            res[k] = _parse_boolean(v) if fmt.get(k, {}).get("type") == "boolean" else v
        elif "=" not in part:
            if dkey is not None:
                raise FormatError(f"duplicate key in comma-separated list property: {dkey}\n")
            dkey = default_key(fmt)
            if dkey is None:
                raise FormatError("value without key, but schema does not define a default key\n")
            if res.get(dkey):
                raise FormatError(f"duplicate key in comma-separated list property: {dkey}\n")
            res[dkey] = _parse_boolean(part) if fmt[dkey].get("type") == "boolean" else part
        else:
            raise FormatError("missing key in comma-separated list property\n")
    errors: dict[str, str] = {}
    check_object(path, fmt, res, 0, errors)
    if errors:
        raise FormatError("format error\n" + "".join(f"{k}: {v}\n" for k, v in sorted(errors.items())))
    return {k: coerce(fmt[k], v) for k, v in res.items()}


def print_property_string(fmt: dict, data: dict) -> str:
    """JSONSchema::print_property_string: the default key bare, then required keys sorted, then the rest."""
    out, done = [], set()
    dkey = default_key(fmt)
    if dkey is not None and data.get(dkey) is not None:
        out.append(str(data[dkey]))
        done.add(dkey)
    for required in (True, False):
        for k in sorted(data):
            if k in done or data[k] is None:
                continue
            if required and fmt.get(k, {}).get("optional"):
                continue
            out.append(f"{k}={data[k]}")
            done.add(k)
    return ",".join(out)


# --- whole requests ------------------------------------------------------------------------------

def validate(path_template: str, method: str, params: dict[str, str]) -> dict:
    """Check a request's parameters (path ones included); returns typed values or raises ParamError."""
    spec = method_schema(path_template, method).get("parameters", {})
    props = spec.get("properties", {})
    errors: dict[str, str] = {}
    check_object("", props, params, spec.get("additionalProperties", 1), errors)
    if errors:
        raise ParamError(errors)
    return {k: coerce(property_schema(props, k) or {}, v) for k, v in params.items()}


def config_format(key: str) -> dict | None:
    """The property-string format of a CT config key (dev0, net1, rootfs, features ...), if any."""
    props = method_schema("/nodes/{node}/lxc", "POST")["parameters"]["properties"]
    sch = property_schema(props, key)
    return sch.get("format") if sch and isinstance(sch.get("format"), dict) else None


def parse_config_value(key: str, value: str) -> dict:
    fmt = config_format(key)
    if fmt is None:
        raise KeyError(f"{key} is not a property-string key")
    return parse_property_string(fmt, value, key)


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
