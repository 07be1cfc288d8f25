"""Rebuild a clean environment from the lock and the wheelhouse, offline, then run the doctor.

The same code builds the venv inside the image (the Dockerfile runs it) and restores a local one
(`make rebuild`). Files are copied, never hard-linked to a cache (tampering with a hard-linked file
would also change the cache and come back on the next install), and no uv cache is kept. The
venv's build manifest (every file's sha256) is written beside it at the end, for the doctor.
Standard library only: inside the image build and in a stock container it runs from a bare `python3`;
the one thing it needs `packaging` for, the lock's requires-python, it takes from the lock's own
packaging wheel in the wheelhouse when the running Python has none.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dflash_image import manifest, pylock
from dflash_image.digest import record_form, sha256_of

LOCK_FILES = ("pylock.toml", "requirements.txt", "uv.lock", "pyproject.toml")
LOCK_IN_VENV = "dflash-lock"  # where the doctor finds the lock a venv was built from


class RebuildError(RuntimeError):
    pass


def _run(cmd: list, what: str, env=None) -> None:
    print("+ " + " ".join(map(str, cmd)), flush=True)
    rc = subprocess.run([str(c) for c in cmd], check=False, env=env).returncode
    if rc != 0:
        raise RebuildError(f"{what} failed (exit {rc})")


def preflight(lock_dir: Path, wheelhouse: Path, trainer_wheel: Path, uv: str) -> None:
    """Everything the rebuild needs, checked before anything is touched."""
    if not (lock_dir / "requirements.txt").is_file() or not (lock_dir / "pylock.toml").is_file():
        raise RebuildError(f"{lock_dir} lacks requirements.txt/pylock.toml: run `make lock` (or `make lock-export`)")
    if not wheelhouse.is_dir() or not any(wheelhouse.glob("*.whl")):
        raise RebuildError(f"no wheels in {wheelhouse}: run `make wheelhouse` where the indexes are reachable")
    if not trainer_wheel.is_file():
        raise RebuildError(f"no trainer wheel at {trainer_wheel}: run `make trainer-wheel`")
    if not (Path(uv).is_file() and os.access(uv, os.X_OK)):
        raise RebuildError(f"uv not found at {uv}: install it (pip install uv) or pass --uv")


def python_version(python: str) -> str:
    """The version of the interpreter the venv will be built on (e.g. '3.13.5'), asked without its site hooks."""
    try:
        return subprocess.run([python, "-I", "-S", "-c", "import platform; print(platform.python_version())"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        raise RebuildError(f"cannot run {python} for the venv ({exc}): install Python or pass --python") from exc


def locked_wheel(lock_dir: Path, wheelhouse: Path, name: str) -> Path:
    """The lock's wheel of `name` in the wheelhouse, checked against the lock's sha256."""
    lock = lock_dir / "pylock.toml"
    for pkg in pylock.load(lock):
        if pkg.name != name:
            continue
        for wheel in pkg.wheels:
            path = wheelhouse / wheel.filename
            if path.is_file() and wheel.sha256 and sha256_of(path) == wheel.sha256:
                return path
    raise RebuildError(f"no wheel of {name} from {lock} in {wheelhouse} (the trainer depends on it): "
                       "run `make lock` and `make wheelhouse`")


def specifier_set(spec: str, lock_dir: Path, wheelhouse: Path):
    """`packaging`'s SpecifierSet: this Python's own, else the one in the lock's packaging wheel (a pure
    Python wheel imports from its zip), so a bare system Python reads the lock exactly as uv wrote it."""
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        sys.path.append(str(locked_wheel(lock_dir, wheelhouse, "packaging")))
        from packaging.specifiers import SpecifierSet
    return SpecifierSet(spec)


def python_refused(lock_dir: Path, wheelhouse: Path, version: str) -> str | None:
    """The lock's requires-python when Python `version` is outside it (a prerelease counts as its release),
    else None: this check for the rebuild here and for the image build's base (image/build.py)."""
    spec = pylock.requires_python(lock_dir / "pylock.toml")
    if spec and not specifier_set(spec, lock_dir, wheelhouse).contains(version, prereleases=True):
        return spec
    return None


def check_python(lock_dir: Path, wheelhouse: Path, python: str) -> str:
    """The venv's interpreter runs and is a version the lock allows (its requires-python, e.g. ==3.13.*), so
    a wrong base (Debian 12's 3.11 for a 3.13 lock) fails here, clearly, not as a missing wheel halfway through."""
    version = python_version(python)
    spec = python_refused(lock_dir, wheelhouse, version)
    if spec:
        raise RebuildError(f"{python} is Python {version}, but the lock needs Python {spec}: use a base with that "
                           "Python (the frozen template's Debian 13 has 3.13)")
    return version


