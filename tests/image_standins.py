"""Stand-ins for the image stage's tests: tiny wheels, a local package index, a locked project.

CI reaches neither download.pytorch.org nor Docker Hub, so the lock, wheelhouse, rebuild, doctor and
image mechanics are tested against small wheels built here: a fake torch 2.11.0+cu128 (and PyPI's
2.11.0, the "cu130" build), transformers/datasets/safetensors at the versions image/env pins, and
the trainer's own dependencies at their lowest allowed versions; `packaging`, whose code the doctor
and the rebuild run, is the real one (this venv's installed copy, repacked). They are served as
PEP 503 indexes from file:// URLs (with #sha256= fragments, like real indexes), so uv locks them with
real hashes. The project is image/env/pyproject.toml itself, with only the index URLs and the trainer's
path rewritten, and requires-python in the real lock's wildcard form for the Python that builds the venv:
`==3.11.*` for this machine (Debian 12), the real `==3.13.*` unchanged for the Debian 13 base of the image
(`debian13_standins`, locked inside that base, whose python3 it is).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from dflash_image.digest import sha256_of
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
ENV_PYPROJECT = REPO / "image" / "env" / "pyproject.toml"
UV = str(Path(sys.prefix) / "bin" / "uv") if (Path(sys.prefix) / "bin" / "uv").is_file() else shutil.which("uv")
FIXED_TIME = (2020, 1, 1, 0, 0, 0)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(outdir: Path, name: str, version: str, deps=(), files: dict[str, str] | None = None) -> Path:
    """A valid py3-none-any wheel with METADATA, WHEEL and RECORD; byte-identical for identical input."""
    norm = re.sub(r"[-_.]+", "_", name).lower()
    files = dict(files or {f"{norm}/__init__.py": f"__version__ = {version!r}\n"})
    info = f"{norm}-{version}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {d}\n" for d in deps))
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: dflash-standins\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{p},sha256={_b64(c.encode())},{len(c.encode())}" for p, c in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p in sorted(files):
            zi = zipfile.ZipInfo(p, FIXED_TIME)
            zi.external_attr = 0o644 << 16
            z.writestr(zi, files[p])
    return path


def repacked_wheel(outdir: Path, name: str) -> Path:
    """A wheel of an installed distribution's own files (its code, not a stand-in), at its version."""
    dist = importlib.metadata.distribution(name)
    files = {f.as_posix(): f.read_text() for f in dist.files
             if ".dist-info" not in f.parts[0] and "__pycache__" not in f.parts and not f.parts[0].startswith("..")}
    return make_wheel(outdir, dist.metadata["Name"], dist.version, files=files)


def fake_torch(outdir: Path, version: str, cuda: str) -> Path:
    return make_wheel(outdir, "torch", version, files={
        "torch/__init__.py": "from torch.version import __version__\nfrom torch import version\n",
        "torch/version.py": f"__version__ = {version!r}\ncuda: str | None = {cuda!r}\n",
    })


def write_index(wheels_dir: Path, index_dir: Path) -> str:
    """A PEP 503 simple index over the wheels in `wheels_dir`; returns its file:// URL."""
    groups: dict[str, list[Path]] = {}
    for whl in sorted(wheels_dir.glob("*.whl")):
        groups.setdefault(whl.name.split("-")[0].replace("_", "-"), []).append(whl)
    for project, whls in groups.items():
        d = index_dir / project
        d.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="{w.resolve().as_uri()}#sha256={sha256_of(w)}">'
                        f"{w.name}</a>\n" for w in whls)
        (d / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    return index_dir.resolve().as_uri()


def _pick_version(req: Requirement) -> str:
    """A version that satisfies `req`: its == or lower bound, else a plain 1.0."""
    candidates = [s.version for s in req.specifier if s.operator in ("==", ">=", "~=", "===")] + ["1.0.0", "0.1.0"]
    for c in candidates:
        if req.specifier.contains(Version(c), prereleases=True):
            return c
    raise ValueError(f"cannot pick a stand-in version for {req}")


def requirements() -> list[Requirement]:
    """The environment's and the trainer's direct requirements (names and pins taken from the repo)."""
    env = tomllib.loads(ENV_PYPROJECT.read_text())["project"]["dependencies"]
    trainer = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(r) for r in [*env, *trainer]]


