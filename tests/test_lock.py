"""Lock checks, markers, wheel selection, the wheelhouse and `rebuild`, against the stand-in index."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dflash_image import commands, lock, manifest, pylock, rebuild, wheelhouse
from dflash_image.digest import sha256_of
from packaging.specifiers import SpecifierSet

pytest_plugins = ["tests.image_standins"]  # the stand-in index, lock, wheelhouse and venv fixtures
UV = commands.uv()
REPO = Path(__file__).resolve().parents[1]

PY = f"{sys.version_info.major}.{sys.version_info.minor}"


# --- markers and wheel tags, for the image's target (unit) ---------------------------------------
TARGET = wheelhouse.target_environment("3.13.5")


def locked(marker: str | None) -> pylock.LockedPackage:
    return pylock.LockedPackage(name="x", version="1", marker=marker, index=None, directory=None)


@pytest.mark.parametrize(("marker", "expected"), [
    ("sys_platform == 'linux' and platform_machine == 'x86_64'", True),
    ("sys_platform == 'win32'", False),
    ("python_full_version < '3.14' and (sys_platform == 'darwin' or platform_machine == 'x86_64')", True),
    ("python_version >= '3.10'", True),
    ("python_version > '3.13'", False),
    ("python_full_version == '3.13.*'", True),  # the wildcard form of the real lock's requires-python
    ("python_full_version == '3.12.*'", False),
    ("'linux' in sys_platform", True),
    ("platform_machine != 'aarch64' and 'cuda' in extras", False),  # pylock.toml's form (PEP 751)
    ("implementation_name == 'cpython' or os_name == 'nt'", True),
    ("python_version ~= '3.12'", True),
    (None, True),
])
def test_markers_on_the_image_target(marker, expected):
    assert (pylock.for_environment([locked(marker)], TARGET) != []) is expected


@pytest.mark.parametrize("marker", ["sys_platform == 'linux' and", "sys_plat == 'linux'", "extra == 'cuda'"])
def test_a_bad_marker_names_the_package(marker):
    with pytest.raises(pylock.LockError, match="x: its marker .* is not a valid lock marker.*make lock"):
        pylock.for_environment([locked(marker)], TARGET)


@pytest.mark.parametrize(("name", "fits"), [
    ("torch-2.11.0+cu128-cp313-cp313-manylinux_2_28_x86_64.whl", True),
    ("torch-2.11.0+cu128-cp312-cp312-manylinux_2_28_x86_64.whl", False),
    ("torch-2.11.0+cu128-cp313-cp313-manylinux_2_28_aarch64.whl", False),
    ("torch-2.11.0+cu128-cp313-cp313-win_amd64.whl", False),
    ("safetensors-0.7.0-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
    ("nvidia_nccl_cu12-2.27.3-py3-none-manylinux2014_x86_64.whl", True),  # legacy alias of glibc 2.17
    ("numpy-2.5.5-cp313-cp313-manylinux_2_42_x86_64.whl", False),  # needs a newer glibc than trixie's
    ("numpy-2.5.5-cp313-cp313t-manylinux_2_28_x86_64.whl", False),  # the free-threaded build
    ("tqdm-4.70.1-py3-none-any.whl", True),
    ("not-a-wheel.whl", False),
])
def test_wheel_tags_for_the_image(name, fits):
    wheel = pylock.Wheel(filename=name, url=None, path=None, sha256=None)
    ranked = wheelhouse.target_tags("3.13", "x86_64", (2, 41))
    assert (wheelhouse.best_wheel([wheel], ranked) is wheel) is fits


def test_the_most_specific_wheel_is_chosen_as_an_installer_would():
    names = ["tokenizers-0.22.1-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
             "tokenizers-0.22.1-cp313-cp313-manylinux_2_28_x86_64.whl",
             "tokenizers-0.22.1-py3-none-any.whl"]
    wheels = [pylock.Wheel(filename=n, url=None, path=None, sha256=None) for n in names]
    assert wheelhouse.best_wheel(wheels, wheelhouse.target_tags("3.13")).filename == names[1]


# --- the real configuration --------------------------------------------------------------------
def test_real_env_pins_torch_to_the_cu128_index_only():
    cfg = tomllib.loads((REPO / "image/env/pyproject.toml").read_text())
    assert "torch==2.11.0" in cfg["project"]["dependencies"]
    (index,) = [i for i in cfg["tool"]["uv"]["index"] if i["name"] == "pytorch-cu128"]
    assert index["url"] == "https://download.pytorch.org/whl/cu128" and index["explicit"] is True
    assert cfg["tool"]["uv"]["sources"]["torch"] == {"index": "pytorch-cu128"}


def test_real_lock_is_current_where_committed():
    if not (REPO / "image/env/uv.lock").is_file():
        pytest.skip("image/env/uv.lock is not committed yet: `make lock` needs download.pytorch.org/whl/cu128, "
                    "which this machine cannot reach")
    assert lock.check(REPO / "image/env") == []


# --- the checks, on the stand-in lock -------------------------------------------------------
def test_standin_lock_passes_every_check(standins):
    assert lock.check(standins.project) == []
    locked = tomllib.loads((standins.project / "uv.lock").read_text())
    (torch,) = [p for p in locked["package"] if p["name"] == "torch"]
    assert torch["version"] == "2.11.0+cu128" and "simple-cu128" in torch["source"]["registry"]


def copy_project(standins, tmp_path) -> Path:
    project = tmp_path / "env"
    shutil.copytree(standins.project, project)
    return project


def test_check_catches_a_stale_lock(standins, tmp_path):
    project = copy_project(standins, tmp_path)
    py = project / "pyproject.toml"
    py.write_text(py.read_text().replace('"transformers==5.8.1"', '"transformers==5.6.0"'))
    problems = lock.check(project)
    assert any("not current" in p and "make lock" in p for p in problems)


def test_check_catches_torch_from_pypi(standins, tmp_path):
    project = copy_project(standins, tmp_path)
    py = project / "pyproject.toml"
    py.write_text(py.read_text().replace('torch = { index = "pytorch-cu128" }\n', ""))
    subprocess.run([UV, "lock", "--project", project, "--offline"], check=True, capture_output=True)
    lock.export(project, project)
    problems = lock.check(project)
    assert any("torch resolves to 2.11.0, not a +cu128 build" in p for p in problems)
    assert any("not the pytorch-cu128 index" in p for p in problems)


def test_check_catches_a_wheel_without_hash(standins, tmp_path):
    project = copy_project(standins, tmp_path)
    lf = project / "uv.lock"
    text = lf.read_text()
    stripped = re.sub(r'(\{ path = "[^"]*torch-2\.11\.0\+cu128[^"]*"), hash = "sha256:[0-9a-f]+"', r"\1", text)
    assert stripped != text
    lf.write_text(stripped)
    problems = lock.check(project)
    assert any("torch 2.11.0+cu128" in p and "has no sha256" in p for p in problems)


def test_check_catches_stale_exports(standins, tmp_path):
    project = copy_project(standins, tmp_path)
    (project / "requirements.txt").write_text("torch==2.11.0\n")
    assert any("requirements.txt is missing or stale" in p for p in lock.check(project))


def test_check_without_lock_says_how_to_make_one(tmp_path):
    (problem,) = lock.check(tmp_path)
    assert "does not exist" in problem and "make lock" in problem


# --- wheelhouse ---------------------------------------------------------------------------------
def test_wheelhouse_holds_every_locked_wheel_with_its_hash(standins, stocked_wheelhouse):
    names = {w.name for w in stocked_wheelhouse.glob("*.whl")}
    for pkg in pylock.for_environment(pylock.load(standins.project / "pylock.toml")):
        if pkg.directory:
            continue
        (w,) = pkg.wheels
        assert w.filename in names and sha256_of(stocked_wheelhouse / w.filename) == w.sha256
    assert "torch-2.11.0+cu128-py3-none-any.whl" in names


def test_wheelhouse_refuses_a_corrupt_download(standins, tmp_path):
    lock_copy = tmp_path / "pylock.toml"
    text = (standins.project / "pylock.toml").read_text()
    (h,) = re.findall(r'torch-2\.11\.0\+cu128-py3-none-any\.whl", hashes = \{ sha256 = "([0-9a-f]+)"', text)
    lock_copy.write_text(text.replace(h, "0" * 64))
    with pytest.raises(wheelhouse.WheelhouseError, match="does not match the lock"):
        wheelhouse.fetch(lock_copy, tmp_path / "wh", PY)
    assert not list((tmp_path / "wh").glob("torch*"))


def test_wheelhouse_names_a_package_without_a_fitting_wheel(standins, tmp_path):
    lock_copy = tmp_path / "pylock.toml"
    text = (standins.project / "pylock.toml").read_text()
    lock_copy.write_text(text.replace("torch-2.11.0+cu128-py3-none-any.whl",
                                      "torch-2.11.0+cu128-cp312-cp312-manylinux_2_28_x86_64.whl"))
    with pytest.raises(wheelhouse.WheelhouseError, match="torch 2.11.0.cu128: no locked wheel fits python 3.13"):
        wheelhouse.plan(lock_copy, "3.13")


# --- rebuild -------------------------------------------------------------------------------------
def test_rebuild_restores_a_clean_env_with_copied_files(standins, stocked_wheelhouse, tmp_path):
    venv = tmp_path / "trainenv"
    assert rebuild.rebuild(venv, standins.project, stocked_wheelhouse, standins.trainer_wheel, sys.executable,
                           UV) == 0
    (site,) = (venv / "lib").glob("python*/site-packages")
    assert os.stat(site / "torch" / "version.py").st_nlink == 1  # copied, not hard-linked to a cache
    assert not (venv / "bin" / "pip").exists()
    # drift, then one command brings the clean env back
    (site / "evil.pth").write_text("import os\n")
    subprocess.run([UV, "pip", "install", "--python", venv / "bin" / "python", "--no-deps", "--offline",
                    next(standins.pypi_wheels.glob("sglang-*.whl"))], check=True, capture_output=True)
    assert subprocess.run([venv / "bin" / "python", "-m", "dflash_image.doctor"], capture_output=True,
                          check=False).returncode == 1
    proc = subprocess.run([sys.executable, "-m", "dflash_image.rebuild", "--venv", venv, "--lock", standins.project,
                           "--wheelhouse", stocked_wheelhouse, "--trainer-wheel", standins.trainer_wheel,
                           "--python", sys.executable, "--uv", UV], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CLEAN: the environment matches the lock" in proc.stdout
    assert not (site / "evil.pth").exists()


def test_rebuild_refuses_missing_inputs_and_changes_nothing(standins, tmp_path):
    venv = tmp_path / "trainenv"
    venv.mkdir()
    (venv / "marker").write_text("keep")
    with pytest.raises(rebuild.RebuildError, match="no wheels in .*make wheelhouse"):
        rebuild.rebuild(venv, standins.project, tmp_path / "empty", standins.trainer_wheel, sys.executable, UV)
    assert (venv / "marker").read_text() == "keep"


def test_rebuild_failure_puts_the_old_env_back(standins, tmp_path):
    venv, wh = tmp_path / "trainenv", tmp_path / "wh"
    venv.mkdir()
    (venv / "marker").write_text("keep")
    wh.mkdir()
    shutil.copy2(standins.trainer_wheel, wh)  # a wheelhouse that lacks the locked wheels
    with pytest.raises(rebuild.RebuildError, match="install the locked wheels"):
        rebuild.rebuild(venv, standins.project, wh, standins.trainer_wheel, sys.executable, UV)
    assert (venv / "marker").read_text() == "keep"


# --- requires-python: the real lock's wildcard, under the Pythons that read it -------------------------
REAL_REQUIRES_PYTHON = tomllib.loads((REPO / "image/env/pyproject.toml").read_text())["project"]["requires-python"]


def test_the_standin_lock_has_the_real_locks_wildcard_form(standins):
    assert REAL_REQUIRES_PYTHON == "==3.13.*"
    want = REAL_REQUIRES_PYTHON if SpecifierSet(REAL_REQUIRES_PYTHON).contains(PY) else f"=={PY}.*"
    assert pylock.requires_python(standins.project / "pylock.toml") == want


@pytest.mark.parametrize(("version", "allowed"), [
    ("3.13.0", True), ("3.13.5", True), ("3.13.11", True), ("3.13.1rc1", True),
    ("3.12.9", False), ("3.14.0", False), ("3.14.0a1", False), ("3.1.3", False),
])
def test_the_real_requires_python_on_each_python(standins, stocked_wheelhouse, version, allowed):
    spec = rebuild.specifier_set(REAL_REQUIRES_PYTHON, standins.project, stocked_wheelhouse)
    assert spec.contains(version, prereleases=True) is allowed


def lock_for_another_python(standins, tmp_path) -> tuple[Path, str]:
    """The stand-in lock as the real one would be on this machine: requires-python for another Python."""
    other = REAL_REQUIRES_PYTHON if not SpecifierSet(REAL_REQUIRES_PYTHON).contains(PY) else "==3.12.*"
    lock_dir = tmp_path / "lock"
    shutil.copytree(standins.project, lock_dir)
    pylock_file = lock_dir / "pylock.toml"
    pylock_file.write_text(re.sub(r'^requires-python = "[^"]*"', f'requires-python = "{other}"',
                                  pylock_file.read_text(), flags=re.MULTILINE))
    return lock_dir, other


def tree(root: Path) -> dict:
    """Every entry under root: type and mode, mtime, content or link target (what "untouched" means)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        what = os.readlink(p) if p.is_symlink() else sha256_of(p) if p.is_file() else None
        out[str(p.relative_to(root))] = (st.st_mode, st.st_mtime_ns, what)
    return out


