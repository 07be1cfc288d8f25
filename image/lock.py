"""The lock: refresh it (`make lock`) and check it (`make lock-check`, run in CI).

uv.lock is the source of truth; pylock.toml (PEP 751) and requirements.txt (hashed, for pip users)
are exported from it. The checks: the lock matches pyproject.toml, torch resolves to a +cu128 build
from the PyTorch cu128 index, and every wheel and sdist carries a sha256.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import tomllib
from pathlib import Path

from dflash_image.commands import ToolError, run, uv

ENV_DIR = Path(__file__).resolve().parent / "env"
TORCH_BUILD = "+cu128"
TORCH_INDEX = "pytorch-cu128"
EXPORTS = {
    "pylock.toml": ["--format", "pylock.toml"],
    # pip cannot hash-check a local directory: the trainer is installed from its wheel, --no-deps.
    "requirements.txt": ["--format", "requirements.txt", "--no-emit-package", "dflash-trainer"],
}


def export(project: Path, out_dir: Path) -> None:
    for name, args in EXPORTS.items():
        run([uv(), "export", "--project", project, "--frozen", "--no-header", *args, "-o", out_dir / name],
            f"uv export {name}", stdout=sys.stderr)


def refresh(project: Path = ENV_DIR) -> None:
    """Re-resolve (needs PyPI and the cu128 index, or a local mirror) and re-export."""
    run([uv(), "lock", "--project", project], "uv lock (needs network to PyPI and download.pytorch.org/whl/cu128)")
    export(project, project)


def check(project: Path = ENV_DIR, offline: bool = True) -> list[str]:
    """Problems with the lock in `project`, each with its fix; empty when all is well."""
    lock_file = project / "uv.lock"
    if not lock_file.is_file():
        return [f"{lock_file} does not exist: run `make lock` on a machine that reaches PyPI and the cu128 index"]
    problems = _staleness_problems(project, offline)
    packages = tomllib.loads(lock_file.read_text()).get("package", [])
    return [*problems, *_torch_problems(project, packages), *_hash_problems(packages), *_export_problems(project)]


def _staleness_problems(project: Path, offline: bool) -> list[str]:
    """The lock must resolve what pyproject.toml asks for now."""
    try:
        run([uv(), "lock", "--check", "--project", project, *(["--offline"] if offline else [])], "uv lock --check")
    except ToolError as exc:
        return [f"the lock is not current with {project / 'pyproject.toml'} ({exc}): run `make lock`"]
    return []


def _torch_problems(project: Path, packages: list[dict]) -> list[str]:
    """torch must be locked, as a CUDA build, from the PyTorch index pyproject.toml names."""
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    indexes = {i["name"]: i["url"] for i in pyproject.get("tool", {}).get("uv", {}).get("index", [])}
    torch_index = indexes.get(TORCH_INDEX)
    torches = [p for p in packages if p["name"] == "torch"]
    if not torches:
        return ["torch is not in the lock: add torch==2.11.0 to image/env/pyproject.toml and run `make lock`"]
    problems = []
    for t in torches:
        registry = t.get("source", {}).get("registry")
        if not t["version"].endswith(TORCH_BUILD):
            problems.append(f"torch resolves to {t['version']}, not a {TORCH_BUILD} build: pin it to the "
                            f"{TORCH_INDEX} index in [tool.uv.sources] and run `make lock`")
        if torch_index is None or registry is None or registry.rstrip("/") != _strip_file(torch_index).rstrip("/"):
            problems.append(f"torch comes from {registry}, not the {TORCH_INDEX} index ({torch_index}): "
                            f"set torch = {{ index = \"{TORCH_INDEX}\" }} in [tool.uv.sources] and run `make lock`")
    return problems


def _hash_problems(packages: list[dict]) -> list[str]:
    """Every package from an index must come as wheels, and every wheel and sdist must carry a sha256."""
    problems = []
    for p in packages:
        if "registry" not in p.get("source", {}):
            continue  # the virtual env project and the trainer (a local directory) carry no hash
        if not p.get("wheels"):
            problems.append(f"{p['name']} {p['version']} has no wheel in the lock (it would build from source): "
                            "pin a version that ships wheels")
        for artefact in [*p.get("wheels", []), *([p["sdist"]] if "sdist" in p else [])]:
            if not str(artefact.get("hash", "")).startswith("sha256:"):
                where = artefact.get("url") or artefact.get("path")
                problems.append(f"{p['name']} {p['version']}: {where} has no sha256 in the lock (the index served it "
                                "without one): re-run `make lock` once the index serves hashes; never add one by hand")
    return problems


def _export_problems(project: Path) -> list[str]:
    """The committed exports must be what uv.lock exports now."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            export(project, Path(tmp))
        except ToolError as exc:
            return [f"cannot export the lock ({exc})"]
        return [f"{project / name} is missing or stale: run `make lock` (it re-exports it from uv.lock)"
                for name in EXPORTS
                if not (project / name).is_file() or (project / name).read_text() != (Path(tmp) / name).read_text()]


def _strip_file(url: str) -> str:
    # uv records a file:// index (the tests' stand-in) by its path.
    return url.removeprefix("file://")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_image.lock", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["refresh", "check", "export"])
    ap.add_argument("--project", type=Path, default=ENV_DIR, help="the environment's uv project (default image/env)")
    args = ap.parse_args(argv)
    try:
        if args.action == "refresh":
            refresh(args.project)
            return 0
        if args.action == "export":
            export(args.project, args.project)
            return 0
        problems = check(args.project)
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in problems:
        print(f"lock: {p}", file=sys.stderr)
    if not problems:
        print(f"lock: {args.project / 'uv.lock'} is current, torch is {TORCH_BUILD} from {TORCH_INDEX}, every wheel hashed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
