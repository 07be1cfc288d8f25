"""Drift doctor: compare a venv with its lock and with the manifest written when it was built.

Run it as `dflash-doctor` (on PATH inside the container; VENV/bin/dflash-doctor elsewhere). It checks the
venv it is installed in, with that venv's interpreter started isolated (`python -I -S`): none of the
venv's startup hooks (.pth files, sitecustomize) run in the doctor's process, so they can neither print
into its report nor change what it sees. `python -m dflash_image.doctor` re-executes itself through that
launcher (the hooks have then run once, in the interpreter that started it).

What counts as drift: a locked package missing; a package the lock does not name (sglang, flashinfer...);
a wrong version or build (torch +cu130 for +cu128, `torch.version.cuda`); a file whose content no longer
matches its RECORD hash or the build manifest (so a RECORD line rewritten to fit does not hide it); a
`.pyc` that Python would run instead of its source and that does not match a fresh compile of it; a
`.pth`, sitecustomize or other file that no RECORD lists (`.pth` files and sitecustomize run at every
interpreter start); anything outside the venv and the standard library on the venv's sys.path (the base
interpreter's site-packages through include-system-site-packages = true, a .pth line, a sitecustomize);
a package installed by something other than uv (pip); and, where an NVIDIA driver is loaded, userspace
driver libraries that do not match it.
Exit code: 0 clean, 1 drift, 2 the check itself could not run (no lock, not a venv, bad arguments).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from dflash_image import integrity, manifest, pylock, startup
from dflash_image.digest import sha256_of
from dflash_image.finding import REBUILD, Finding

try:
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # main() says so: the venv lacks a dependency of the trainer
    canonicalize_name = None

# Oldest driver per CUDA major version (NVIDIA's CUDA compatibility table, minor-version compatibility).
MIN_DRIVER = {12: (525, 60, 13), 13: (580, 65, 6)}
EXPECTED_INSTALLER = "uv"


def _cuda_of(version: str | None) -> str | None:
    """'2.11.0+cu128' -> '12.8'; None for a build without a CUDA tag."""
    m = re.search(r"\+cu(\d+)(\d)$", version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _torch_cuda(site: Path) -> str | None:
    """torch.version.cuda, read from torch/version.py without importing torch (seconds saved)."""
    f = site / "torch" / "version.py"
    if not f.is_file():
        return None
    m = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", f.read_text(errors="replace"), re.MULTILINE)
    return m.group(1) if m else None


def _version(v: str):
    try:
        return Version(v)
    except InvalidVersion:
        return v


def _public(v: str) -> str:
    """The release without its local part: 2.11.0+cu128 -> 2.11.0."""
    parsed = _version(v)
    return parsed.public if isinstance(parsed, Version) else v.split("+")[0]


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def check_packages(locked, installed: dict[str, md.Distribution], site: Path) -> list[Finding]:
    findings = []
    wanted = {canonicalize_name(p.name): p for p in locked}
    for key, pkg in sorted(wanted.items()):
        dist = installed.get(key)
        if dist is None:
            findings.append(Finding("missing", pkg.name, f"{pkg.name} {pkg.version or ''} is locked but not installed".replace("  ", " "), REBUILD))
            continue
        have = dist.version
        if pkg.version and _version(have) != _version(pkg.version):
            # the same release with another local version (+cu130 for +cu128) is another build of it
            kind = "build" if _public(have) == _public(pkg.version) else "version"
            what = "build" if kind == "build" else "version"
            findings.append(Finding(kind, pkg.name, f"{pkg.name} {have} installed, the lock pins {pkg.version} (wrong {what})", REBUILD))
        if key == "torch":
            want_cuda, have_cuda = _cuda_of(pkg.version), _torch_cuda(site)
            if want_cuda and have_cuda != want_cuda:
                findings.append(Finding("build", "torch", f"torch.version.cuda is {have_cuda}, the lock's build {pkg.version} means CUDA {want_cuda}", REBUILD))
    for key, dist in sorted(installed.items()):
        if key not in wanted:
            findings.append(Finding("extra", dist.metadata["Name"], f"{dist.metadata['Name']} {dist.version} is installed but not in the lock", REBUILD))
    for key, dist in sorted(installed.items()):
        installer = (dist.read_text("INSTALLER") or "").strip()
        if installer != EXPECTED_INSTALLER:
            findings.append(Finding("installer", dist.metadata["Name"], f"{dist.metadata['Name']} was installed by {installer or 'an unknown tool'}, not by {EXPECTED_INSTALLER} from the lock", REBUILD))
    return findings


# Where a container's NVIDIA userspace driver libraries may sit, relative to its root.
DRIVER_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "usr/local/nvidia/lib64", "usr/local/nvidia/lib")
DRIVER_LIB = re.compile(r"^(libcuda|libnvidia-ml|libnvidia-ptxjitcompiler)\.so\.(\d+\.\d+(?:\.\d+)?)$")


def check_driver(system_root: Path, torch_cuda: str | None) -> tuple[list[Finding], dict]:
    """Where an NVIDIA driver is loaded: userspace libraries must match it, and it must be new enough."""
    version_file = system_root / "proc/driver/nvidia/version"
    if not version_file.is_file():
        return [], {"driver": None}
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+\.\d+(?:\.\d+)?)", version_file.read_text(errors="replace"))
    if not m:
        return [Finding("driver", None, f"cannot read the driver version from {version_file}", "check the NVIDIA kernel module on the host")], {}
    driver = m.group(1)
    libs = _userspace_driver_libs(system_root)
    findings = _userspace_mismatches(driver, libs) + _driver_too_old(driver, torch_cuda)
    return findings, {"driver": driver, "userspace": libs}


def _userspace_driver_libs(system_root: Path) -> dict[str, str]:
    """Each NVIDIA userspace driver library file (no symlink) -> its version, keyed by its path under the root."""
    libs: dict[str, str] = {}
    for d in DRIVER_LIB_DIRS:
        folder = system_root / d
        if not folder.is_dir():
            continue
        for f in sorted(folder.iterdir()):
            lm = DRIVER_LIB.match(f.name)
            if lm and not f.is_symlink():
                libs[f"{d}/{f.name}"] = lm.group(2)
    return libs


def _userspace_mismatches(driver: str, libs: dict[str, str]) -> list[Finding]:
    """The userspace libraries must exist and match the host's kernel driver exactly."""
    if not libs:
        return [Finding("driver", None, f"driver {driver} is loaded but no libcuda.so.* is in the container", "install the matching NVIDIA userspace libraries (no kernel module) or pass them through")]
    return [Finding("driver", None, f"/{lib} is {version}, the host's kernel driver is {driver}", f"install userspace libraries {driver} in the container (they must match the host driver exactly)")
            for lib, version in sorted(libs.items()) if version != driver]


