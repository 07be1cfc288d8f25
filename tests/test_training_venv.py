"""The pinned training venv end to end: real ansible-playbook runs of ansible/provision.yml against
the Proxmox VE test host, the training_venv role working through `pct push` / `pct exec` only.

Stock template path: a container from a template with Python but no venv gets it from the stand-in lock and
wheelhouse (tests/image_standins.py: real wheels, real sha256 hashes), offline, and the drift doctor is clean;
a second run changes nothing; planted drift is reported with the fix, and the fix makes it clean again.
Frozen template path: a template with the venv already at /opt/venv (built by the image stage's own rebuild
command, in a chroot instead of docker) gets only the doctor.
Containers use vmids 911x so they never collide with other tests on the same test host.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from tests.helpers.deploy import venv_inputs
from tests.helpers.frozen import VENV, build_frozen_template
from tests.helpers.provision import REPO, Provision, failure_text, recap
from tests.pve_testhost.templates import build_test_template

pytest_plugins = ["tests.image_standins"]  # the stand-in index, lock and wheelhouse fixtures
pytestmark = [pytest.mark.lxc, pytest.mark.slow]

STOCK, FROZEN = 9111, 9112


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inputs(standins, stocked_wheelhouse) -> dict:
    """The role's rebuild inputs: the stand-in lock (with requirements.txt and pylock.toml), its wheelhouse,
    the trainer wheel and this venv's uv."""
    return venv_inputs(standins, stocked_wheelhouse)


@pytest.fixture(scope="module")
def vprov(pve_host, tmp_path_factory):
    p = Provision(pve_host, tmp_path_factory.mktemp("training-venv"), build_test_template(python=True))
    yield p
    for vmid in (STOCK, FROZEN):
        if pve_host.container_exists(vmid):
            pve_host.ssh(f"pct stop {vmid}; pct destroy {vmid}")


def inventory(prov: Provision, vmid: int, **group_vars) -> Path:
    name = f"ct{vmid}"
    # One GPU and its userspace: the host's driver shows in the container's /proc, so the doctor checks the
    # userspace libraries too (a container without them is not clean).
    return prov.inventory({name: {"proxmox_lxc_vmid": vmid, "proxmox_lxc_hostname": name, "proxmox_gpu_devices": [0],
                                  "training_venv_stage_dir": str(prov.workdir / "stage" / name)}},
                          training_venv_enabled=True, **group_vars)


def doctor(prov: Provision, vmid: int) -> tuple[int, dict]:
    res = prov.host.exec_in_container(vmid, [f"{VENV}/bin/dflash-doctor", "--json"])
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


# Every entry of /opt (the venv, its manifest, anything beside them) with mode, mtime and content.
UNTOUCHED = ("""python3 -c 'import hashlib, os
for d, dirs, files in sorted(os.walk("/opt")):
    for n in sorted(dirs + files):
        p = os.path.join(d, n); st = os.lstat(p)
        body = os.readlink(p) if os.path.islink(p) else hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.isfile(p) else ""
        print(p, st.st_mode, st.st_mtime_ns, body)'""")


def in_ct(prov: Provision, vmid: int, script: str) -> str:
    res = prov.host.exec_in_container(vmid, ["sh", "-c", script])
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def stock(vprov, inputs):
    """A fresh container from the python template, its venv built by the role from the inputs."""
    proc = vprov.run(inventory(vprov, STOCK, **inputs))
    return proc


# ---- stock template: the venv from the lock and the wheelhouse ---------------------------------------
def test_stock_template_gets_the_venv_and_the_doctor_is_clean(stock, vprov, standins):
    assert stock.returncode == 0, failure_text(stock)[-6000:]
    assert recap(stock)[f"ct{STOCK}"]["changed"] > 0
    assert "included: " in stock.stdout and "rebuild.yml" in stock.stdout
    rc, report = doctor(vprov, STOCK)
    assert rc == 0 and report["clean"], report["findings"]
    assert report["locked_packages"] == report["installed_packages"] > 5 and report["torch_cuda"] == "12.8"
    assert report["gpu"]["driver"] == "580.95.05"  # and the userspace matches it
    # built with the container's own python, from the lock the role pushed in
    assert in_ct(vprov, STOCK, f"cat {VENV}/pyvenv.cfg").count("home = /usr/bin") == 1
    locked = (standins.project / "pylock.toml").read_text()
    assert in_ct(vprov, STOCK, f"cat {VENV}/dflash-lock/pylock.toml") == locked
    assert report["manifest"] == f"{VENV}.manifest.json"  # the build manifest, beside the venv
    # files copied, not hard-linked (nothing outside the venv shares an inode with it)
    links = in_ct(vprov, STOCK, f"find {VENV} -type f -links +1")
    assert links == "", links
    # built offline: the container has no route anywhere
    assert in_ct(vprov, STOCK, "cat /proc/net/route").strip().count("\n") == 0
    # the bundle (wheelhouse, uv) is gone from the container and from the controller
    assert in_ct(vprov, STOCK, "ls -A /var/tmp") == ""
    assert not list((vprov.workdir / "stage").rglob("bundle*"))