@pytest.fixture
def built_venv(clean_venv, tmp_path) -> Path:
    """A copy of a venv rebuilt from the stand-in lock, with its build manifest beside it."""
    venv = tmp_path / "site" / "trainenv"
    shutil.copytree(clean_venv, venv, symlinks=True)
    shutil.copy2(manifest.path_for(clean_venv), manifest.path_for(venv))
    return venv


def test_rebuild_refuses_a_python_the_lock_does_not_allow_before_touching_the_venv(standins, stocked_wheelhouse,
                                                                                 built_venv, tmp_path):
    lock_dir, other = lock_for_another_python(standins, tmp_path)
    before = tree(built_venv.parent)
    proc = subprocess.run([sys.executable, "-m", "dflash_image.rebuild", "--venv", built_venv, "--lock", lock_dir,
                           "--wheelhouse", stocked_wheelhouse, "--trainer-wheel", standins.trainer_wheel,
                           "--python", sys.executable, "--uv", UV], capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(rf"is Python {re.escape(platform.python_version())}, but the lock needs Python "
                     rf"{re.escape(other)}: use a base with that Python", proc.stderr), proc.stderr
    assert "uv venv" not in proc.stdout  # nothing was started
    assert tree(built_venv.parent) == before  # the venv, its manifest, no .old beside it: untouched
    with pytest.raises(rebuild.RebuildError, match="cannot run .*no-such-python.* for the venv"):
        rebuild.rebuild(built_venv, standins.project, stocked_wheelhouse, standins.trainer_wheel,
                        str(tmp_path / "no-such-python"), UV)
    assert tree(built_venv.parent) == before


BARE = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from pathlib import Path; import dflash_image.rebuild as r; "
        "print(r.check_python(Path(sys.argv[1]), Path(sys.argv[2]), sys.executable)); import packaging; "
        "print(packaging.__file__)")