def build_indexes(root: Path) -> dict[str, str]:
    """cu128 and pypi stand-in indexes; returns their URLs and the folders holding extra wheels."""
    cu128, pypi, drift = root / "wheels-cu128", root / "wheels-pypi", root / "wheels-drift"
    fake_torch(cu128, "2.11.0+cu128", "12.8")
    fake_torch(pypi, "2.11.0", "13.0")  # PyPI's torch 2.11.0 is the CUDA 13.0 build
    fake_torch(drift, "2.11.0+cu130", "13.0")
    repacked = {"packaging"}  # the doctor and the rebuild import it: the real code
    for name in repacked:
        repacked_wheel(pypi, name)
    seen = {"torch", "dflash-trainer", *repacked}
    for req in requirements():
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen.add(name)
        make_wheel(pypi, req.name, _pick_version(req))
    # Packages the hand-run environment picked up and the lock never names.
    make_wheel(pypi, "sglang", "0.5.0")
    make_wheel(pypi, "flashinfer-python", "0.4.0", files={
        "flashinfer/__init__.py": "", "flashinfer-autoload.pth": "import flashinfer\n"})
    make_wheel(drift, "transformers", "5.6.0")
    return {"cu128": write_index(cu128, root / "simple-cu128"), "pypi": write_index(pypi, root / "simple-pypi"),
            "drift": str(drift)}


def standin_project(project: Path, urls: dict[str, str], trainer_src: Path, python: str, run=subprocess.run) -> Path:
    """image/env/pyproject.toml pointed at the stand-in indexes, for a venv built on Python `python` ('3.11'),
    locked and exported into `project`. `run` runs uv (and finds the interpreter that locks) somewhere else:
    the Debian 13 base (see debian13_standins)."""
    text = ENV_PYPROJECT.read_text()
    real_url = "https://download.pytorch.org/whl/cu128"
    assert real_url in text and 'path = "../.."' in text, "image/env/pyproject.toml changed shape"
    text = text.replace(real_url, urls["cu128"]).replace('path = "../.."', f'path = "{trainer_src}"')
    (real,) = re.findall(r'^requires-python = "([^"]*)"', text, flags=re.MULTILINE)
    if not SpecifierSet(real).contains(python):  # the real lock's own form, for the Python the tests build on
        text = text.replace(f'requires-python = "{real}"', f'requires-python = "=={python}.*"')
    text += f'\n[[tool.uv.index]]\nname = "pypi-standin"\nurl = "{urls["pypi"]}"\ndefault = true\n'
    project.mkdir()
    (project / "pyproject.toml").write_text(text)
    interpreter = sys.executable if run is subprocess.run else "/usr/bin/python3"
    env = {**os.environ, "UV_OFFLINE": "1", "UV_PYTHON_DOWNLOADS": "never"}  # not UV_NO_CONFIG: it ignores [tool.uv]
    run([UV, "lock", "--project", project, "--python", interpreter], check=True, env=env, capture_output=True)
    for fmt, extra in (("pylock.toml", []), ("requirements.txt", ["--no-emit-package", "dflash-trainer"])):
        run([UV, "export", "--project", project, "--frozen", "--no-header", "--format", fmt, *extra,
             "-o", project / fmt], check=True, env=env, capture_output=True)
    return project