def test_stock_second_run_changes_nothing(stock, vprov, inputs):
    proc = vprov.run(inventory(vprov, STOCK, **inputs))
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    assert recap(proc)[f"ct{STOCK}"]["changed"] == 0, proc.stdout[-6000:]
    assert "rebuild.yml" not in proc.stdout  # the doctor found it clean: no rebuild


def plant_extra_package(prov: Provision, vmid: int, wheel: Path) -> None:
    """Unpack a wheel into the venv by hand, as a stray copy would: no installer, no uv."""
    code = ("import base64, io, sysconfig, zipfile; "
            f"zipfile.ZipFile(io.BytesIO(base64.b64decode({base64.b64encode(wheel.read_bytes()).decode()!r})))"
            ".extractall(sysconfig.get_paths()['purelib'])")
    res = prov.host.exec_in_container(vmid, [f"{VENV}/bin/python", "-c", code])
    assert res.returncode == 0, res.stderr


def test_stock_planted_drift_is_reported_with_the_fix_then_fixed(stock, vprov, inputs, standins):
    plant_extra_package(vprov, STOCK, next(standins.pypi_wheels.glob("sglang-*.whl")))
    inv = inventory(vprov, STOCK, **inputs)
    proc = vprov.run(inv)
    text = failure_text(proc)
    assert proc.returncode != 0
    assert f"The drift doctor found drift in {VENV} of container {STOCK}" in text, text[-4000:]
    assert "extra: sglang 0.5.0 is installed but not in the lock" in text
    assert f'make provision INVENTORY={inv} ARGS="--limit ct{STOCK} -e training_venv_on_drift=rebuild"' in text
    assert ("extra", "sglang") in {(f["kind"], f["package"]) for f in doctor(vprov, STOCK)[1]["findings"]}
    # the real lock (==3.13.*) on this Debian 12 container's python3 (3.11): refused before the venv is touched,
    # by the container's bare python3 (no packaging: it reads requires-python with the lock's own wheel)
    real = tomllib.loads((REPO / "image/env/pyproject.toml").read_text())["project"]["requires-python"]
    other = vprov.workdir / "lock-real-python"
    shutil.copytree(standins.project, other, dirs_exist_ok=True)
    pylock_file = other / "pylock.toml"
    pylock_file.write_text(re.sub(r'^requires-python = "[^"]*"', f'requires-python = "{real}"',
                                  pylock_file.read_text(), flags=re.MULTILINE))
    before = in_ct(vprov, STOCK, UNTOUCHED)
    proc = vprov.run(inventory(vprov, STOCK, **dict(inputs, training_venv_lock_dir=str(other))),
                     "-e", "training_venv_on_drift=rebuild")
    assert proc.returncode != 0
    assert re.search(rf"is Python 3\.11\.\d+, but the lock needs Python {re.escape(real)}", failure_text(proc))
    assert in_ct(vprov, STOCK, UNTOUCHED) == before
    assert ("extra", "sglang") in {(f["kind"], f["package"]) for f in doctor(vprov, STOCK)[1]["findings"]}
    # check mode: would rebuild, touches nothing
    proc = vprov.run(inv, "--check", "-e", "training_venv_on_drift=rebuild")
    assert proc.returncode == 0, failure_text(proc)[-4000:]
    assert recap(proc)[f"ct{STOCK}"]["changed"] >= 1
    assert doctor(vprov, STOCK)[0] == 1 and in_ct(vprov, STOCK, "ls -A /var/tmp") == ""
    # the fix the message gives: rebuilt from the lock and the wheelhouse, clean again
    proc = vprov.run(inv, "-e", "training_venv_on_drift=rebuild")
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    rc, report = doctor(vprov, STOCK)
    assert rc == 0 and report["clean"], report["findings"]
    assert "sglang" not in in_ct(vprov, STOCK, f"ls {VENV}/lib/python3*/site-packages")


# ---- frozen template: the venv is already there, only the doctor runs --------------------------------
@pytest.fixture(scope="module")
def frozen(vprov, inputs, tmp_path_factory):
    template = build_frozen_template(tmp_path_factory.mktemp("frozen"), inputs)
    inv = inventory(vprov, FROZEN, proxmox_template_src=str(template))  # no rebuild inputs
    return inv, vprov.run(inv)


def test_frozen_template_only_runs_the_doctor(frozen, vprov):
    _, proc = frozen
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    assert "TASK [training_venv : Run the drift doctor]" in proc.stdout
    assert "rebuild.yml" not in proc.stdout
    rc, report = doctor(vprov, FROZEN)
    assert rc == 0 and report["clean"], report["findings"]
    assert report["manifest"] == f"{VENV}.manifest.json"


def test_frozen_template_drift_names_the_inputs_to_fix_it(frozen, vprov):
    inv, _ = frozen
    target = in_ct(vprov, FROZEN, f"ls {VENV}/lib/python3*/site-packages/torch/__init__.py").strip()
    in_ct(vprov, FROZEN, f"echo 'import os  # patched by hand' >> {target}")
    proc = vprov.run(inv)
    text = failure_text(proc)
    assert proc.returncode != 0
    assert "modified: torch/__init__.py: content changed since install (RECORD of torch)" in text, text[-4000:]
    assert "after setting the rebuild inputs training_venv_lock_dir, training_venv_wheelhouse," in text
    assert "re-create" in text and "frozen template" in text
    assert doctor(vprov, FROZEN)[0] == 1  # reported, not touched

