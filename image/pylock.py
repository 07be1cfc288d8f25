"""Reading the exported lock (pylock.toml, PEP 751).

`uv export --format pylock.toml` writes one entry per package with its marker and its wheels
(url or path, sha256). The doctor uses it to know what the environment should hold, the wheelhouse
to know what to download, the rebuild to find the lock's own `packaging` wheel. uv.lock stays the
source of truth; this file is derived from it. Reading needs only the standard library (the rebuild
runs under a bare system Python); evaluating markers needs `packaging`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse


class LockError(ValueError):
    """The lock file is missing or malformed."""


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


def _wheel(entry: dict) -> Wheel:
    url, path = entry.get("url"), entry.get("path")
    name = entry.get("name") or unquote(Path(urlparse(url).path if url else path or "").name)
    return Wheel(filename=name, url=url, path=path, sha256=(entry.get("hashes") or {}).get("sha256"))


def _read(path: Path) -> dict:
    if not path.is_file():
        raise LockError(f"no lock at {path}: run `make lock` (or pass --lock PATH to the exported pylock.toml)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{path} is not valid TOML ({exc}): re-export it with `make lock`") from exc
    if "packages" not in data or "lock-version" not in data:
        raise LockError(f"{path} is not a pylock.toml (no lock-version/packages): re-export it with `make lock`")
    return data


def load(path: str | Path) -> list[LockedPackage]:
    """All packages of a pylock.toml, in file order."""
    data = _read(Path(path))
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


def requires_python(path: str | Path) -> str | None:
    """The lock's requires-python (e.g. '==3.13.*'), None when it sets none."""
    return _read(Path(path)).get("requires-python")


def for_environment(packages: list[LockedPackage], env: dict[str, str] | None = None) -> list[LockedPackage]:
    """The packages whose marker holds in `env` (PEP 508 names; the running interpreter by default)."""
    # Imported here: reading a lock must work without packaging (see above).
    from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName

    out = []
    for p in packages:
        try:
            if not p.marker or Marker(p.marker).evaluate(env, context="lock_file"):
                out.append(p)
        # KeyError: packaging < 26.4 evaluates a lock marker naming `extra` without one in the environment.
        except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName, KeyError) as exc:
            raise LockError(f"{p.name}: its marker {p.marker!r} is not a valid lock marker (PEP 508/751: {exc!r}): "
                            "re-export the lock with `make lock`") from exc
    return out