def _driver_too_old(driver: str, torch_cuda: str | None) -> list[Finding]:
    """The driver must be at least the oldest one torch's CUDA major version runs on."""
    need = MIN_DRIVER.get(int(torch_cuda.split(".")[0])) if torch_cuda else None
    if need and _version_tuple(driver) < need:
        return [Finding("driver", "torch", f"torch is built for CUDA {torch_cuda}, which needs driver >= {'.'.join(map(str, need))}; the host has {driver}", "upgrade the host driver, or keep torch on the lock's build")]
    return []


def diagnose(lock_path: Path, venv: Path, manifest_path: Path | None = None, hashes: bool = True,
             system_root: Path = Path("/")) -> dict:
    start = time.monotonic()
    locked = pylock.for_environment(pylock.load(lock_path))
    sites = startup.site_dirs(venv)
    installed: dict[str, md.Distribution] = {}
    for dist in md.distributions(path=[str(s) for s in sites]):
        installed.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    site = sites[0]
    findings = startup.check(venv, sites)
    manifest_path = manifest_path or manifest.path_for(venv)
    try:
        built = manifest.load(manifest_path)
    except manifest.ManifestError as exc:
        built = None
        findings.append(Finding("manifest", None, f"{exc}: without it, a file whose RECORD line was rewritten to "
                                "match cannot be told from the one the build installed", REBUILD))
    if built and built["lock_sha256"] != sha256_of(lock_path):
        findings.append(Finding("manifest", None, f"{manifest_path} is the manifest of a build from another lock "
                                f"than {lock_path}", REBUILD))
    findings += check_packages(locked, installed, site)
    local = {canonicalize_name(p.name) for p in locked if p.directory}
    file_findings, checked = integrity.check(venv, installed, {canonicalize_name(p.name) for p in locked}, local,
                                             sites, built, hashes)
    findings += file_findings
    driver_findings, driver_info = check_driver(system_root, _torch_cuda(site))
    findings += driver_findings
    return {
        "environment": str(venv),
        "python": sys.version.split()[0],
        "lock": str(lock_path),
        "manifest": str(manifest_path) if built else None,
        "manifest_sha256": sha256_of(manifest_path) if built else None,
        "clean": not findings,
        "locked_packages": len(locked),
        "installed_packages": len(installed),
        "files_checked": checked["files"],
        "pyc_compiled": checked["pyc_compiled"],
        "hashes": hashes,
        "torch_cuda": _torch_cuda(site),
        "gpu": driver_info,
        "seconds": round(time.monotonic() - start, 2),
        "findings": [asdict(f) for f in findings],
    }


