"""The drift doctor against real venvs: a clean one passes, each planted kind of drift is named."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import marshal
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dflash_image import commands, doctor, manifest

pytest_plugins = ["tests.image_standins"]  # the stand-in index, lock, wheelhouse and venv fixtures
UV = commands.uv()


def run_doctor(venv: Path, *args: str, launcher: str = "dflash-doctor") -> tuple[int, dict]:
    """The doctor as users and the roles run it: the venv's dflash-doctor (or `python -m dflash_image.doctor`)."""
    cmd = [venv / "bin" / "dflash-doctor"] if launcher == "dflash-doctor" else [venv / "bin" / "python", "-m",
                                                                               "dflash_image.doctor"]
    proc = subprocess.run([*cmd, "--json", *args], capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture
def venv(clean_venv, tmp_path) -> Path:
    """A copy of a venv rebuilt from the stand-in lock, and of its build manifest beside it."""
    copy = tmp_path / "venv"
    shutil.copytree(clean_venv, copy, symlinks=True)
    shutil.copy2(manifest.path_for(clean_venv), manifest.path_for(copy))
    return copy


def site(venv: Path) -> Path:
    (sp,) = (venv / "lib").glob("python*/site-packages")
    return sp


def uv_pip(venv: Path, *args) -> None:
    subprocess.run([UV, "pip", *args, "--python", venv / "bin" / "python"], check=True, capture_output=True,
                   env={"UV_OFFLINE": "1", "UV_NO_CACHE": "1", "PATH": "/usr/bin:/bin"})


def kinds(report: dict) -> set[tuple[str, str | None]]:
    return {(f["kind"], f["package"]) for f in report["findings"]}


def findings(report: dict, kind: str) -> list[str]:
    return [f["detail"] for f in report["findings"] if f["kind"] == kind]


@pytest.mark.parametrize("launcher", ["dflash-doctor", "python -m"])
def test_clean_environment_passes(venv, launcher):
    rc, report = run_doctor(venv, launcher=launcher)
    assert rc == 0, report["findings"]
    assert report["clean"] and report["findings"] == []
    assert report["locked_packages"] == report["installed_packages"] > 5
    assert report["torch_cuda"] == "12.8"
    assert report["environment"] == str(venv)
    assert report["manifest"] == str(manifest.path_for(venv)) and report["pyc_compiled"] == 0
    assert report["files_checked"] > 50


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
    (f,) = [f for f in report["findings"] if f["kind"] == "version"]
    assert f["package"] == "transformers" and "5.6.0 installed" in f["detail"] and "5.8.1" in f["detail"]


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


# --- the three blind spots, and the doctor's own process ---------------------------------------------
CACHE_TAG = sys.implementation.cache_tag


def plant_pyc(source: Path, code_text: str, header: str) -> Path:
    """Bytecode of `code_text` in the .pyc that Python loads for `source`, with a header it accepts:
    checked-hash (the source's own hash), unchecked-hash (never checked), or timestamp (mtime and size)."""
    src = source.read_bytes()
    code = marshal.dumps(compile(code_text, str(source), "exec", dont_inherit=True))
    if header == "checked-hash":
        head = (0b11).to_bytes(4, "little") + importlib.util.source_hash(src)
    elif header == "unchecked-hash":
        head = (0b01).to_bytes(4, "little") + b"\0" * 8
    else:
        st = source.stat()
        head = (0).to_bytes(4, "little") + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + \
            (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    pyc = source.parent / "__pycache__" / f"{source.stem}.{CACHE_TAG}.pyc"
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(importlib.util.MAGIC_NUMBER + head + code)
    return pyc


@pytest.mark.parametrize("header", ["checked-hash", "unchecked-hash", "timestamp"])
def test_tampered_pyc_that_python_runs(venv, header):
    source = site(venv) / "torch" / "version.py"
    before = source.read_bytes()
    plant_pyc(source, "__version__ = '2.11.0+cu128'\ncuda = '13.0'\n", header)
    # the blind spot is real: source and RECORD untouched, yet Python runs the planted bytecode
    ran = subprocess.run([venv / "bin" / "python", "-c", "import torch.version; print(torch.version.cuda)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert ran == "13.0" and source.read_bytes() == before
    rc, report = run_doctor(venv)
    assert rc == 1
    (detail,) = findings(report, "modified")
    assert detail == (f"lib/{site(venv).parent.name}/site-packages/torch/__pycache__/version.{CACHE_TAG}.pyc: "
                      "Python would run it instead of version.py, and it does not match a fresh compile of it")
    assert report["pyc_compiled"] == 1
    # no build manifest to vouch for any .pyc: every one is compiled and compared, the same one is found
    manifest.path_for(venv).unlink()
    rc, report = run_doctor(venv)
    assert findings(report, "modified") == [detail] and report["pyc_compiled"] > 10
    assert findings(report, "manifest")[0].startswith(f"no build manifest at {manifest.path_for(venv)}")


def test_bytecode_python_writes_itself_or_would_not_load_is_no_drift(venv):
    for cache in site(venv).rglob("__pycache__"):
        shutil.rmtree(cache)
    writes = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([venv / "bin" / "python", "-c", "import torch, transformers, dflash_image.doctor"], check=True,
                   env=writes)
    fresh = list(site(venv).rglob(f"*.{CACHE_TAG}.pyc"))
    assert len(fresh) >= 3  # timestamp .pyc files, as Python writes them, that the build manifest does not list
    # a .pyc Python would not load: a checked hash of another source (stale), another interpreter's tag
    plant_pyc(site(venv) / "torch" / "version.py", "cuda = '13.0'\n", "checked-hash").write_bytes(
        importlib.util.MAGIC_NUMBER + (0b11).to_bytes(4, "little") + b"\1" * 8 + marshal.dumps(compile("", "x", "exec")))
    (site(venv) / "torch" / "__pycache__" / "version.cpython-299.pyc").write_bytes(b"junk")
    rc, report = run_doctor(venv)
    assert rc == 0, report["findings"]
    assert report["pyc_compiled"] >= len(fresh)


def test_include_system_site_packages_is_reported(venv):
    cfg = venv / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace("include-system-site-packages = false", "include-system-site-packages = true"))
    added = subprocess.run([venv / "bin" / "python", "-c", "import sys, json; print(json.dumps(sys.path))"],
                           capture_output=True, text=True, check=True).stdout
    outside = [p for p in json.loads(added) if "-packages" in p and not p.startswith(str(venv))]
    assert outside, "the base interpreter has no site-packages on this machine: nothing to see"
    rc, report = run_doctor(venv)
    assert rc == 1
    assert findings(report, "system-site") == [(f"{cfg} sets include-system-site-packages = true: the base "
                                               "interpreter's site-packages are importable beside the locked packages")]
    (reach,) = findings(report, "sys-path")
    assert all(p in reach for p in outside)
    assert "pyvenv.cfg: content differs from the build manifest" in findings(report, "modified")


def test_sitecustomize_neither_breaks_json_nor_reaches_the_doctor(venv, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    hook = site(venv) / "sitecustomize.py"
    # prints (flushed, so it is out before anything else could run) and adds a folder outside the venv
    hook.write_text(f"import sys\nprint('hello from sitecustomize', flush=True)\nsys.path.append({str(other)!r})\n")
    rc, report = run_doctor(venv)  # json.loads of the whole stdout: nothing but the report is in it
    assert rc == 1
    assert findings(report, "startup-hook") == ["sitecustomize.py is in no RECORD and runs at every interpreter start"]
    assert findings(report, "sys-path") == [(f"the venv's sys.path reaches outside the venv and the standard library: "
                                            f"{other} (packages there are importable beside the locked ones)")]
    # a hook that would hide drift from a doctor running in its process: `python -m` runs it once, then the
    # doctor starts again isolated, where nothing of it is left
    hook.write_text("import importlib.metadata as m\nm.distributions = lambda **kw: iter(())\n")
    rc, report = run_doctor(venv, launcher="python -m")
    assert rc == 1 and report["installed_packages"] == report["locked_packages"]
    assert findings(report, "startup-hook") and not findings(report, "missing")


def test_file_whose_record_line_was_rewritten_to_match(venv):
    target = site(venv) / "torch" / "__init__.py"
    body = target.read_bytes() + b"import os  # patched by hand, RECORD fixed up\n"
    target.write_bytes(body)
    (record,) = site(venv).glob("torch-*.dist-info/RECORD")
    digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
    text = re.sub(r"^torch/__init__\.py,[^\n]*$", f"torch/__init__.py,sha256={digest},{len(body)}", record.read_text(),
                  flags=re.MULTILINE)
    record.write_text(text)
    assert not [d for d in findings(run_doctor(venv, "--manifest", "/nonexistent")[1], "modified")
                if "RECORD of" in d]  # RECORD alone is fooled
    rc, report = run_doctor(venv)
    assert rc == 1
    rel = f"lib/{site(venv).parent.name}/site-packages"
    assert set(findings(report, "modified")) == {
        (f"{rel}/torch/__init__.py: content differs from the build manifest, although its RECORD line matches it "
        "(the RECORD was rewritten to fit)"),
        f"{rel}/{record.parent.name}/RECORD: content differs from the build manifest"}
    # and deleting the manifest does not make it clean
    manifest.path_for(venv).unlink()
    rc, report = run_doctor(venv)
    assert rc == 1 and findings(report, "manifest")


def test_files_the_build_did_not_make_outside_site_packages(venv):
    (venv / "bin" / "pip").write_text("#!/bin/sh\n")
    (venv / "bin" / "python3").unlink()
    (venv / "bin" / "python3").symlink_to("/bin/sh")
    rc, report = run_doctor(venv)
    assert rc == 1
    assert set(findings(report, "modified")) == {"bin: 1 file(s) added since the build (build manifest)",
                                                 ("bin/python3: the build made it a link to python, it is now a link "
                                                 "to /bin/sh")}


def test_a_manifest_from_another_lock_is_named(venv, tmp_path):
    lock = tmp_path / "pylock.toml"
    lock.write_text((venv / "dflash-lock" / "pylock.toml").read_text() + "\n# re-exported\n")
    rc, report = run_doctor(venv, "--lock", str(lock))
    assert rc == 1
    assert findings(report, "manifest") == [(f"{manifest.path_for(venv)} is the manifest of a build from another lock "
                                            f"than {lock}")]


def test_pyc_rules_match_what_python_loads(tmp_path):
    """pyc_mismatch against the import system itself: a .pyc it reports is the one `import` runs."""
    pkg = tmp_path / "mod.py"
    pkg.write_text("value = 'source'\n")
    for header in ("checked-hash", "unchecked-hash", "timestamp"):
        pyc = plant_pyc(pkg, "value = 'planted'\n", header)
        ran = subprocess.run([sys.executable, "-c", "import mod; print(mod.value)"], cwd=tmp_path, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert ran == "planted" and "does not match a fresh compile" in (doctor.integrity.pyc_mismatch(pyc) or "")
        os.utime(pkg, (1, 1))  # stale for a timestamp .pyc, still the same source for a hash-based one
        ran = subprocess.run([sys.executable, "-c", "import mod; print(mod.value)"], cwd=tmp_path, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert (ran == "source") is (doctor.integrity.pyc_mismatch(pyc) is None)
        pyc.unlink()
        pkg.write_text("value = 'source'\n")


def test_the_trainer_wheel_installed_again_as_make_deploy_does_is_no_drift(venv, standins):
    uv_pip(venv, "install", "--no-deps", "--reinstall", "--link-mode", "copy", standins.trainer_wheel)
    rc, report = run_doctor(venv)
    assert rc == 0, report["findings"]
    # its files are still checked against their RECORD
    target = site(venv) / "dflash_trainer" / "__init__.py"
    target.write_text(target.read_text() + "# patched\n")
    rc, report = run_doctor(venv)
    assert findings(report, "modified") == [("dflash_trainer/__init__.py: content changed since install "
                                            "(RECORD of dflash-trainer)")]
