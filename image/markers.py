"""PEP 508 environment markers, evaluated with the standard library only.

The doctor and the wheelhouse read pylock.toml, whose packages carry markers such as
`sys_platform == 'linux' and python_full_version < '3.14'`; `packaging` may not be installed
where they run (inside the frozen environment), so this is a small evaluator of the grammar.
"""

from __future__ import annotations

import os
import platform
import re
import sys

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<lpar>\() | (?P<rpar>\)) |
        (?P<op>===|==|!=|~=|<=|>=|<|>|not\s+in\b|in\b) |
        (?P<bool>and\b|or\b) |
        (?P<str>'[^']*'|"[^"]*") |
        (?P<var>[A-Za-z_][A-Za-z0-9_.]*)
    )""",
    re.VERBOSE,
)
_VERSION_VARS = {"python_version", "python_full_version", "implementation_version", "platform_release"}


class MarkerError(ValueError):
    """A marker that does not follow PEP 508."""


def current_environment() -> dict[str, str]:
    """The marker variables of the running interpreter."""
    impl = sys.implementation
    iv = impl.version
    impl_version = f"{iv.major}.{iv.minor}.{iv.micro}"
    if iv.releaselevel != "final":
        impl_version += iv.releaselevel[0] + str(iv.serial)
    return {
        "implementation_name": impl.name,
        "implementation_version": impl_version,
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_python_implementation": platform.python_implementation(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    }


def target_environment(python_version: str, machine: str = "x86_64") -> dict[str, str]:
    """Marker variables of a Linux CPython target (the image), e.g. python_version='3.13.5'."""
    parts = python_version.split(".")
    full = ".".join((parts + ["0", "0"])[:3])
    return {
        "implementation_name": "cpython",
        "implementation_version": full,
        "os_name": "posix",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": full,
        "python_version": ".".join(parts[:2]),
        "sys_platform": "linux",
    }


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise MarkerError(f"cannot parse marker {text!r} at position {pos}")
        kind = m.lastgroup
        value = m.group(kind)
        out.append((kind, " ".join(value.split()) if kind == "op" else value))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def _version_key(v: str) -> tuple:
    release = re.match(r"\d+(?:\.\d+)*", v.strip())
    if not release:
        return (v,)
    nums = [int(x) for x in release.group(0).split(".")]
    while len(nums) > 1 and nums[-1] == 0:
        nums.pop()
    return tuple(nums)


def _compare(left: str, op: str, right: str, versions: bool) -> bool:
    if op == "in":
        return left in right
    if op == "not in":
        return left not in right
    if op == "===":
        return left == right
    if versions:
        a, b = _version_key(left), _version_key(right)
        if op == "~=":
            prefix = _version_key(right)[:-1] if len(_version_key(right)) > 1 else _version_key(right)
            return a >= b and a[: len(prefix)] == prefix
    else:
        a, b = left, right
        if op == "~=":
            raise MarkerError(f"'~=' needs versions, not {left!r} and {right!r}")
    return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


class _Parser:
    def __init__(self, tokens, env, extras):
        self.toks, self.i, self.env, self.extras = tokens, 0, env, extras

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, kind=None):
        tok = self.peek()
        if tok[0] is None or (kind and tok[0] != kind):
            raise MarkerError(f"expected {kind or 'more'} in marker, got {tok[1]!r}")
        self.i += 1
        return tok

    def parse_or(self) -> bool:
        result = self.parse_and()
        while self.peek() == ("bool", "or"):
            self.take()
            rhs = self.parse_and()
            result = result or rhs
        return result

    def parse_and(self) -> bool:
        result = self.parse_expr()
        while self.peek() == ("bool", "and"):
            self.take()
            rhs = self.parse_expr()
            result = result and rhs
        return result

    def value(self):
        kind, text = self.take()
        if kind == "str":
            return text[1:-1], None
        if kind == "var":
            name = text.replace(".", "_")
            if name == "extra":
                return None, "extra"
            if name not in self.env:
                raise MarkerError(f"unknown marker variable {text!r}")
            return self.env[name], name
        raise MarkerError(f"expected a value in marker, got {text!r}")

    def parse_expr(self) -> bool:
        if self.peek()[0] == "lpar":
            self.take()
            result = self.parse_or()
            self.take("rpar")
            return result
        left, lname = self.value()
        _, op = self.take("op")
        right, rname = self.value()
        if "extra" in (lname, rname):
            other = right if lname == "extra" else left
            hit = any(other == e for e in self.extras)
            return hit if op == "==" else (not hit if op == "!=" else False)
        versions = bool({lname, rname} & _VERSION_VARS)
        return _compare(left, op, right, versions)


def evaluate(marker: str | None, env: dict[str, str] | None = None, extras=()) -> bool:
    """True when `marker` holds in `env` (the running interpreter by default); no marker holds."""
    if not marker or not marker.strip():
        return True
    parser = _Parser(_tokens(marker), env or current_environment(), tuple(extras))
    result = parser.parse_or()
    if parser.i != len(parser.toks):
        raise MarkerError(f"unexpected {parser.toks[parser.i][1]!r} in marker {marker!r}")
    return result
