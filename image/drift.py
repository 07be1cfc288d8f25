"""Drift: the suite against the newest allowed versions (`make drift`) or the lowest claimed ones (`make test-lowest`).

Resolves pyproject.toml's ranges for this machine (uv pip compile: the newest versions, or `lowest-direct`: every
direct dependency at its lower bound), prints which package moved from the committed uv.lock, builds a scratch
venv with exactly that resolution (hash-checked, as `make venv` does), runs the tests with it and says what broke.
So a lock refresh (`make dev-lock UPGRADE=1`) is a reviewed change: the drift it brings is known before it lands.
Exit: 0 the tests pass, 1 they fail (the report names the moved packages and the failing tests), 2 the run
itself could not be set up.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from dflash_image import devenv

FAILED_LINE = re.compile(r"^(FAILED|ERROR) ")


def locked_versions(project: Path) -> dict[str, str]:
    """name -> version of every package in the project's uv.lock (a package locked twice keeps its first)."""
    lock = tomllib.loads((project / "uv.lock").read_text())
    versions: dict[str, str] = {}
    for package in lock.get("package", []):
        if "version" in package and "registry" in package.get("source", {}):
            versions.setdefault(package["name"], package["version"])
    return versions


def compiled_versions(requirements: Path) -> dict[str, str]:
    """name -> version of a `uv pip compile` output."""
    pin = r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)"
    pins = re.findall(pin, requirements.read_text(), re.MULTILINE)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins}


def moved(locked: dict[str, str], resolved: dict[str, str]) -> list[str]:
    """One line per package whose version differs between the lock and the resolution."""
    lines = []
    for name in sorted(set(locked) | set(resolved)):
        before, after = locked.get(name), resolved.get(name)
        if before != after:
            lines.append(f"{name} {before or '(not locked)'} -> {after or '(gone)'}")
    return lines


def resolve(uv: Path, project: Path, out: Path, resolution: str, selection: list[str], sources: list[str]) -> None:
    devenv.run([uv, "pip", "compile", project / "pyproject.toml", "--resolution", resolution, "--generate-hashes",
                "--no-header", "--quiet", *selection, *sources, "-o", out],
               f"resolving the {resolution} allowed versions")


def scratch_venv(uv: Path, venv: Path, python: str, requirements: Path, sources: list[str],
                 editable: Path | None) -> None:
    devenv.run([uv, "venv", "--quiet", "--python", python, venv], f"creating {venv}")
    venv_python = venv / "bin" / "python"
    devenv.run([uv, "pip", "sync", "--require-hashes", "--python", venv_python, *sources, requirements],
               "installing the resolved versions")
    if editable:
        devenv.run([uv, "pip", "install", "--python", venv_python, "--no-deps", "--no-build-isolation", "-e",
                    editable], f"installing {editable} (editable)")


def run_tests(command: str, venv: Path, cwd: Path) -> tuple[int, list[str]]:
    """Run the test command ({python} is the scratch venv's interpreter), its output streamed; its exit code and
    failing tests."""
    shell_command = command.format(python=venv / "bin" / "python")
    print(f"+ {shell_command}", flush=True)
    failures = []
    with subprocess.Popen(shell_command, shell=True, cwd=cwd, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            if FAILED_LINE.match(line):
                failures.append(line.rstrip())
    return proc.returncode, failures


def report(resolution: str, moves: list[str], rc: int, failures: list[str]) -> int:
    label = "newest allowed" if resolution == "highest" else "lowest claimed"
    print(f"\ndrift: {len(moves)} package(s) differ between uv.lock and the {label} versions:")
    for line in moves:
        print(f"  {line}")
    if rc == 0:
        print(f"drift: the tests pass with the {label} versions")
        return 0
    print(f"drift: the tests FAIL with the {label} versions (exit {rc}):")
    for line in failures or ["(no test named: see the output above)"]:
        print(f"  {line}")
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_image.drift", description=__doc__.splitlines()[0])
    ap.add_argument("--resolution", choices=["highest", "lowest-direct"], default="highest")
    ap.add_argument("--project", type=Path, default=devenv.ROOT, help="the project (pyproject.toml, uv.lock)")
    ap.add_argument("--test-command", required=True, help="shell command; {python} is the scratch venv's")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the scratch venv is built on")
    ap.add_argument("--venv", type=Path, default=None, help="scratch venv (default: a temporary directory)")
    ap.add_argument("--uv", type=Path, default=Path(sys.prefix) / "bin" / "uv")
    ap.add_argument("--find-links", type=Path, default=None, help="resolve offline from this wheel directory only")
    ap.add_argument("--no-editable", action="store_true", help="do not install the project itself")
    ap.add_argument("--dev-extras", action="store_true", help="select the control and test extras and build group")
    args = ap.parse_args(argv)
    sources = devenv.source_args(args.find_links)
    selection = devenv.DEV_SELECTION if args.dev_extras else []
    try:
        with tempfile.TemporaryDirectory(prefix="dflash-drift-") as tmp:
            requirements, venv = Path(tmp) / "resolved.txt", args.venv or Path(tmp) / "venv"
            resolve(args.uv, args.project, requirements, args.resolution, selection, sources)
            moves = moved(locked_versions(args.project), compiled_versions(requirements))
            scratch_venv(args.uv, venv, args.python, requirements, sources,
                         None if args.no_editable else args.project)
            rc, failures = run_tests(args.test_command, venv, args.project)
    except devenv.DevEnvError as exc:
        print(f"drift: error: {exc}", file=sys.stderr)
        return 2
    return report(args.resolution, moves, rc, failures)


if __name__ == "__main__":
    sys.exit(main())
