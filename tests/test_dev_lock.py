"""The development lock: `make venv` installs exactly uv.lock or refuses clearly; `make drift` names what moved.

Each install test works on a tiny project of its own, locked offline against a directory of wheels made here,
with the uv of the lock (this venv's): no network, seconds per test.
"""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import subprocess
import sys
import tomllib
import warnings
import zipfile
from pathlib import Path

import pytest
from dflash_image import devenv, drift

ROOT = Path(__file__).resolve().parent.parent
UV = Path(sys.prefix) / "bin" / "uv"
DEVENV = [sys.executable, str(ROOT / "image" / "devenv.py")]


def make_wheel(directory: Path, name: str, version: str, tag: str = "py3-none-any") -> Path:
    """A pure-Python wheel whose module records its version (enough for uv to lock and install it); `tag` names
    it like a real build's wheel (cp312-cp312-manylinux_2_28_x86_64, say)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def write_index(wheels: Path) -> Path:
    """A PEP 503 simple index of the wheels, each link carrying its sha256 (so the lock records it)."""
    index = wheels.parent / "simple"
    for wheel in wheels.glob("*.whl"):
        page = index / wheel.name.split("-")[0]
        page.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        links = page / "links.txt"
        previous = links.read_text() if links.is_file() else ""
        links.write_text(previous + f'<a href="{wheel.as_uri()}#sha256={digest}">{wheel.name}</a>\n')
        (page / "index.html").write_text(f"<html><body>\n{links.read_text()}</body></html>\n")
    return index


def write_project(project: Path, wheels: Path, dependencies: list[str]) -> None:
    """A virtual project (nothing of its own to install) with the extras and group `make venv` selects, locked
    against a local simple index of the wheels."""
    project.mkdir(parents=True, exist_ok=True)
    deps = ", ".join(f'"{d}"' for d in dependencies)
    (project / "pyproject.toml").write_text(f"""[project]
name = "tinyproj"
version = "0"
requires-python = ">=3.11"
dependencies = [{deps}]

[project.optional-dependencies]
control = []
test = []

[dependency-groups]
build = []

[tool.uv]
package = false

