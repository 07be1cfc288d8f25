"""Reading the exported lock (pylock.toml, PEP 751) with the standard library only.

`uv export --format pylock.toml` writes one entry per package with its marker and its wheels
(url or path, sha256). The doctor uses it to know what the environment should hold, the wheelhouse
to know what to download. uv.lock stays the source of truth; this file is derived from it.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from dflash_image import markers


class LockError(ValueError):
    """The lock file is missing or malformed."""


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    filename: str
    url: str | None
    path: str | None
    sha256: str | None


@dataclass(frozen=True)
class LockedPackage:
    name: str
    version: str | None  # None for a local directory (the trainer, built and installed as a wheel)
    marker: str | None
    index: str | None
    directory: str | None
    wheels: tuple[Wheel, ...] = field(default=())

    @property
    def key(self) -> str:
        return canonical(self.name)


def _wheel(entry: dict) -> Wheel:
    url, path = entry.get("url"), entry.get("path")
    name = entry.get("name") or unquote(Path(urlparse(url).path if url else path or "").name)
    return Wheel(filename=name, url=url, path=path, sha256=(entry.get("hashes") or {}).get("sha256"))


def load(path: str | Path) -> list[LockedPackage]:
    """All packages of a pylock.toml, in file order."""
    path = Path(path)
    if not path.is_file():
        raise LockError(f"no lock at {path}: run `make lock` (or pass --lock PATH to the exported pylock.toml)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{path} is not valid TOML ({exc}): re-export it with `make lock`") from exc
    if "packages" not in data or "lock-version" not in data:
        raise LockError(f"{path} is not a pylock.toml (no lock-version/packages): re-export it with `make lock`")
    out = []
    for pkg in data["packages"]:
        directory = pkg.get("directory", {}).get("path") if isinstance(pkg.get("directory"), dict) else None
        out.append(
            LockedPackage(
                name=pkg["name"],
                version=pkg.get("version"),
                marker=pkg.get("marker"),
                index=pkg.get("index"),
                directory=directory,
                wheels=tuple(_wheel(w) for w in pkg.get("wheels", [])),
            )
        )
    return out


def for_environment(packages: list[LockedPackage], env: dict[str, str] | None = None) -> list[LockedPackage]:
    """The packages whose marker holds in `env` (the running interpreter by default)."""
    return [p for p in packages if markers.evaluate(p.marker, env)]


_WHEEL_NAME = re.compile(r"^(?P<name>.+?)-(?P<ver>[^-]+)(?:-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def wheel_fits(filename: str, python: tuple[int, int], machine: str = "x86_64", glibc=(2, 41)) -> bool:
    """Whether a wheel installs on Linux CPython `python` (e.g. (3, 13)) with that glibc."""
    m = _WHEEL_NAME.match(filename)
    if not m:
        return False
    major, minor = python
    pys, abis, plats = (set(m.group(g).split(".")) for g in ("py", "abi", "plat"))
    cp = f"cp{major}{minor}"
    py_ok = bool(pys & {cp, f"py{major}", f"py{major}{minor}"}) or any(
        t.startswith(f"cp{major}") and "abi3" in abis and int(t[3:] or 0) <= minor for t in pys
    )
    abi_ok = bool(abis & {"none", "abi3", cp})
    plat_ok = False
    for plat in plats:
        if plat == "any" or plat == f"linux_{machine}":
            plat_ok = True
        mm = re.match(rf"manylinux_(\d+)_(\d+)_{machine}$", plat)
        if mm and (int(mm.group(1)), int(mm.group(2))) <= glibc:
            plat_ok = True
        legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
        for tag, need in legacy.items():
            if plat == f"{tag}_{machine}" and need <= glibc:
                plat_ok = True
    return py_ok and abi_ok and plat_ok
