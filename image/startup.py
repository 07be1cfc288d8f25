"""The venv the doctor checks, and what its interpreter puts on sys.path when it starts.

The doctor runs isolated (`python -I -S`), so it finds the venv the way site.py would (pyvenv.cfg
in bin/ or above it) instead of from sys.prefix, which only site.py points at the venv. What reaches
sys.path at a normal start is asked of a child interpreter: the base interpreter's site-packages come
in through include-system-site-packages = true, but also through a .pth line or a sitecustomize.
"""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from dflash_image.finding import REBUILD, Finding

PROBE = "import json, sys; json.dump(sys.path, open(sys.argv[1], 'w'))"


class NotAVenv(ValueError):
    pass


def venv_of(executable: str) -> Path:
    """The venv an interpreter belongs to (its unresolved path, as site.py sees it)."""
    bin_dir = Path(os.path.abspath(executable)).parent
    if (bin_dir / "pyvenv.cfg").is_file() or (bin_dir.parent / "pyvenv.cfg").is_file():
        return bin_dir.parent
    raise NotAVenv(f"{executable} is not the interpreter of a venv (no pyvenv.cfg): run the doctor installed in the "
                   "venv to check, VENV/bin/dflash-doctor")


def site_dirs(venv: Path) -> list[Path]:
    """The venv's site-packages (purelib and platlib; one folder on Debian and upstream CPython)."""
    paths = sysconfig.get_paths("venv", vars={"base": str(venv), "platbase": str(venv)})
    return sorted({Path(paths["purelib"]), Path(paths["platlib"])})


def pyvenv_cfg(venv: Path) -> dict[str, str]:
    cfg = {}
    for line in (venv / "pyvenv.cfg").read_text(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            cfg[key.strip().lower()] = value.strip()
    return cfg


def _sys_path(python: Path, flags: list[str]) -> tuple[list[str] | None, str]:
    """sys.path of `python` started with `flags`, written to a file (what it prints is not ours to parse)."""
    with tempfile.TemporaryDirectory(prefix="dflash-doctor-") as tmp:
        out = Path(tmp) / "sys_path.json"
        try:
            proc = subprocess.run([str(python), *flags, "-c", PROBE, str(out)], capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, str(exc)
        if proc.returncode != 0 or not out.is_file():
            return None, f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"
        return json.loads(out.read_text()), ""


def check(venv: Path, sites: list[Path]) -> list[Finding]:
    """pyvenv.cfg, then sys.path of a normal start of the venv's interpreter (in a child process: its
    startup hooks run there, never in the doctor): nothing outside the venv and the standard library."""
    findings = []
    if pyvenv_cfg(venv).get("include-system-site-packages", "false").lower() == "true":
        findings.append(Finding("system-site", None, f"{venv / 'pyvenv.cfg'} sets include-system-site-packages = true: "
                                "the base interpreter's site-packages are importable beside the locked packages",
                                f"set it to false, then {REBUILD}"))
    python = venv / "bin" / "python"
    stdlib, why = _sys_path(python, ["-I", "-S"])
    started, why_started = _sys_path(python, ["-E", "-P"]) if stdlib is not None else (None, why)
    if started is None:
        findings.append(Finding("startup", None, f"{python} does not start with its site hooks ({why_started})",
                                REBUILD))
        return findings
    inside = os.path.realpath(venv) + os.sep
    allowed = {os.path.realpath(p) for p in [*stdlib, *map(str, sites)]}
    outside = [p for p in started if os.path.realpath(p) not in allowed and not os.path.realpath(p).startswith(inside)]
    if outside:
        findings.append(Finding("sys-path", None, f"the venv's sys.path reaches outside the venv and the standard "
                                f"library: {', '.join(outside)} (packages there are importable beside the locked ones)",
                                "set include-system-site-packages = false in pyvenv.cfg and remove the .pth or "
                                f"sitecustomize that adds these, then {REBUILD}"))
    return findings
