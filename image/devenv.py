"""The development venv, installed from the committed lock (uv.lock): `make venv`, `make dev-lock`, `make dev-wheels`.

`install` builds VENV with exactly the lock's versions and hashes (runtime, the control and test extras, the
locked setuptools for the editable install) plus z-lab's `dflash` (requirements-zlab.txt, without its own
pins). torch comes as PyPI serves it for the platform (--torch-build lock: the CUDA build on Linux), or as the
CPU build of the locked version (cpu), looked for where this machine's pip is configured to look (find-links,
index-url, extra-index-url), then in --torch-cpu-index (the PyTorch CPU index, or a directory of wheels);
auto takes that CPU build where no NVIDIA driver is loaded and one of those places serves it, else PyPI's
build. With --wheels DIR nothing is downloaded: every file comes from DIR (fill it with `make dev-wheels`).

A venv is only good once its stamp (VENV/.installed) names the lock it was built from: the stamp is removed
before anything is touched and written last, so an interrupted or failed install never passes for a good one.
Standard library only: it runs from the bare `python3` that creates the venv.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11: say so before anything else fails
    sys.exit(f"error: {sys.executable} is Python {sys.version.split()[0]}; the development venv needs 3.11-3.13: "
             "pass PYTHON=python3.12 (say)")

ROOT = Path(__file__).resolve().parent.parent
ZLAB_PINS = "requirements-zlab.txt"  # z-lab's dflash, installed without its own (exact, foreign) pins
DEV_SELECTION = ["--extra", "control", "--extra", "test", "--group", "build"]
SUPPORTED_MACHINES = ("x86_64", "aarch64")  # [tool.uv] environments in pyproject.toml
SUPPORTED_PYTHON = ((3, 11), (3, 13))
# What PyPI's Linux torch pulls in for CUDA and the CPU build does without.
CUDA_RUNTIME = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
STAMP = ".installed"


class DevEnvError(RuntimeError):
    """The venv cannot be built as asked; the message names the fix."""


def platform_problem(system: str, machine: str, python: tuple[int, int]) -> str | None:
    """Why the lock cannot serve this machine, or None."""
    low, high = SUPPORTED_PYTHON
    if system != "Linux" or machine not in SUPPORTED_MACHINES or not low <= python <= high:
        return (f"uv.lock covers Linux {' and '.join(SUPPORTED_MACHINES)} with CPython {low[0]}.{low[1]}-"
                f"{high[0]}.{high[1]}, not {system} {machine} with Python {python[0]}.{python[1]}: use a supported "
                "machine, or PYTHON=python3.12 (say) for another interpreter, or add the platform to [tool.uv] "
                "environments in pyproject.toml and run `make dev-lock`")
    return None


def _python_of(python: str) -> tuple[int, int]:
    try:
        out = subprocess.run([python, "-I", "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise DevEnvError(f"cannot run {python} ({exc}): install Python 3.11-3.13 or pass PYTHON=...") from exc
    return int(out[0]), int(out[1])


def stamp_text(project: Path, python: tuple[int, int], torch_build: str) -> str:
    """What a venv built from `project`'s lock for this interpreter and torch build records in its stamp."""
    lines = [f"python {python[0]}.{python[1]}", f"torch-build {torch_build}"]
    for name in ("pyproject.toml", "uv.lock", ZLAB_PINS):
        path = project / name
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "absent"
        lines.append(f"{name} {digest}")
    return "\n".join(lines) + "\n"


def run(cmd: list, what: str) -> str:
    """Run a step, echo it, return its stdout; on failure raise with the tail of its stderr."""
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise DevEnvError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    sys.stderr.write(proc.stderr)  # uv's summary and any warning stay visible (CI greps them for deprecations)
    return proc.stdout


def locked_package(project: Path, name: str) -> dict:
    lock = tomllib.loads((project / "uv.lock").read_text())
    for package in lock.get("package", []):
        if package["name"] == name:
            return package
    raise DevEnvError(f"{name} is not in {project / 'uv.lock'}: run `make dev-lock`")