[[tool.uv.index]]
name = "local"
url = "{write_index(wheels).as_uri()}"
default = true
""")


@pytest.fixture
def locked_project(tmp_path):
    """A project locked at tinydep 1.0, the only version in its wheel cache."""
    wheels, project = tmp_path / "wheels", tmp_path / "project"
    make_wheel(wheels, "tinydep", "1.0")
    write_project(project, wheels, ["tinydep>=1.0"])
    subprocess.run([UV, "lock", "--offline", "--quiet", "--project", project], check=True)
    return project, wheels


def install(project: Path, venv: Path, wheels: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run([*DEVENV, "install", "--project", project, "--venv", venv, "--python", sys.executable,
                           "--uv", UV, "--torch-build", "lock", "--wheels", wheels],
                          capture_output=True, text=True, check=False)


def test_offline_install_from_the_wheel_cache_is_stamped_then_a_no_op(locked_project, tmp_path):
    project, wheels = locked_project
    venv = tmp_path / "venv"
    first = install(project, venv, wheels)
    assert first.returncode == 0, first.stderr
    version = subprocess.run([venv / "bin" / "python", "-c", "import tinydep; print(tinydep.VERSION)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "1.0"
    assert "uv.lock" in (venv / devenv.STAMP).read_text()
    again = install(project, venv, wheels)
    assert again.returncode == 0 and "+ " not in again.stdout  # the stamp matches: nothing runs


def test_stale_lock_is_refused_and_leaves_no_stamp(locked_project, tmp_path):
    project, wheels = locked_project
    venv = tmp_path / "venv"
    assert install(project, venv, wheels).returncode == 0
    make_wheel(wheels, "otherdep", "2.0")
    write_project(project, wheels, ["tinydep>=1.0", "otherdep>=2"])  # pyproject changed, lock not refreshed
    stale = install(project, venv, wheels)
    assert stale.returncode == 2
    assert "is stale" in stale.stderr and "make dev-lock" in stale.stderr
    assert "incomplete and unstamped" in stale.stderr
    assert not (venv / devenv.STAMP).exists()


def test_missing_wheel_cache_names_the_fix_and_builds_nothing(locked_project, tmp_path):
    project, _ = locked_project
    venv = tmp_path / "venv"
    missing = install(project, venv, tmp_path / "no-such-cache")
    assert missing.returncode == 2
    assert "no wheel cache at" in missing.stderr and "make dev-wheels" in missing.stderr
    assert not venv.exists()


def test_wheel_cache_without_a_locked_wheel_leaves_the_venv_unstamped(locked_project, tmp_path):
    project, _ = locked_project
    venv, empty = tmp_path / "venv", tmp_path / "empty-cache"
    empty.mkdir()
    lacking = install(project, venv, empty)
    assert lacking.returncode == 2
    assert "lacks a locked wheel" in lacking.stderr and "make dev-wheels" in lacking.stderr
    assert not (venv / devenv.STAMP).exists()


@pytest.mark.parametrize(("system", "machine", "python"), [
    ("Darwin", "arm64", (3, 12)), ("Linux", "x86_64", (3, 14)), ("Linux", "x86_64", (3, 10)),
    ("Linux", "riscv64", (3, 12)),
])
def test_a_platform_the_lock_does_not_cover_is_named_with_the_fix(system, machine, python):
    problem = devenv.platform_problem(system, machine, python)
    assert problem and f"{system} {machine} with Python {python[0]}.{python[1]}" in problem
    assert "make dev-lock" in problem and "PYTHON=" in problem


def test_the_locked_platforms_pass():
    for machine in devenv.SUPPORTED_MACHINES:
        for minor in (11, 12, 13):
            assert devenv.platform_problem("Linux", machine, (3, minor)) is None


# --- Where torch comes from: pip's configuration, then TORCH_CPU_INDEX, then PyPI's build ---------------------
UNREACHABLE = "http://127.0.0.1:9/simple"  # nothing listens on the discard port: refused at once
TORCH = devenv.locked_package(ROOT, "torch")["version"]
CPU_TAG = "cp{0}{1}-cp{0}{1}-manylinux_2_28_{2}".format(*sys.version_info[:2], platform.machine())


def python_with_pip() -> str:
    """An interpreter whose pip reads this machine's pip configuration (this venv holds no pip)."""
    for python in (sys.executable, getattr(sys, "_base_executable", sys.executable)):
        if subprocess.run([python, "-m", "pip", "--version"], capture_output=True, check=False).returncode == 0:
            return python
    pytest.skip("no pip on this machine: the install reads where torch may come from through pip")


@pytest.fixture
def pip_conf(tmp_path, monkeypatch):
    """A pip configuration of the test's own (PIP_CONFIG_FILE, overriding every key the install reads), and no
    PIP_* variable or uv retry of this machine's; returns a function that writes it."""
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    conf = tmp_path / "pip.conf"
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))

    def write(find_links: str = "", index_url: str = "", extra_index_url: str = "", install: str = "") -> None:
        conf.write_text(f"[global]\nfind-links = {find_links}\nindex-url = {index_url}\n"
                        f"extra-index-url = {extra_index_url}\nno-index = false\n{install}")
    return write


def test_pip_configuration_is_read_through_pip_in_pips_order(tmp_path, pip_conf, monkeypatch):
    folder, other = tmp_path / "wheels", tmp_path / "more-wheels"
    folder.mkdir()
    other.mkdir()
    pip_conf(find_links=f"{folder} {other.as_uri()} https://pages.example/torch.html",
             index_url="https://global.example/simple", extra_index_url="file:///srv/simple",
             install="[install]\nindex-url = https://install.example/simple\n")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://env.example/simple")  # a variable wins over the files
    settings = devenv.read_pip_config([["no-such-pip"], [python_with_pip(), "-m", "pip"]])
    sources = devenv.torch_sources(UNREACHABLE, None, settings)
    assert [(s.named_by, s.where, s.kind) for s in sources] == [
        ("pip's find-links", str(folder), "directory"), ("pip's find-links", str(other), "directory"),
        ("pip's find-links", "https://pages.example/torch.html", "page"),
        ("pip's index-url", "https://install.example/simple", "index"),
        ("pip's extra-index-url", "https://env.example/simple", "index"),
        ("TORCH_CPU_INDEX", UNREACHABLE, "index")]


