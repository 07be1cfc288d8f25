"""The drift doctor against real venvs: a clean one passes, each planted kind of drift is named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dflash_image import commands, doctor

pytest_plugins = ["tests.image_standins"]  # the stand-in index, lock, wheelhouse and venv fixtures
UV = commands.uv()


def run_doctor(venv: Path, *args: str) -> tuple[int, dict]:
    proc = subprocess.run([venv / "bin" / "python", "-m", "dflash_image.doctor", "--json", *args],
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture
def venv(clean_venv, tmp_path) -> Path:
    copy = tmp_path / "venv"
    shutil.copytree(clean_venv, copy, symlinks=True)
    return copy


def site(venv: Path) -> Path:
    (sp,) = (venv / "lib").glob("python*/site-packages")
    return sp


def uv_pip(venv: Path, *args) -> None:
    subprocess.run([UV, "pip", *args, "--python", venv / "bin" / "python"], check=True, capture_output=True,
                   env={"UV_OFFLINE": "1", "UV_NO_CACHE": "1", "PATH": "/usr/bin:/bin"})


def kinds(report: dict) -> set[tuple[str, str | None]]:
    return {(f["kind"], f["package"]) for f in report["findings"]}


def test_clean_environment_passes(venv):
    rc, report = run_doctor(venv)
    assert rc == 0, report["findings"]
    assert report["clean"] and report["findings"] == []
    assert report["locked_packages"] == report["installed_packages"] > 5
    assert report["torch_cuda"] == "12.8"
    assert report["seconds"] < 10


def test_text_report_names_drift_and_fix(venv, standins):
    uv_pip(venv, "install", "--no-deps", next(standins.pypi_wheels.glob("sglang-*.whl")))
    proc = subprocess.run([venv / "bin" / "python", "-m", "dflash_image.doctor"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 1
    assert "DRIFT" in proc.stdout and "sglang 0.5.0 is installed but not in the lock" in proc.stdout
    assert "make rebuild" in proc.stdout


def test_extra_packages_sglang_flashinfer(venv, standins):
    for name in ("sglang", "flashinfer_python"):
        uv_pip(venv, "install", "--no-deps", next(standins.pypi_wheels.glob(f"{name}-*.whl")))
    rc, report = run_doctor(venv)
    assert rc == 1
    assert {("extra", "sglang"), ("extra", "flashinfer-python")} <= kinds(report)


def test_torch_cu130_instead_of_cu128(venv, standins):
    uv_pip(venv, "install", "--no-deps", "--reinstall", next(standins.drift_wheels.glob("torch-*.whl")))
    rc, report = run_doctor(venv)
    assert rc == 1
    details = " ".join(f["detail"] for f in report["findings"] if f["kind"] == "build")
    assert "torch 2.11.0+cu130 installed, the lock pins 2.11.0+cu128" in details
    assert "torch.version.cuda is 13.0" in details


def test_pypi_torch_is_the_wrong_build(venv, standins):
    uv_pip(venv, "install", "--no-deps", "--reinstall", next(standins.pypi_wheels.glob("torch-*.whl")))
    rc, report = run_doctor(venv)
    assert rc == 1 and ("build", "torch") in kinds(report)


def test_wrong_version(venv, standins):
    uv_pip(venv, "install", "--no-deps", "--reinstall", next(standins.drift_wheels.glob("transformers-*.whl")))
    rc, report = run_doctor(venv)
    assert rc == 1
    (f,) = [f for f in report["findings"] if f["package"] == "transformers"]
    assert f["kind"] == "version" and "5.6.0 installed" in f["detail"] and "5.8.1" in f["detail"]


def test_missing_package(venv):
    uv_pip(venv, "uninstall", "safetensors")
    rc, report = run_doctor(venv)
    assert rc == 1 and ("missing", "safetensors") in kinds(report)


def test_file_changed_since_install(venv):
    target = site(venv) / "torch" / "__init__.py"
    target.write_text(target.read_text() + "import os  # patched by hand\n")
    rc, report = run_doctor(venv)
    assert rc == 1
    assert any(f["kind"] == "modified" and "torch/__init__.py: content changed" in f["detail"]
               for f in report["findings"])
    # --no-hash catches a size change too, faster
    rc, report = run_doctor(venv, "--no-hash")
    assert rc == 1 and ("modified", "torch") in kinds(report)


def test_deleted_file(venv):
    (site(venv) / "torch" / "version.py").unlink()
    rc, report = run_doctor(venv)
    assert rc == 1
    assert any(f["kind"] == "modified" and "deleted" in f["detail"] for f in report["findings"])


def test_orphan_pth_and_leftover_files(venv):
    (site(venv) / "evil.pth").write_text("import os\n")
    leftover = site(venv) / "sglang"
    leftover.mkdir()
    (leftover / "srt.py").write_text("")
    rc, report = run_doctor(venv)
    assert rc == 1
    pth = [f for f in report["findings"] if f["kind"] == "orphan-pth"]
    assert len(pth) == 1 and "evil.pth" in pth[0]["detail"]
    assert any(f["kind"] == "orphan" and f["detail"].startswith("sglang: 1 file") for f in report["findings"])


def test_installed_by_pip(venv, standins):
    # a real pip, as the hand-run environment had, installing into the venv
    subprocess.run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q",
                    "--no-deps", "--no-index", next(standins.pypi_wheels.glob("sglang-*.whl"))], check=True, capture_output=True)
    rc, report = run_doctor(venv)
    assert rc == 1
    assert ("installer", "sglang") in kinds(report) and ("extra", "sglang") in kinds(report)


def test_no_lock_is_an_error_not_drift(venv, tmp_path):
    proc = subprocess.run([venv / "bin" / "python", "-m", "dflash_image.doctor", "--lock", tmp_path / "nope.toml"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert "no lock at" in proc.stderr and "make lock" in proc.stderr


def fake_driver_root(root: Path, kernel: str, libs: list[str]) -> Path:
    (root / "proc/driver/nvidia").mkdir(parents=True)
    (root / "proc/driver/nvidia/version").write_text(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {kernel}  Release Build  (dvs-builder@U16)\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    libdir = root / "usr/lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    for lib in libs:
        (libdir / lib).write_bytes(b"\x7fELF")
    (libdir / "libcuda.so.1").symlink_to(libs[0]) if libs else None
    return root


def test_driver_matches_userspace(tmp_path):
    root = fake_driver_root(tmp_path, "570.86.15", ["libcuda.so.570.86.15", "libnvidia-ml.so.570.86.15"])
    findings, info = doctor.check_driver(root, "12.8")
    assert findings == [] and info["driver"] == "570.86.15"


def test_driver_mismatch_named(tmp_path):
    root = fake_driver_root(tmp_path, "570.86.15", ["libcuda.so.575.51.03"])
    findings, _ = doctor.check_driver(root, "12.8")
    assert len(findings) == 1
    assert "libcuda.so.575.51.03 is 575.51.03, the host's kernel driver is 570.86.15" in findings[0].detail


def test_driver_too_old_for_cu130(tmp_path):
    root = fake_driver_root(tmp_path, "570.86.15", ["libcuda.so.570.86.15"])
    findings, _ = doctor.check_driver(root, "13.0")
    assert [f.kind for f in findings] == ["driver"] and "needs driver >= 580.65.6" in findings[0].detail


def test_driver_without_userspace_libs(tmp_path):
    findings, _ = doctor.check_driver(fake_driver_root(tmp_path, "570.86.15", []), "12.8")
    assert "no libcuda.so.* is in the container" in findings[0].detail


def test_no_gpu_skips_driver_check(tmp_path):
    assert doctor.check_driver(tmp_path, "12.8") == ([], {"driver": None})