def uv_requirement(project: Path) -> str:
    """uv's pin with every hash the lock holds for it: pip installs it (hash-checked) to install the rest."""
    uv = locked_package(project, "uv")
    hashes = [f["hash"] for f in [*uv.get("wheels", []), uv.get("sdist", {})] if f.get("hash")]
    return " ".join([f"uv=={uv['version']}", *(f"--hash={h}" for h in hashes)])


def source_args(wheels: Path | None) -> list[str]:
    """uv/pip arguments that keep every download inside the wheel cache when there is one."""
    return ["--offline", "--no-index", "--find-links", str(wheels)] if wheels else []


def bootstrap_uv(venv: Path, python: str, project: Path, wheels: Path | None) -> Path:
    """A venv holding the locked uv (pip checks its hash); uv installs the rest."""
    uv = venv / "bin" / "uv"
    if not (venv / "bin" / "python").exists():
        run([python, "-m", "venv", venv], f"creating the venv {venv}")
    if uv.exists() and run([uv, "--version"], "uv --version").split()[1] == locked_package(project, "uv")["version"]:
        return uv
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp) / "uv.txt"
        pins.write_text(uv_requirement(project) + "\n")
        pip_source = ["--no-index", "--find-links", str(wheels)] if wheels else []
        run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--require-hashes", *pip_source,
             "-r", pins], "installing uv from the lock" + (f" (wheel cache {wheels})" if wheels else ""))
    return uv


def check_lock_current(uv: Path, project: Path) -> None:
    try:
        run([uv, "lock", "--check", "--offline", "--project", project], "uv lock --check")
    except DevEnvError as exc:
        raise DevEnvError(f"{project / 'uv.lock'} is stale: {project / 'pyproject.toml'} changed since it was "
                          f"locked. Run `make dev-lock` and commit uv.lock ({exc})") from exc


def export_requirements(uv: Path, project: Path, out: Path, selection: list[str], skip: list[str]) -> None:
    """The lock's packages for `selection`, hashed, as a requirements file (uv export reads the lock only)."""
    skips = [arg for name in skip for arg in ("--no-emit-package", name)]
    run([uv, "export", "--frozen", "--project", project, "--format", "requirements.txt", "--no-emit-project",
         "--no-header", *selection, *skips, "-o", out], "exporting the lock")


def cpu_only_skips(project: Path) -> list[str]:
    """torch and the CUDA runtime it pulls in: the CPU build replaces them."""
    lock = tomllib.loads((project / "uv.lock").read_text())
    return ["torch", *sorted(p["name"] for p in lock.get("package", []) if CUDA_RUNTIME.match(p["name"]))]


def _local_requirement(directory: Path, name: str, version: str) -> str:
    """A hashed pin of the wheels of name==version in a directory (uv hashes no local find-links file)."""
    files = sorted(directory.glob(f"{name}-{version}-*.whl"))
    if not files:
        raise DevEnvError(f"no {name}-{version}-*.whl in {directory}")
    hashes = [f"--hash=sha256:{hashlib.sha256(f.read_bytes()).hexdigest()}" for f in files]
    return " ".join([f"{name}=={version}", *hashes]) + "\n"


# --- Where torch comes from -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TorchSource:
    """A place that may serve the CPU build of torch, and who named it (pip's configuration, TORCH_CPU_INDEX, the
    wheel cache). kind: "index" (PEP 503), "directory" of wheels, or "page" (a find-links page of links)."""

    named_by: str
    where: str
    kind: str = "index"

    def __str__(self) -> str:
        return f"{self.named_by} {self.where}"

    def uv_args(self) -> list[str]:
        """uv arguments that look here and nowhere else."""
        return ["--index-url", self.where] if self.kind == "index" else ["--no-index", "--find-links", self.where]