def test_no_index_keeps_pips_find_links_only_and_a_wheel_cache_keeps_everything_local(tmp_path):
    listing = "global.find-links='/srv/wheels'\nglobal.index-url='https://x.example/simple'\n:env:.no-index='1'\n"
    assert [str(s) for s in devenv.pip_sources(devenv.parse_pip_config(listing))] == ["pip's find-links /srv/wheels"]
    settings = devenv.parse_pip_config("global.find-links='/srv/wheels'\n")
    assert [str(s) for s in devenv.torch_sources(str(tmp_path), tmp_path / "cache", settings)] == [
        f"TORCH_CPU_INDEX {tmp_path}", f"the wheel cache {tmp_path / 'cache'}"]


def test_auto_takes_the_cpu_build_from_pips_wheel_folder_before_the_cpu_index(tmp_path, pip_conf, capsys):
    folder = tmp_path / "wheels"
    wheel = make_wheel(folder, "torch", f"{TORCH}+cpu", CPU_TAG)  # named like the real one
    make_wheel(folder, "torch", f"{TORCH}+cpu", "cp39-cp39-manylinux_2_28_riscv64")  # fits no machine here
    pip_conf(find_links=str(folder))
    sources = devenv.torch_sources(UNREACHABLE, None, devenv.read_pip_config([[python_with_pip(), "-m", "pip"]]))
    pin = tmp_path / "torch.txt"
    chosen = devenv.choose_torch(UV, Path(sys.prefix), ROOT, "auto", sources, None, pin)
    assert chosen == devenv.TorchSource("pip's find-links", str(folder), "directory")
    assert pin.read_text().startswith(f"torch=={TORCH}+cpu ")
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() in pin.read_text()
    assert f"torch: the CPU build {TORCH}+cpu from pip's find-links {folder}" in capsys.readouterr().out


def pypi_stand_in(tmp_path: Path, monkeypatch, version: str | None) -> None:
    """uv's default index (PyPI for a user) as a local simple index, holding torch `version` or no torch."""
    wheels = tmp_path / "pypi" / "files"
    make_wheel(wheels, "torch" if version else "tinydep", version or "1.0")
    monkeypatch.setenv("UV_DEFAULT_INDEX", write_index(wheels).as_uri())


def test_auto_falls_back_to_pypis_build_saying_what_and_why(tmp_path, pip_conf, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    pypi_stand_in(tmp_path, monkeypatch, TORCH)
    sources = devenv.torch_sources(UNREACHABLE, None, {"find-links": str(empty)})
    assert devenv.choose_torch(UV, Path(sys.prefix), ROOT, "auto", sources, None, tmp_path / "pin") is None
    [said] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("torch:")]
    assert f"downloading PyPI's build of torch {TORCH} with the CUDA libraries it needs (about " in said
    assert f"pip's find-links {empty} (not there)" in said and f"TORCH_CPU_INDEX {UNREACHABLE} (" in said