def bare_python_check(lock_dir: Path, wheelhouse_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """check_python under this Python without site-packages (-I -S: no packaging), importing only what the
    image build ships to its build stage, as a stock Debian's python3 runs it."""
    from dflash_image import build

    ctx = tmp_path / "ctx" / "dflash_image"
    ctx.mkdir(parents=True)
    for name in build.STAGE_MODULES:
        shutil.copy2(REPO / "image" / name, ctx / name)
    return subprocess.run([sys.executable, "-I", "-S", "-c", BARE, ctx.parent, lock_dir, wheelhouse_dir],
                          capture_output=True, text=True, check=False)


def test_a_bare_python_reads_requires_python_with_the_locks_own_packaging(standins, stocked_wheelhouse, tmp_path):
    proc = bare_python_check(standins.project, stocked_wheelhouse, tmp_path)
    assert proc.returncode == 0, proc.stderr
    version, packaging_file = proc.stdout.split()
    assert version == platform.python_version()
    (wheel,) = stocked_wheelhouse.glob("packaging-*.whl")
    assert packaging_file.startswith(str(wheel) + "/")  # imported from the hash-checked locked wheel
    lock_dir, other = lock_for_another_python(standins, tmp_path)
    proc = bare_python_check(lock_dir, stocked_wheelhouse, tmp_path / "b")
    assert proc.returncode != 0 and f"but the lock needs Python {other}" in proc.stderr


def test_a_bare_python_without_the_locks_packaging_wheel_is_told_the_fix(standins, stocked_wheelhouse, tmp_path):
    wh = tmp_path / "wh"
    shutil.copytree(stocked_wheelhouse, wh)
    (wheel,) = wh.glob("packaging-*.whl")
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    proc = bare_python_check(standins.project, wh, tmp_path)
    assert proc.returncode != 0
    assert "no wheel of packaging from" in proc.stderr and "make wheelhouse" in proc.stderr