def find_links_source(named_by: str, entry: str) -> TorchSource:
    """A find-links entry as pip reads it: a directory (a path or a file:// URL) or a page of links (a URL)."""
    url = urllib.parse.urlparse(entry)
    if url.scheme in ("http", "https"):
        return TorchSource(named_by, entry, "page")
    path = urllib.request.url2pathname(url.path) if url.scheme == "file" else entry
    return TorchSource(named_by, path, "page" if Path(path).is_file() else "directory")


def read_pip_config(commands: list[list[str]]) -> dict[str, str] | None:
    """Where `pip install` looks on this machine, as the first pip of `commands` that runs reads it (its config
    files and PIP_* variables, merged by pip itself); None where no pip runs."""
    for command in commands:
        try:
            proc = subprocess.run([*command, "config", "list"], capture_output=True, text=True, check=False,
                                  timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode == 0:
            return parse_pip_config(proc.stdout)
    return None


PIP_SECTIONS = {"global": 0, "install": 1, ":env:": 2}  # what `pip install` reads, the later overriding


def parse_pip_config(listing: str) -> dict[str, str]:
    """`pip config list` (section.key='value' lines, each key already merged across pip's files) as install sees
    it: a PIP_* variable (section :env:) over the [install] section over [global]."""
    settings: dict[str, str] = {}
    rank: dict[str, int] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in PIP_SECTIONS and PIP_SECTIONS[section] >= rank.get(name, -1):
            try:
                settings[name] = str(ast.literal_eval(value))
            except (ValueError, SyntaxError):
                continue
            rank[name] = PIP_SECTIONS[section]
    return settings


def pip_sources(settings: dict[str, str]) -> list[TorchSource]:
    """pip's find-links, then its index-url and extra-index-url (unless no-index), in pip's order."""
    sources = [find_links_source("pip's find-links", entry) for entry in settings.get("find-links", "").split()]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        return sources
    return [*sources, *(TorchSource(f"pip's {key}", url) for key in ("index-url", "extra-index-url")
                        for url in settings.get(key, "").split())]


def torch_sources(cpu_index: str, wheels: Path | None, pip_config: dict[str, str] | None) -> list[TorchSource]:
    """Where the CPU build of the locked torch is looked for, in order: where pip is configured to look, then
    TORCH_CPU_INDEX (an index URL or a directory). With a wheel cache only the cache, after a TORCH_CPU_INDEX
    directory: nothing is downloaded."""
    cpu = (TorchSource("TORCH_CPU_INDEX", cpu_index, "directory") if Path(cpu_index).is_dir()
           else TorchSource("TORCH_CPU_INDEX", cpu_index))
    if wheels:
        found = [cpu] if cpu.kind == "directory" else []
        return [*found, TorchSource("the wheel cache", str(wheels), "directory")]
    sources = [*pip_sources(pip_config or {}), cpu]
    return [s for i, s in enumerate(sources) if s.where not in {t.where for t in sources[:i]}]


def _why_not(stderr: str) -> str:
    """uv's refusal in a few words: "not there" (with uv's hint on the Python or machine), or its last cause."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    if any("No solution found" in line for line in lines):
        hints = [line.removeprefix("hint: ") for line in lines if line.startswith("hint:")]
        return "not there" + (f": {hints[0]}" if hints else "")
    return lines[-1].removeprefix("cause: ") if lines else "uv failed"


def _resolve(uv: Path, venv: Path, requirement: str, args: list[str]) -> str:
    """uv's pin of `requirement` for the venv's Python and machine, looking where `args` say; DevEnvError says
    why not."""
    cmd = [str(uv), "pip", "compile", "-", "--no-deps", "--no-header", "--quiet", "--python",
           str(venv / "bin" / "python"), *args]
    print("+ " + " ".join(cmd) + f"  <<< {requirement}", flush=True)
    proc = subprocess.run(cmd, input=requirement + "\n", capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DevEnvError(_why_not(proc.stderr))
    return proc.stdout


def cpu_torch_pin(uv: Path, venv: Path, source: TorchSource, version: str, offline: bool) -> str:
    """The hashed pin of torch==VERSION+cpu as `source` serves it for this Python and machine; DevEnvError says
    why not. uv hashes what an index serves; the files of a directory are hashed here (uv hashes none)."""
    args = [*source.uv_args(), *(["--offline"] if offline else [])]
    if source.kind == "directory":
        _resolve(uv, venv, f"torch=={version}+cpu", args)  # uv decides which wheel fits this Python and machine
        return _local_requirement(Path(source.where), "torch", f"{version}+cpu")
    return _resolve(uv, venv, f"torch=={version}+cpu", [*args, "--generate-hashes"])


def pypi_torch_gb(project: Path, machine: str, python: tuple[int, int]) -> float:
    """What PyPI's torch and the CUDA libraries it pulls in weigh for this machine and Python (uv.lock's sizes)."""
    lock = tomllib.loads((project / "uv.lock").read_text())
    names, total = set(cpu_only_skips(project)), 0
    for package in (p for p in lock.get("package", []) if p["name"] in names):
        total += max((w.get("size", 0) for w in package.get("wheels", [])
                      if _wheel_fits(w["url"], machine, python)), default=0)
    return total / 1e9


def _wheel_fits(url: str, machine: str, python: tuple[int, int]) -> bool:
    python_tags, abi, platform_tag = url.rsplit("/", 1)[-1].removesuffix(".whl").split("-")[-3:]
    pythons = python_tags.split(".")
    return ((platform_tag == "any" or machine in platform_tag)
            and (f"cp{python[0]}{python[1]}" in pythons or "py3" in pythons or abi == "abi3"))


def choose_torch(uv: Path, venv: Path, project: Path, torch_build: str, sources: list[TorchSource],
                 wheels: Path | None, pin: Path) -> TorchSource | None:
    """The first source serving the CPU build of the locked torch (its pin written to `pin`), or None for PyPI's
    build as uv.lock pins it. TORCH_BUILD=cpu stops where no source serves the CPU build; auto goes on to PyPI's
    build (saying why) and stops only where that is not served either, naming every place it tried."""
    version = locked_package(project, "torch")["version"]
    tried = []
    for source in sources:
        try:
            pin.write_text(cpu_torch_pin(uv, venv, source, version, offline=bool(wheels)))
        except DevEnvError as exc:
            tried.append(f"{source} ({exc})")
            continue
        print(f"torch: the CPU build {version}+cpu from {source}", flush=True)
        return source
    missing = f"no CPU build of the locked torch {version} in " + "; ".join(tried)
    fix = f"set TORCH_CPU_INDEX to an index or a directory holding torch-{version}+cpu wheels"
    if torch_build == "cpu":
        raise DevEnvError(f"{missing}: {fix}, or TORCH_BUILD=lock for PyPI's build")
    pypi = f"the wheel cache {wheels}" if wheels else "PyPI"
    try:
        _resolve(uv, venv, f"torch=={version}", source_args(wheels))
    except DevEnvError as exc:
        raise DevEnvError(f"{missing}; nor PyPI's build of torch {version} in {pypi} ({exc}): {fix}, or make "
                          f"{pypi} serve torch {version}") from exc
    size = pypi_torch_gb(project, platform.machine(), _python_of(str(venv / "bin" / "python")))
    print(f"torch: {'installing' if wheels else 'downloading'} PyPI's build of torch {version} with the CUDA "
          f"libraries it needs (about {size:.1f} GB; it runs on CPU too) from {pypi}, because {missing}", flush=True)
    return None


def _compile_stdin(uv: Path, requirement: str, args: list[str]) -> None:
    cmd = [str(uv), "pip", "compile", "-", "--no-deps", "--generate-hashes", "--no-header", "--quiet", *args]
    print("+ " + " ".join(cmd) + f"  <<< {requirement.strip()}", flush=True)
    proc = subprocess.run(cmd, input=requirement, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DevEnvError("\n".join(proc.stderr.strip().splitlines()[-6:]))


def sync(uv: Path, venv: Path, requirements: list[Path], wheels: Path | None) -> None:
    """Exactly these packages, each hash-checked; anything else in the venv is removed. Their bytecode is compiled
    here, once: where Python cannot write it (PYTHONDONTWRITEBYTECODE, a read-only venv) every process that
    imports torch and transformers would otherwise compile their sources again, about 8 s each."""
    try:
        run([uv, "pip", "sync", "--require-hashes", "--compile-bytecode", "--python", venv / "bin" / "python",
             *source_args(wheels), *requirements],
            "installing the locked packages")
    except DevEnvError as exc:
        if wheels and re.search(r"not found|no version of|unsatisfiable", str(exc), re.IGNORECASE):
            raise DevEnvError(f"the wheel cache {wheels} lacks a locked wheel for this machine: run "
                              f"`make dev-wheels WHEEL_CACHE={wheels}` where PyPI is reachable ({exc})") from exc
        raise


def install_cpu_torch(uv: Path, venv: Path, pin: Path, source: TorchSource, wheels: Path | None) -> None:
    """torch alone, from the one source that serves its CPU build, bytecode compiled as sync does: its
    dependencies come with the lock's other packages (an extra index in the sync would also serve those)."""
    run([uv, "pip", "install", "--require-hashes", "--no-deps", "--compile-bytecode", "--python",
         venv / "bin" / "python", *(["--offline"] if wheels else []), *source.uv_args(), "-r", pin],
        f"installing torch's CPU build from {source}")