def render(report: dict) -> str:
    lines = [
        f"dflash doctor: {report['environment']} (python {report['python']}) against {report['lock']}",
        (
            f"  {report['locked_packages']} locked, {report['installed_packages']} installed, "
            f"{report['files_checked']} files {'hashed' if report['hashes'] else 'size-checked'}, "
            f"{report['pyc_compiled']} .pyc compiled, in {report['seconds']} s"
        ),
    ]
    lines.append(f"  build manifest {report['manifest']} (sha256 {report['manifest_sha256']})" if report["manifest"]
                 else "  no build manifest")
    gpu = report["gpu"]
    lines.append(f"  NVIDIA driver {gpu['driver']}" if gpu.get("driver") else "  no NVIDIA driver loaded: driver check skipped")
    if report["clean"]:
        lines.append("CLEAN: the environment matches the lock")
        return "\n".join(lines)
    lines.append(f"DRIFT: {len(report['findings'])} finding(s)")
    for f in report["findings"]:
        lines.append(f"  {f['kind']:<12} {f['detail']}")
    fixes = sorted({f["fix"] for f in report["findings"]})
    lines.append("fix: " + "; ".join(fixes))
    return "\n".join(lines)


def default_lock(venv: Path) -> Path:
    """The lock the venv was built from: $DFLASH_LOCK, else the copy kept inside the venv."""
    return Path(os.environ.get("DFLASH_LOCK") or venv / "dflash-lock" / "pylock.toml")


def _reexec_isolated() -> None:
    """Started with site (python -m dflash_image.doctor): run again through the venv's dflash-doctor launcher,
    which starts the interpreter isolated. Output the hooks buffered and Python has not written yet is dropped
    with the old process image."""
    try:
        venv = startup.venv_of(sys.executable)
    except startup.NotAVenv:
        return
    if Path(__file__).resolve().parent.parent not in {s.resolve() for s in startup.site_dirs(venv)}:
        return  # not installed in this venv (a source checkout): the isolated start would not find the package
    # The trainer wheel that installed this package ships the launcher (script-files) into the venv's bin/.
    launcher = venv / "bin" / "dflash-doctor"
    if not os.access(launcher, os.X_OK):
        return  # removed since: run here; the report names it (a file of the wheel's RECORD is missing)
    os.execv(launcher, [str(launcher), *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    if argv is None and not sys.flags.no_site:
        _reexec_isolated()
    ap = argparse.ArgumentParser(prog="dflash-doctor", description="Compare this venv with its lock and its build manifest.")
    ap.add_argument("--lock", type=Path, default=None, help="pylock.toml to compare with (default: the copy inside the venv)")
    ap.add_argument("--manifest", type=Path, default=None, help="the build manifest (default: beside the venv, VENV.manifest.json)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-hash", action="store_true", help="compare file sizes instead of hashes (faster)")
    ap.add_argument("--system-root", type=Path, default=Path("/"), help="where /proc and the driver libraries are (tests, chroots)")
    args = ap.parse_args(argv)
    if canonicalize_name is None:
        print("dflash doctor: error: this venv has no `packaging` (a dependency of the trainer, which the doctor "
              f"reads the lock with): {REBUILD}", file=sys.stderr)
        return 2
    try:
        venv = startup.venv_of(sys.executable)
        lock = args.lock or default_lock(venv)
        report = diagnose(lock, venv, args.manifest, hashes=not args.no_hash, system_root=args.system_root)
    except (pylock.LockError, startup.NotAVenv, ValueError) as exc:
        print(f"dflash doctor: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
