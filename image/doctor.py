"""Drift doctor: compare the running Python environment with the lock.

Run it with the environment's own interpreter (`python -m dflash_image.doctor`, or `dflash-doctor`
inside the container). Standard library only: it must work in the frozen environment as built.

What counts as drift: a locked package missing; a package the lock does not name (sglang,
flashinfer...); a wrong version or build (torch +cu130 for +cu128, `torch.version.cuda`); a file whose
content no longer matches its RECORD hash; a `.pth` or other file that no RECORD lists (`.pth`
files run at every interpreter start); a package installed by something other than uv (pip); and,
where an NVIDIA driver is loaded, userspace driver libraries in the container that do not match it.
Exit code: 0 clean, 1 drift, 2 the check itself could not run (no lock, bad arguments).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import json
import os
import re
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_image import pylock

REBUILD = "make rebuild (locally) or re-create the container from the template (make image)"
# Files uv's `venv` puts in site-packages itself; no wheel's RECORD lists them.
VENV_FILES = {"_virtualenv.py", "_virtualenv.pth"}
# Oldest driver per CUDA major version (NVIDIA's CUDA compatibility table, minor-version compatibility).
MIN_DRIVER = {12: (525, 60, 13), 13: (580, 65, 6)}
EXPECTED_INSTALLER = "uv"


@dataclass(frozen=True)
class Finding:
    kind: str  # missing | extra | version | build | modified | orphan-pth | orphan | installer | driver
    package: str | None
    detail: str
    fix: str


def site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()})


def _record_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


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


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def check_packages(locked, installed: dict[str, md.Distribution], site: Path) -> list[Finding]:
    findings = []
    wanted = {p.key: p for p in locked}
    for key, pkg in sorted(wanted.items()):
        dist = installed.get(key)
        if dist is None:
            findings.append(Finding("missing", pkg.name, f"{pkg.name} {pkg.version or ''} is locked but not installed".replace("  ", " "), REBUILD))
            continue
        have = dist.version
        if pkg.version and have.lower() != pkg.version.lower():
            base_have, base_want = have.split("+")[0], pkg.version.split("+")[0]
            kind = "build" if base_have == base_want else "version"
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


def check_files(installed: dict[str, md.Distribution], sites: list[Path], hashes: bool) -> tuple[list[Finding], int]:
    """RECORD verification, then files in site-packages that no RECORD lists."""
    findings, jobs, recorded = [], [], set()
    for dist in installed.values():
        name = dist.metadata["Name"]
        base = Path(dist.locate_file(""))
        for entry in dist.files or []:
            path = Path(os.path.normpath(base / entry))
            recorded.add(path)
            if entry.hash is not None:
                jobs.append((name, str(entry), path, entry.hash.value, entry.size))

    def verify(job):
        name, rel, path, digest, size = job
        try:
            if not hashes:
                return None if size is None or path.stat().st_size == size else (name, rel, "size changed")
            return None if _record_hash(path) == digest else (name, rel, "content changed")
        except FileNotFoundError:
            return name, rel, "deleted"

    with ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 2) * 2)) as pool:
        for bad in pool.map(verify, jobs):
            if bad:
                name, rel, how = bad
                findings.append(Finding("modified", name, f"{rel}: {how} since install (RECORD of {name})", REBUILD))

    orphans: dict[str, int] = {}
    for site in sites:
        for root, dirs, files in os.walk(site):
            for f in files:
                path = Path(root) / f
                if path in recorded or (f.endswith(".pyc") and Path(root).name == "__pycache__"):
                    continue
                rel = path.relative_to(site)
                if len(rel.parts) == 1 and f in VENV_FILES:
                    continue
                if f.endswith(".pth"):
                    findings.append(Finding("orphan-pth", None, f"{rel} is in no RECORD and runs at every interpreter start", f"delete it, then {REBUILD}"))
                else:
                    top = rel.parts[0]
                    orphans[top] = orphans.get(top, 0) + 1
    for top, n in sorted(orphans.items()):
        findings.append(Finding("orphan", None, f"{top}: {n} file(s) that no installed package's RECORD lists (left over by a removed or hand-copied package)", REBUILD))
    return findings, len(jobs)


def check_driver(system_root: Path, torch_cuda: str | None) -> tuple[list[Finding], dict]:
    """Where an NVIDIA driver is loaded: userspace libraries must match it, and it must be new enough."""
    info: dict = {}
    version_file = system_root / "proc/driver/nvidia/version"
    if not version_file.is_file():
        return [], {"driver": None}
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+\.\d+(?:\.\d+)?)", version_file.read_text(errors="replace"))
    if not m:
        return [Finding("driver", None, f"cannot read the driver version from {version_file}", "check the NVIDIA kernel module on the host")], info
    driver = m.group(1)
    info["driver"] = driver
    findings = []
    libs: dict[str, str] = {}
    for d in ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "usr/local/nvidia/lib64", "usr/local/nvidia/lib"):
        folder = system_root / d
        if folder.is_dir():
            for f in sorted(folder.iterdir()):
                lm = re.match(r"^(libcuda|libnvidia-ml|libnvidia-ptxjitcompiler)\.so\.(\d+\.\d+(?:\.\d+)?)$", f.name)
                if lm and not f.is_symlink():
                    libs[f"{d}/{f.name}"] = lm.group(2)
    info["userspace"] = libs
    if not libs:
        findings.append(Finding("driver", None, f"driver {driver} is loaded but no libcuda.so.* is in the container", "install the matching NVIDIA userspace libraries (no kernel module) or pass them through"))
    for lib, version in sorted(libs.items()):
        if version != driver:
            findings.append(Finding("driver", None, f"/{lib} is {version}, the host's kernel driver is {driver}", f"install userspace libraries {driver} in the container (they must match the host driver exactly)"))
    if torch_cuda:
        need = MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
        if need and _version_tuple(driver) < need:
            findings.append(Finding("driver", "torch", f"torch is built for CUDA {torch_cuda}, which needs driver >= {'.'.join(map(str, need))}; the host has {driver}", "upgrade the host driver, or keep torch on the lock's build"))
    return findings, info


def diagnose(lock_path: Path, hashes: bool = True, system_root: Path = Path("/")) -> dict:
    start = time.monotonic()
    locked = pylock.for_environment(pylock.load(lock_path))
    sites = site_dirs()
    installed: dict[str, md.Distribution] = {}
    for dist in md.distributions(path=[str(s) for s in sites]):
        installed.setdefault(pylock.canonical(dist.metadata["Name"]), dist)
    site = sites[0]
    findings = check_packages(locked, installed, site)
    file_findings, n_files = check_files(installed, sites, hashes)
    findings += file_findings
    driver_findings, driver_info = check_driver(system_root, _torch_cuda(site))
    findings += driver_findings
    return {
        "environment": sys.prefix,
        "python": sys.version.split()[0],
        "lock": str(lock_path),
        "clean": not findings,
        "locked_packages": len(locked),
        "installed_packages": len(installed),
        "files_checked": n_files,
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
            f"{report['files_checked']} files {'hashed' if report['hashes'] else 'size-checked'} "
            f"in {report['seconds']} s"
        ),
    ]
    gpu = report["gpu"]
    lines.append(f"  NVIDIA driver {gpu['driver']}" if gpu.get("driver") else "  no NVIDIA driver loaded: driver check skipped")
    if report["clean"]:
        lines.append("CLEAN: the environment matches the lock")
        return "\n".join(lines)
    lines.append(f"DRIFT: {len(report['findings'])} finding(s)")
    for f in report["findings"]:
        lines.append(f"  {f['kind']:<10} {f['detail']}")
    fixes = sorted({f["fix"] for f in report["findings"]})
    lines.append("fix: " + "; ".join(fixes))
    return "\n".join(lines)


def default_lock() -> Path:
    """The lock the environment was built from: $DFLASH_LOCK, else the copy kept inside the venv."""
    return Path(os.environ.get("DFLASH_LOCK") or Path(sys.prefix) / "dflash-lock" / "pylock.toml")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-doctor", description="Compare this Python environment with its lock.")
    ap.add_argument("--lock", type=Path, default=None, help="pylock.toml to compare with (default: the copy inside the venv)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-hash", action="store_true", help="compare file sizes instead of RECORD hashes (faster)")
    ap.add_argument("--system-root", type=Path, default=Path("/"), help="where /proc and the driver libraries are (tests, chroots)")
    args = ap.parse_args(argv)
    lock = args.lock or default_lock()
    try:
        report = diagnose(lock, hashes=not args.no_hash, system_root=args.system_root)
    except (pylock.LockError, ValueError) as exc:
        print(f"dflash doctor: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