def install_editable(uv: Path, venv: Path, source: Path, wheels: Path | None) -> None:
    """The project itself, editable, built by the locked setuptools already in the venv (no build isolation)."""
    run([uv, "pip", "install", "--python", venv / "bin" / "python", "--no-deps", "--no-build-isolation",
         *source_args(wheels), "-e", source], f"installing {source} (editable)")


def build(uv: Path, venv: Path, project: Path, *, python: str, selection: list[str], torch_build: str = "lock",
          sources: list[TorchSource] | None = None, wheels: Path | None = None, editable: Path | None = None) -> str:
    """Build `venv` from `project`'s uv.lock with `uv`; return the torch build installed ("cpu" or "lock"). The
    caller writes the stamp once this returns."""
    check_lock_current(uv, project)
    if not (venv / "bin" / "python").exists():
        run([uv, "venv", "--quiet", "--python", python, venv], f"creating the venv {venv}")
    with tempfile.TemporaryDirectory() as tmp:
        locked, cpu_pin = Path(tmp) / "locked.txt", Path(tmp) / "torch-cpu.txt"
        cpu = None if torch_build == "lock" else choose_torch(uv, venv, project, torch_build, sources or [],
                                                                 wheels, cpu_pin)
        export_requirements(uv, project, locked, selection, cpu_only_skips(project) if cpu else [])
        sync(uv, venv, [locked, *[p for p in [project / ZLAB_PINS] if p.is_file()]], wheels)
        if cpu:
            install_cpu_torch(uv, venv, cpu_pin, cpu, wheels)
    if editable:
        install_editable(uv, venv, editable, wheels)
    return "cpu" if cpu else "lock"