def pin_install_stamps(venv: Path, epoch: int) -> int:
    """uv writes the install time into each dist-info's uv_cache.json (listed in RECORD), which makes two
    identical builds differ. For a reproducible image, set it to SOURCE_DATE_EPOCH and fix the RECORD line."""
    count = 0
    for stamp in sorted(venv.glob("lib/python*/site-packages/*.dist-info/uv_cache.json")):
        data = json.loads(stamp.read_text())
        data["timestamp"] = {"secs_since_epoch": epoch, "nanos_since_epoch": 0}
        body = json.dumps(data, separators=(",", ":")).encode()
        stamp.write_bytes(body)
        digest = record_form(hashlib.sha256(body).hexdigest())
        record = stamp.parent / "RECORD"
        entry = f"{stamp.parent.name}/uv_cache.json"
        lines = [f"{entry},sha256={digest},{len(body)}" if line.startswith(entry + ",") else line
                 for line in record.read_text().splitlines()]
        record.write_text("\n".join(lines) + "\n")
        count += 1
    return count


def rebuild(venv: Path, lock_dir: Path, wheelhouse: Path, trainer_wheel: Path, python: str, uv: str,
            doctor: bool = True) -> int:
    preflight(lock_dir, wheelhouse, trainer_wheel, uv)
    check_python(lock_dir, wheelhouse, python)
    venv = venv.absolute()
    env = {**os.environ, "UV_NO_CACHE": "1", "UV_LINK_MODE": "copy", "UV_OFFLINE": "1", "UV_NO_CONFIG": "1"}
    env.pop("VIRTUAL_ENV", None)
    old = venv.with_name(venv.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if venv.exists():
        venv.rename(old)  # kept until the new one is complete, so a failure loses nothing
    try:
        _run([uv, "venv", "--python", python, venv], "uv venv", env)
        vpy = venv / "bin" / "python"
        offline = ["--python", vpy, "--no-index", "--find-links", wheelhouse]
        _run([uv, "pip", "sync", *offline, "--require-hashes", lock_dir / "requirements.txt"],
             "install the locked wheels (hash-checked, offline)", env)
        _run([uv, "pip", "install", *offline, "--no-deps", trainer_wheel], "install the trainer wheel", env)
        if os.environ.get("SOURCE_DATE_EPOCH"):
            pin_install_stamps(venv, int(os.environ["SOURCE_DATE_EPOCH"]))
        keep = venv / LOCK_IN_VENV
        keep.mkdir()
        for name in LOCK_FILES:
            if (lock_dir / name).is_file():
                shutil.copy2(lock_dir / name, keep / name)
        # Hash-based .pyc: reproducible (no mtimes inside) and still checked against the source.
        env["PYTHONHASHSEED"] = "0"  # set constants (frozensets) are then marshalled in a fixed order
        _run([vpy, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "checked-hash",
              *sorted((venv / "lib").glob("python*/site-packages"))], "compile bytecode", env)
        manifest.write(venv, sha256_of(lock_dir / "pylock.toml"))
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        if old.exists():
            old.rename(venv)
            print(f"rebuild failed: the previous environment is back at {venv}", file=sys.stderr)
        raise
    shutil.rmtree(old, ignore_errors=True)
    print(f"rebuild: {venv} rebuilt from {lock_dir} and {wheelhouse}", flush=True)
    if not doctor:
        return 0
    return subprocess.run([venv / "bin" / "dflash-doctor", "--lock", venv / LOCK_IN_VENV / "pylock.toml"],
                          check=False).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_image.rebuild", description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, required=True, help="the environment to (re)create")
    ap.add_argument("--lock", type=Path, required=True, help="folder with requirements.txt and pylock.toml")
    ap.add_argument("--wheelhouse", type=Path, required=True)
    ap.add_argument("--trainer-wheel", type=Path, required=True)
    ap.add_argument("--python", default="python3", help="interpreter for the venv (the lock's Python version)")
    ap.add_argument("--uv", default=shutil.which("uv") or str(Path(sys.prefix) / "bin" / "uv"))
    ap.add_argument("--no-doctor", action="store_true")
    args = ap.parse_args(argv)
    try:
        return rebuild(args.venv, args.lock, args.wheelhouse, args.trainer_wheel, args.python, args.uv,
                       doctor=not args.no_doctor)
    except (RebuildError, pylock.LockError) as exc:
        print(f"rebuild: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
