"""A stand-in for the frozen template (`make image` builds the real one), for the provisioning tests."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.helpers.provision import REPO
from tests.pve_testhost.templates import build_test_template

VENV = "/opt/venv"  # training_venv_path's default: provisioning, rebuild, deploy and doctor all use it
FROZEN_TEMPLATE = "debian-12-testhost-trainenv_1.0-1_amd64.tar.zst"


def build_frozen_template(dest: Path, inputs: dict) -> Path:
    """A stand-in for the frozen template (`make image`): the python test template with the venv built at
    /opt/venv by the command image/Dockerfile runs, in a chroot of the rootfs instead of a docker build."""
    root = dest / "rootfs"
    root.mkdir(parents=True)
    subprocess.run(["tar", "--zstd", "-xf", build_test_template(python=True), "-C", root], check=True)
    build = root / "build"
    shutil.copytree(inputs["training_venv_lock_dir"], build / "lock")
    shutil.copytree(inputs["training_venv_wheelhouse"], build / "wheelhouse")
    shutil.copytree(REPO / "image", build / "dflash_image", ignore=shutil.ignore_patterns("__pycache__", "env"))
    wheel = Path(inputs["training_venv_trainer_wheel"])
    (build / "trainer").mkdir()
    shutil.copy2(wheel, build / "trainer" / wheel.name)
    shutil.copy2(inputs["training_venv_uv"], build / "uv")
    # A private mount namespace: /proc and /dev for uv inside the chroot, gone when it exits.
    script = ('mount -t proc proc "$1/proc" && mount --rbind /dev "$1/dev" && exec chroot "$1" /usr/bin/python3 '
              f"-m dflash_image.rebuild --venv {VENV} --lock /build/lock --wheelhouse /build/wheelhouse "
              f"--trainer-wheel /build/trainer/{wheel.name} --python /usr/bin/python3 --uv /build/uv")
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", script, "sh", root],
                         env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "PYTHONPATH": "/build"},
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0 and "CLEAN" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    shutil.rmtree(build)
    out = dest / FROZEN_TEMPLATE
    subprocess.run(["tar", "--zstd", "--numeric-owner", "--owner=0", "--group=0", "-cf", out, "-C", root, "."],
                   check=True)
    shutil.rmtree(root)
    return out