def nvidia_driver_loaded() -> bool:
    """auto takes PyPI's CUDA build where the driver is loaded, without looking for the CPU build."""
    return Path("/proc/driver/nvidia/version").exists()


def is_package(project: Path) -> bool:
    """False for a project that uv treats as virtual ([tool.uv] package = false): nothing of its own to install."""
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    return pyproject.get("tool", {}).get("uv", {}).get("package", True)


def install(args: argparse.Namespace) -> int:
    python = _python_of(args.python)
    problem = platform_problem(platform.system(), platform.machine(), python)
    if problem:
        raise DevEnvError(problem)
    if args.wheels and not args.wheels.is_dir():
        raise DevEnvError(f"no wheel cache at {args.wheels}: run `make dev-wheels WHEEL_CACHE={args.wheels}` "
                          "where PyPI is reachable (or copy one made on a machine like this), or leave WHEEL_CACHE "
                          "empty to download")
    stamp = args.venv / STAMP
    builds = ("cpu", "lock") if args.torch_build == "auto" else (args.torch_build,)
    if stamp.is_file() and stamp.read_text() in {stamp_text(args.project, python, b) for b in builds}:
        return 0
    stamp.unlink(missing_ok=True)
    uv = args.uv or bootstrap_uv(args.venv, args.python, args.project, args.wheels)
    pips = [[args.python, "-m", "pip"], [str(args.venv / "bin" / "python"), "-m", "pip"], ["pip3"]]
    sources = torch_sources(args.torch_cpu_index, args.wheels, None if args.wheels else read_pip_config(pips))
    built = build(uv, args.venv, args.project, python=args.python, selection=DEV_SELECTION,
                  torch_build=args.torch_build, sources=sources, wheels=args.wheels,
                  editable=args.project if is_package(args.project) else None)
    stamp.write_text(stamp_text(args.project, python, built))
    print(f"venv: {args.venv} holds exactly {args.project / 'uv.lock'} (torch build: {built})")
    return 0