def trainer_source(root: Path) -> Path:
    """A copy of the repository's distribution sources (so builds leave the work tree alone)."""
    src = root / "trainer-src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "env")
    for folder in ("dflash", "image"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    return src


def build_trainer_wheel(src: Path, out: Path) -> Path:
    """The trainer wheel, built from `src` with this venv's setuptools (no network)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1577836800"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, src],
                   check=True, env=env, capture_output=True)
    (wheel,) = out.glob("dflash_trainer-*.whl")
    return wheel


class Standins:
    def __init__(self, root: Path):
        self.root = root
        self.urls = build_indexes(root)
        self.trainer_src = trainer_source(root)
        self.python = f"{sys.version_info.major}.{sys.version_info.minor}"
        self.project = standin_project(root / "env", self.urls, self.trainer_src, self.python)
        self.trainer_wheel = build_trainer_wheel(self.trainer_src, root / "trainer-wheel")
        self.wheelhouse = root / "wheelhouse"
        self.drift_wheels = Path(self.urls["drift"])
        self.pypi_wheels = root / "wheels-pypi"


@pytest.fixture(scope="session")
def standins(tmp_path_factory) -> Standins:
    if not UV:
        pytest.fail("uv is not installed: `make venv` installs it (the control extra pins uv)")
    return Standins(tmp_path_factory.mktemp("standins"))


@pytest.fixture(scope="session")
def stocked_wheelhouse(standins) -> Path:
    from dflash_image import wheelhouse

    wheelhouse.fetch(standins.project / "pylock.toml", standins.wheelhouse, standins.python)
    return standins.wheelhouse


class ChrootRunner:
    """subprocess.run, but inside an unpacked root filesystem (a private mount namespace: /proc, /dev and
    the stand-ins' folder at its own path, so the lock's file:// URLs and paths hold in there too)."""

    def __init__(self, rootfs_tar: Path, root: Path, shared: Path):
        self.root, self.shared = root, shared
        root.mkdir(parents=True)
        subprocess.run(["tar", "-xf", rootfs_tar, "-C", root], check=True)
        shutil.copy2(UV, root / "usr/local/bin/uv")

    def __call__(self, argv, check=True, env=None, capture_output=True):
        argv = ["/usr/local/bin/uv" if a == UV else str(a) for a in argv]
        script = ('mount -t proc proc "$1/proc" && mount --rbind /dev "$1/dev" && mkdir -p "$1$2" && '
                  'mount --bind "$2" "$1$2" && r=$1 && shift 2 && exec chroot "$r" "$@"')
        keep = {k: v for k, v in (env or {}).items() if k.startswith("UV_")}
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", script, "sh",
                               self.root, self.shared, *argv], check=check, capture_output=capture_output,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", **keep})


@pytest.fixture(scope="session")
def debian13_standins(standins, debian_rootfs, image_cfg, tmp_path_factory) -> Standins:
    """The stand-ins for the Debian 13 base (the image, containers made from the base): the project with the
    real requires-python (==3.13.*), locked by uv inside that base with its python3, and a wheelhouse for it."""
    from dflash_image import wheelhouse

    run = ChrootRunner(debian_rootfs, tmp_path_factory.mktemp("debian13") / "root", standins.root)
    try:
        target = copy.copy(standins)
        target.python = image_cfg["python"]
        target.project = standin_project(standins.root / f"env-{target.python}", standins.urls, standins.trainer_src,
                                         target.python, run=run)
    finally:
        shutil.rmtree(run.root)
    target.wheelhouse = standins.root / f"wheelhouse-{target.python}"
    wheelhouse.fetch(target.project / "pylock.toml", target.wheelhouse, target.python)
    return target


@pytest.fixture(scope="session")
def clean_venv(standins, stocked_wheelhouse, tmp_path_factory) -> Path:
    """A venv rebuilt from the stand-in lock; tests copy it before planting drift."""
    from dflash_image import rebuild

    venv = tmp_path_factory.mktemp("clean") / "venv"
    rc = rebuild.rebuild(venv, standins.project, stocked_wheelhouse, standins.trainer_wheel, sys.executable, UV,
                         doctor=False)
    assert rc == 0
    return venv
