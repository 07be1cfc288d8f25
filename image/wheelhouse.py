"""The wheelhouse: every locked wheel for the target, downloaded once, each checked against its sha256.

An air-gapped host (or the image build, which has no network) then installs from it offline, with
hash checking (`make rebuild`, `make image`). Runs on the controller: markers and wheel tags are read
with `packaging`, for the target (the image's Linux CPython), not for the machine it runs on.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import urllib.request
from pathlib import Path

from dflash_image import pylock
from dflash_image.digest import sha256_of
from packaging import tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

# manylinux tags older than PEP 600's manylinux_x_y, each the alias of a glibc version.
LEGACY_MANYLINUX = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}


class WheelhouseError(RuntimeError):
    """A wheel is missing, unhashed, unreachable or corrupt."""


def target_environment(python: str, machine: str = "x86_64") -> dict[str, str]:
    """PEP 508 marker variables of a Linux CPython target (the image), e.g. python='3.13' or '3.13.5'."""
    parts = python.split(".")
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


def target_tags(python: str, machine: str = "x86_64", glibc: tuple[int, int] = (2, 41)) -> list[tags.Tag]:
    """The wheel tags a Linux CPython `python` with that glibc installs, most specific first (as pip and
    uv rank them). packaging's own platform list describes the running machine, not the image."""
    major, minor = (int(x) for x in python.split(".")[:2])
    platforms = []
    for glibc_minor in range(glibc[1], 4, -1):  # manylinux starts at glibc 2.5
        platforms.append(f"manylinux_{glibc[0]}_{glibc_minor}_{machine}")
        if (glibc[0], glibc_minor) in LEGACY_MANYLINUX:
            platforms.append(f"{LEGACY_MANYLINUX[glibc[0], glibc_minor]}_{machine}")
    platforms.append(f"linux_{machine}")
    interpreter = f"cp{major}{minor}"
    return [*tags.cpython_tags((major, minor), [interpreter], platforms),
            *tags.compatible_tags((major, minor), interpreter, platforms)]


def best_wheel(wheels, ranked: list[tags.Tag]):
    """The wheel an installer would pick for the target (its best-ranked tag), or None if none fits."""
    rank = {t: i for i, t in enumerate(ranked)}
    best, best_rank = None, len(rank)
    for w in wheels:
        try:
            wheel_tags = parse_wheel_filename(w.filename)[3]
        except InvalidWheelFilename:
            continue
        r = min((rank[t] for t in wheel_tags if t in rank), default=len(rank))
        if r < best_rank:
            best, best_rank = w, r
    return best


def plan(lock_path: Path, python: str, machine: str = "x86_64", glibc: tuple[int, int] = (2, 41)):
    """(package, wheel) pairs the target needs; raises if a package has no fitting, hashed wheel."""
    ranked = target_tags(python, machine, glibc)
    out = []
    for pkg in pylock.for_environment(pylock.load(lock_path), target_environment(python, machine)):
        if pkg.directory:
            continue  # the trainer: built from this repository (make trainer-wheel)
        wheel = best_wheel(pkg.wheels, ranked)
        if wheel is None:
            raise WheelhouseError(f"{pkg.name} {pkg.version}: no locked wheel fits python {python} on "
                                  f"{machine} (glibc {'.'.join(map(str, glibc))}); locked: "
                                  f"{', '.join(w.filename for w in pkg.wheels) or 'none'}")
        if not wheel.sha256:
            raise WheelhouseError(f"{wheel.filename} has no sha256 in {lock_path}: refusing to download it unchecked; "
                                  "re-run `make lock` once the index serves hashes")
        out.append((pkg, wheel))
    return out


def fetch(lock_path: Path, dest: Path, python: str, machine: str = "x86_64", glibc=(2, 41)) -> list[Path]:
    """Download what `plan` lists into `dest`, skipping wheels already there with the right hash."""
    todo = plan(lock_path, python, machine, glibc)
    dest.mkdir(parents=True, exist_ok=True)
    got = []
    for pkg, wheel in todo:
        target = dest / wheel.filename
        if target.is_file() and sha256_of(target) == wheel.sha256:
            got.append(target)
            continue
        source = wheel.url or (lock_path.parent / wheel.path).resolve().as_uri()
        print(f"wheelhouse: {wheel.filename} <- {source}", flush=True)
        part = target.with_name(target.name + ".part")
        try:
            with urllib.request.urlopen(source, timeout=120) as resp, open(part, "wb") as out:
                shutil.copyfileobj(resp, out, 1 << 20)
        except OSError as exc:
            part.unlink(missing_ok=True)
            raise WheelhouseError(f"cannot download {source} ({exc}): this needs network to its index; "
                                  "or copy a wheelhouse made elsewhere into place") from exc
        actual = sha256_of(part)
        if actual != wheel.sha256:
            part.unlink()
            raise WheelhouseError(f"{wheel.filename}: sha256 {actual} does not match the lock's {wheel.sha256}; "
                                  "the download is corrupt or the index changed the file: nothing was kept")
        part.rename(target)
        got.append(target)
    print(f"wheelhouse: {len(got)} wheels in {dest}, all matching the lock")
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_image.wheelhouse", description=__doc__.splitlines()[0])
    ap.add_argument("--lock", type=Path, required=True, help="the exported pylock.toml")
    ap.add_argument("--dest", type=Path, required=True)
    ap.add_argument("--python", default="3.13", help="target interpreter (the image's: Debian 13 has 3.13)")
    ap.add_argument("--glibc", default="2.41", help="target glibc (Debian 13: 2.41)")
    args = ap.parse_args(argv)
    try:
        fetch(args.lock, args.dest, args.python, glibc=tuple(int(x) for x in args.glibc.split(".")))
    except (WheelhouseError, pylock.LockError) as exc:
        print(f"wheelhouse: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