def refresh(args: argparse.Namespace) -> int:
    """Re-resolve uv.lock (keeping locked versions that still fit) and z-lab's pin; needs PyPI."""
    if (ROOT / "uv.lock").is_file():
        uv = bootstrap_uv(args.venv, args.python, ROOT, None)  # the lock's own uv, even while the lock is stale
    else:
        required = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["required-version"]
        found = shutil.which("uv")
        if not found:
            raise DevEnvError(f"no uv.lock to take uv from and no uv on PATH: `pip install 'uv{required}'`, then "
                              "run `make dev-lock` again")
        uv = Path(found)
    run([uv, "lock", "--project", ROOT, *(["--upgrade"] if args.upgrade else [])], "uv lock (needs PyPI)")
    zlab = ROOT / ZLAB_PINS
    pins = [line for line in zlab.read_text().splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    _compile_stdin(uv, "\n".join(p.split(";")[0].split()[0] for p in pins) + "\n",
                   ["--universal", "--project", str(ROOT), "-o", str(zlab)])
    print(f"lock: {ROOT / 'uv.lock'} and {zlab} refreshed; review `git diff` and commit them")
    return 0


def deprecations(output: str) -> list[str]:
    """The lines of a build's output that warn of a deprecation (setuptools boxes them in asterisks)."""
    return [line.strip() for line in output.splitlines() if re.search(r"deprecat", line, re.IGNORECASE)]


def build_check(args: argparse.Namespace) -> int:
    """Build the project's wheel from a copy of its tracked files with the venv's setuptools, all warnings shown."""
    files = run(["git", "-C", args.project, "ls-files", "-z"], "listing the tracked files").split("\0")
    with tempfile.TemporaryDirectory(prefix="dflash-build-check-") as tmp:
        for name in filter(None, files):
            if (args.project / name).is_file():
                (Path(tmp) / "src" / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(args.project / name, Path(tmp) / "src" / name)
        code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
        proc = subprocess.run([sys.executable, "-W", "always", "-c", code, tmp], cwd=Path(tmp) / "src",
                              capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise DevEnvError(f"building the wheel failed (exit {proc.returncode}):\n{output[-2000:]}")
    found = deprecations(output)
    for line in found:
        print(f"build-check: {line}", file=sys.stderr)
    print(f"build-check: {len(found)} deprecation warning(s) building {args.project}'s wheel")
    return 1 if found else 0


def wheels(args: argparse.Namespace) -> int:
    """Download every locked wheel this machine installs (hash-checked) into the wheel cache, for offline venvs."""
    from dflash_image import wheelhouse  # needs packaging: run from the venv

    uv = args.venv / "bin" / "uv"
    python = "{}.{}".format(*sys.version_info[:2])
    glibc = tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2])
    skips = cpu_only_skips(ROOT) if args.torch_build == "cpu" else []
    with tempfile.TemporaryDirectory() as tmp:
        lock = Path(tmp) / "pylock.dev.toml"
        run([uv, "export", "--frozen", "--project", ROOT, "--format", "pylock.toml", "--no-emit-project",
             *DEV_SELECTION, *[a for name in skips for a in ("--no-emit-package", name)], "-o", lock],
            "exporting the lock")
        try:
            wheelhouse.fetch(lock, args.dest, python, platform.machine(), glibc)
        except wheelhouse.WheelhouseError as exc:
            raise DevEnvError(str(exc)) from exc
    # The venv holds no pip (it is not in the lock): the interpreter that built it downloads the rest.
    pip = [args.python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", args.dest]
    run([*pip, "--require-hashes", "-r", ROOT / ZLAB_PINS], "downloading z-lab's dflash")
    if args.torch_build == "cpu":
        version = locked_package(ROOT, "torch")["version"]
        local = Path(args.torch_cpu_index).is_dir()
        where = ["--no-index", "--find-links"] if local else ["--index-url"]
        run([*pip, *where, args.torch_cpu_index, f"torch=={version}+cpu"], f"downloading torch {version}+cpu")
    print(f"wheels: {args.dest} holds every wheel `make venv WHEEL_CACHE={args.dest}` installs here "
          f"(torch build: {args.torch_build})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="image/devenv.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    inst = sub.add_parser("install", help="build VENV from uv.lock (a no-op when its stamp is current)")
    inst.add_argument("--python", default="python3", help="the interpreter the venv is built on")
    inst.add_argument("--wheels", type=Path, default=None, help="wheel cache: install offline from it")
    inst.add_argument("--project", type=Path, default=ROOT, help="the project whose uv.lock is installed")
    inst.add_argument("--uv", type=Path, default=None, help="a uv to use instead of the lock's own")
    lock = sub.add_parser("lock", help="re-resolve uv.lock and requirements-zlab.txt (needs PyPI)")
    lock.add_argument("--upgrade", action="store_true", help="move every package to its newest allowed version")
    check = sub.add_parser("build-check", help="build the wheel; exit 1 on a deprecation warning")
    check.add_argument("--project", type=Path, default=ROOT, help="a git checkout with a pyproject.toml")
    fill = sub.add_parser("wheels", help="download the locked wheels of this machine into DEST")
    fill.add_argument("--dest", type=Path, required=True)
    fill.add_argument("--python", default="python3", help="an interpreter with pip (downloads z-lab's dflash)")
    lock.add_argument("--python", default="python3", help="the interpreter a missing venv is created with")
    for p in (inst, fill):
        p.add_argument("--torch-build", choices=["lock", "cpu", "auto"], default="auto",
                       help="lock: PyPI's build, hashes from uv.lock; cpu: the CPU build of the locked version "
                            "(from pip's configured places, then --torch-cpu-index); auto: lock where an NVIDIA "
                            "driver is loaded, else cpu where one of those serves it, else lock")
        p.add_argument("--torch-cpu-index", default=TORCH_CPU_INDEX, help="index URL or directory of CPU torch wheels")
    for p in (inst, lock, fill, check):
        p.add_argument("--venv", type=Path, default=ROOT / ".venv")
    args = ap.parse_args(argv)
    if getattr(args, "torch_build", None) == "auto" and (args.action == "wheels" or nvidia_driver_loaded()):
        args.torch_build = "lock" if nvidia_driver_loaded() else "cpu"
    try:
        actions = {"install": install, "lock": refresh, "wheels": wheels, "build-check": build_check}
        return actions[args.action](args)
    except DevEnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.action == "install":
            print(f"error: {args.venv} is incomplete and unstamped: `make venv` rebuilds it once the above is fixed",
                  file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