@pytest.mark.parametrize("build", ["auto", "cpu"])
def test_no_torch_anywhere_names_each_place_tried_and_the_fix(build, tmp_path, pip_conf, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    pypi_stand_in(tmp_path, monkeypatch, None)
    sources = devenv.torch_sources(UNREACHABLE, None, {"find-links": str(empty)})
    with pytest.raises(devenv.DevEnvError) as refused:
        devenv.choose_torch(UV, Path(sys.prefix), ROOT, build, sources, None, tmp_path / "pin")
    message = str(refused.value)
    assert f"no CPU build of the locked torch {TORCH} in pip's find-links {empty} (not there); " in message
    assert f"TORCH_CPU_INDEX {UNREACHABLE} (" in message and "set TORCH_CPU_INDEX" in message
    if build == "auto":
        assert f"nor PyPI's build of torch {TORCH} in PyPI (not there)" in message
    else:
        assert "TORCH_BUILD=lock" in message and "PyPI" not in message.split(": set")[0]


@pytest.mark.slow  # two installs and pip started twice: about 5 s on 2 cores
def test_install_takes_torch_from_pips_wheel_folder_with_the_cpu_index_unreachable(tmp_path, pip_conf,
                                                                                     monkeypatch):
    """The real install path, as `make venv` runs it with no variables: a tiny project locked at torch 1.0, whose
    CPU build lies only in the wheel folder pip is configured with."""
    if devenv.nvidia_driver_loaded():
        pytest.skip("an NVIDIA driver is loaded: auto takes PyPI's CUDA build without looking for the CPU one")
    index_wheels, folder, project, venv = (tmp_path / n for n in ("index-files", "wheels", "project", "venv"))
    make_wheel(index_wheels, "tinydep", "1.0")
    make_wheel(index_wheels, "torch", "1.0")
    make_wheel(folder, "torch", "1.0+cpu")
    write_project(project, index_wheels, ["tinydep>=1.0", "torch==1.0"])
    subprocess.run([UV, "lock", "--offline", "--quiet", "--project", project], check=True)
    monkeypatch.setenv("UV_DEFAULT_INDEX", (tmp_path / "simple").as_uri())  # PyPI's stand-in: the rest
    pip_conf(find_links=str(folder))
    cmd = [*DEVENV, "install", "--project", project, "--venv", venv, "--python", python_with_pip(), "--uv", UV,
           "--torch-build", "auto", "--torch-cpu-index", UNREACHABLE]
    first = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"torch: the CPU build 1.0+cpu from pip's find-links {folder}" in first.stdout
    show = "import tinydep, torch; print(tinydep.VERSION, torch.VERSION)"
    versions = subprocess.run([venv / "bin" / "python", "-c", show], capture_output=True, text=True,
                              check=True).stdout.split()
    assert versions == ["1.0", "1.0+cpu"]
    assert "torch-build cpu" in (venv / devenv.STAMP).read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert again.returncode == 0 and "+ " not in again.stdout  # auto accepts the cpu venv's stamp


def test_the_committed_lock_is_current_hashed_and_covers_both_machines():
    subprocess.run([UV, "lock", "--check", "--offline", "--quiet", "--project", ROOT], check=True)
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    markers = " ".join(lock["supported-markers"])
    assert "x86_64" in markers and "aarch64" in markers and "python_full_version < '3.14'" in markers
    for package in lock["package"]:
        if "registry" in package.get("source", {}):
            files = [*package.get("wheels", []), *([package["sdist"]] if "sdist" in package else [])]
            assert files and all(f["hash"].startswith("sha256:") for f in files), package["name"]


def test_pyproject_license_is_spdx_and_the_build_backend_is_bounded():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    [backend] = [r for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")]
    assert ">=" in backend and "<" in backend.replace("<=", "")
    assert pyproject["dependency-groups"]["build"] == [backend]  # the locked build backend has the same bounds


def test_build_check_catches_a_setuptools_deprecation(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("""[build-system]
requires = ["setuptools>=77,<85"]
build-backend = "setuptools.build_meta"
[project]
name = "oldlicense"
version = "1"
license = { text = "Apache-2.0" }
[tool.setuptools]
packages = ["pkg"]
""")
    subprocess.run(["git", "init", "-q", tmp_path], check=True)
    subprocess.run(["git", "-C", tmp_path, "add", "."], check=True)
    proc = subprocess.run([sys.executable, "-m", "dflash_image.devenv", "build-check", "--project", tmp_path],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "project.license" in proc.stderr and "deprecated" in proc.stderr


def run_drift(project: Path, wheels: Path, capsys) -> tuple[int, str]:
    check_version = "{python} -c \"import sys, tinydep; sys.exit(tinydep.VERSION != '1.0')\""
    rc = drift.main(["--project", str(project), "--find-links", str(wheels), "--no-editable", "--uv", str(UV),
                     "--python", sys.executable, "--test-command", check_version])
    return rc, capsys.readouterr().out


def test_drift_offline_reports_the_moved_package_and_what_broke(locked_project, capsys):
    project, wheels = locked_project
    rc, out = run_drift(project, wheels, capsys)
    assert rc == 0 and "0 package(s) differ" in out
    make_wheel(wheels, "tinydep", "1.1")  # a new release the lock has not seen
    rc, out = run_drift(project, wheels, capsys)
    assert rc == 1
    assert "tinydep 1.0 -> 1.1" in out and "FAIL with the newest allowed versions" in out


def test_a_deprecation_warning_from_our_code_fails_the_test_and_a_library_one_does_not():
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("old call", DeprecationWarning, "model.py", 1, module="dflash_trainer.model.drafter")
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("old call", DeprecationWarning, "pve_lxc.py", 1,
                               module="ansible_collections.dflash.proxmox.plugins.modules.pve_lxc")
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit("old call", DeprecationWarning, "utils.py", 1, module="transformers.utils")
