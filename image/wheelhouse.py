"""The wheelhouse: every locked wheel for the target, downloaded once, each checked against its sha256.

An air-gapped host (or the image build, which has no network) then installs from it offline, with
hash checking (`make rebuild`, `make image`). Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import urllib.request
from pathlib import Path

from dflash_image import markers, pylock


class WheelhouseError(RuntimeError):
    """A wheel is missing, unhashed, unreachable or corrupt."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def plan(lock_path: Path, python: str, machine: str = "x86_64", glibc: tuple[int, int] = (2, 41)):
    """(package, wheel) pairs the target needs; raises if a package has no fitting, hashed wheel."""
    env = markers.target_environment(python, machine)
    py = tuple(int(x) for x in python.split(".")[:2])
    out = []
    for pkg in pylock.for_environment(pylock.load(lock_path), env):
        if pkg.directory:
            continue  # the trainer: built from this repository (make trainer-wheel)
        fits = [w for w in pkg.wheels if pylock.wheel_fits(w.filename, py, machine, glibc)]
        if not fits:
            raise WheelhouseError(f"{pkg.name} {pkg.version}: no locked wheel fits python {python} on "
                                  f"{machine} (glibc {'.'.join(map(str, glibc))}); locked: "
                                  f"{', '.join(w.filename for w in pkg.wheels) or 'none'}")
        wheel = fits[0]
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
