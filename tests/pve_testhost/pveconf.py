"""`/etc/pve/lxc/<vmid>.conf` in PVE's format: read, write, digest (pve-container PVE::LXC::Config)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

# Lines PVE's parse_pct_config understands.
RAW_LXC_LINE = re.compile(r"^(lxc\.[a-z0-9_\-.]+)(?::|\s*=)\s*(.*?)\s*$")
KEY_LINE = re.compile(r"^([a-z][a-z_\-]*\d*):\s*(.*?)\s*$")
SECTION_LINE = re.compile(r"^\[([a-z0-9_\-:]+)\]\s*$", re.IGNORECASE)

# Keys the config never shows (PVE computes them).
_HIDDEN = {"digest", "description", "lxc"}
# pve-common ParseUtils::encode_text: every byte but printable ASCII, and ':' and '%', is %-escaped.
_SAFE_TEXT = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in ":%")


def encode_text(text: str) -> str:
    return quote(text, safe=_SAFE_TEXT)


def decode_text(data: str) -> str:
    return unquote(data)


@dataclass
class CtConfig:
    values: dict[str, str] = field(default_factory=dict)
    lxc: list[tuple[str, str]] = field(default_factory=list)  # raw lxc.* lines, in order
    description: str = ""  # as GET config returns it: one "...\n" per comment line
    pending: dict[str, str] = field(default_factory=dict)
    pending_delete: list[str] = field(default_factory=list)
    other_sections: list[str] = field(default_factory=list)  # snapshots etc., kept verbatim
    digest: str = ""

    def get(self, key: str, default=None):
        return self.values.get(key, default)


PENDING_SECTION = "pve:pending"


def parse(text: str) -> CtConfig:
    conf = CtConfig(digest=hashlib.sha1(text.encode()).hexdigest())
    section = None
    desc: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = SECTION_LINE.match(line)
        if m:
            section = m[1]
            if section != PENDING_SECTION:
                conf.other_sections.append(line)
        elif section is None:
            _parse_main_line(conf, desc, line)
        elif section == PENDING_SECTION:
            _parse_pending_line(conf, line)
        else:
            conf.other_sections.append(line)
    conf.description = "".join(desc)
    return conf


def _parse_main_line(conf: CtConfig, desc: list[str], line: str) -> None:
    """A line before the first section: a comment (description), a raw lxc.* line or a key."""
    if line.startswith("#"):
        desc.append(decode_text(line[1:]) + "\n")
    elif m := RAW_LXC_LINE.match(line):
        conf.lxc.append((m[1], m[2]))
    elif m := KEY_LINE.match(line):
        if m[1] == "description":  # a 'description:' line counts too
            desc.append(decode_text(m[2]))
        else:
            conf.values[m[1]] = m[2]


def _parse_pending_line(conf: CtConfig, line: str) -> None:
    """A line of [pve:pending]: a pending value, or 'delete:' with the keys to drop (comments and lxc.* ignored)."""
    if line.startswith("#") or RAW_LXC_LINE.match(line):
        return
    m = KEY_LINE.match(line)
    if m and m[1] == "delete":
        conf.pending_delete = [k for k in re.split(r"[,;\s]+", m[2]) if k]
    elif m:
        conf.pending[m[1]] = m[2]


def render(conf: CtConfig) -> str:
    # pve-container write_pct_config: the description as '#' comment lines at the top
    out = [f"#{encode_text(line)}" for line in conf.description.rstrip("\n").split("\n")] if conf.description else []
    for key in sorted(conf.values):
        if key not in _HIDDEN:
            out.append(f"{key}: {conf.values[key]}")
    out += [f"{k}: {v}" for k, v in conf.lxc]
    if conf.pending or conf.pending_delete:
        out += ["", "[pve:pending]"]
        out += [f"{k}: {conf.pending[k]}" for k in sorted(conf.pending)]
        if conf.pending_delete:
            out.append("delete: " + ",".join(conf.pending_delete))
    if conf.other_sections:
        out.append("")
        out += conf.other_sections
    return "\n".join(out) + "\n"


def read(path: Path) -> CtConfig:
    return parse(path.read_text())


def write(path: Path, conf: CtConfig) -> None:
    # Write-then-rename so that a reader (pct over SSH, the API) never sees half a file.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(conf))
    tmp.replace(path)


def apply_pending(conf: CtConfig) -> CtConfig:
    """What a start/reboot does: move pending values into the config, drop pending deletes."""
    for key in conf.pending_delete:
        conf.values.pop(key, None)
    conf.values.update(conf.pending)
    conf.pending.clear()
    conf.pending_delete.clear()
    return conf
