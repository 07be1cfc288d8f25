"""The image, the Proxmox template and the OCI archive, built for real from a Debian base.

One Debian root filesystem (mmdebstrap) per session, cached on disk between runs; two image builds
from the same inputs (no layer cache) must give the same template checksum; the template must boot
as a real LXC container with the venv mounted read-only, where the trainer imports and the doctor
passes. Needs root, a docker daemon and lxc: .ci/setup-image.sh provides them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from dflash_image import build, oci, pylock, rootfs, template
from dflash_image.digest import sha256_of

pytest_plugins = ["tests.image_standins"]  # the stand-in index, lock, wheelhouse and venv fixtures
# image_cfg and debian_rootfs (the Debian base, cached between runs) come from tests/conftest.py


def docker_or_skip():
    if os.geteuid() != 0:
        pytest.skip("image builds need root")
    try:
        return build.docker_client()
    except build.BuildError as exc:
        pytest.skip(f"no docker daemon: {exc} (.ci/setup-image.sh starts one)")


@pytest.fixture(scope="session")
def docker_daemon():
    return docker_or_skip()


@pytest.fixture(scope="session")
def two_builds(docker_daemon, debian13_standins, debian_rootfs, image_cfg, tmp_path_factory):
    """The same inputs built twice, without docker's layer cache (skipped, before any build, without docker).
    The lock is the stand-in for the Debian 13 base: the real requires-python, ==3.13.*."""
    target = debian13_standins
    out = tmp_path_factory.mktemp("images")
    results = [build.build(target.project, target.wheelhouse, target.trainer_wheel, out / run,
                           rootfs_tar=debian_rootfs, nocache=True, zstd_level=3, cfg=image_cfg) for run in ("a", "b")]
    yield results
    client = build.docker_client()
    for tag in {r["image"] for r in results}:  # the lock hash differs per session: do not pile images up
        client.images.remove(tag, force=True)


def members(template_path: Path) -> dict[str, tarfile.TarInfo]:
    plain = subprocess.run(["zstd", "-dc", template_path], check=True, capture_output=True).stdout
    import io

    with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
        return {m.name: m for m in tar.getmembers()}


@pytest.mark.docker
@pytest.mark.slow
def test_two_builds_give_the_same_template_checksum(two_builds):
    a, b = two_builds
    assert a["template_sha256"] == b["template_sha256"]
    assert Path(a["template"]).read_bytes() == Path(b["template"]).read_bytes()
    sha_file = Path(a["template"] + ".sha256").read_text()
    assert sha_file == f"{a['template_sha256']}  {Path(a['template']).name}\n"
    assert a["oci_manifest"] == b["oci_manifest"]


@pytest.mark.docker
@pytest.mark.slow
def test_template_is_a_proxmox_system_container(two_builds):
    result = two_builds[0]
    name = Path(result["template"]).name
    assert re.fullmatch(r"debian-13-dflash-trainenv_0\.1\.0-[0-9a-f]{12}_amd64\.tar\.zst", name)
    m = members(Path(result["template"]))
    for needed in ("./sbin", "./etc/os-release", "./etc/debian_version", "./sbin/init", "./usr/sbin/ifup",
                   "./opt/venv/bin/python", "./opt/venv/dflash-lock/pylock.toml", "./etc/profile.d/dflash-trainenv.sh",
                   "./opt/venv.manifest.json", "./opt/venv/bin/dflash-doctor"):
        assert needed in m or needed.replace("./sbin", "./usr/sbin") in m, needed
    assert "./.dockerenv" not in m
    assert not [n for n in m if n.startswith("./dev/")], "device nodes must not be in a template"
    assert not [n for n in m if n.startswith(("./build/", "./root/.cache"))], "no build context or cache inside"
    assert not [n for n in m if n.startswith("./opt/venv/bin/pip")]
    assert max(max(i.uid, i.gid) for i in m.values()) <= 65535
    venv = [i for n, i in m.items() if n.startswith("./opt/venv/")]
    assert venv and all(i.uid == 0 and i.gid == 0 and (i.issym() or not i.mode & 0o022) for i in venv)


@pytest.mark.docker
@pytest.mark.slow
def test_image_labels_carry_lock_hash_and_torch_build(two_builds, debian13_standins):
    result = two_builds[0]
    labels = build.docker_client().images.get(result["image"]).labels
    assert labels["io.dflash.torch"] == "2.11.0+cu128"
    assert labels["io.dflash.lock.sha256"] == build.lock_digest(debian13_standins.project)
    assert labels["io.dflash.trainer.sha256"] == sha256_of(debian13_standins.trainer_wheel)
    assert pylock.requires_python(debian13_standins.project / "pylock.toml") == "==3.13.*"  # the real lock's


@pytest.mark.docker
@pytest.mark.slow
def test_oci_archive_for_proxmox_import(two_builds):
    result = two_builds[0]
    path = Path(result["oci_archive"])
    assert path.name.endswith(".tar")  # Proxmox only looks for OCI content in a plain .tar
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
        assert {"oci-layout", "index.json"} <= names
        index = json.load(tar.extractfile("index.json"))
        digest = index["manifests"][0]["digest"].split(":")[1]
        manifest = json.load(tar.extractfile(f"blobs/sha256/{digest}"))
        (layer,) = manifest["layers"]
        assert layer["mediaType"] == oci.LAYER_ZSTD
        assert layer["digest"] == f"sha256:{result['template_sha256']}"  # the template is the layer
    if shutil.which("skopeo"):
        info = json.loads(subprocess.run(["skopeo", "inspect", f"oci-archive:{path}"], check=True,
                                         capture_output=True, text=True).stdout)
        assert info["Labels"]["io.dflash.torch"] == "2.11.0+cu128"


def lxc(lxcpath: Path, *args, check=True, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(["lxc-" + args[0], "-P", lxcpath, *args[1:]], capture_output=True, text=True,
                          check=check, timeout=timeout)


@pytest.mark.docker
@pytest.mark.lxc
@pytest.mark.slow
def test_template_boots_in_lxc_with_a_read_only_venv(two_builds, tmp_path):
    if not shutil.which("lxc-start"):
        pytest.skip("lxc is not installed (.ci/setup-image.sh installs it)")
    name, lxcpath = f"dflash-tpl-{os.getpid()}", tmp_path / "lxc"
    root = lxcpath / name / "rootfs"
    root.mkdir(parents=True)
    subprocess.run(["tar", "--zstd", "-xpf", two_builds[0]["template"], "--numeric-owner", "-C", root], check=True)
    (lxcpath / name / "config").write_text(
        "lxc.include = /usr/share/lxc/config/common.conf\n"
        "lxc.arch = x86_64\n"
        f"lxc.rootfs.path = dir:{root}\n"
        f"lxc.uts.name = {name}\n"
        "lxc.net.0.type = empty\n"
        "lxc.apparmor.profile = unconfined\n"
        # as Proxmox does with `mpN: ...,mp=/opt/venv,ro=1`: a stray pip install cannot change the venv
        f"lxc.mount.entry = {root}/opt/venv opt/venv none bind,ro,create=dir 0 0\n")
    lxc(lxcpath, "start", "-n", name, "-d")
    try:
        state = ""
        for _ in range(60):
            state = lxc(lxcpath, "attach", "-n", name, "--", "systemctl", "is-system-running", check=False).stdout
            if state.strip() in ("running", "degraded"):
                break
            time.sleep(1)
        assert state.strip() in ("running", "degraded"), f"systemd did not finish booting: {state!r}"
        assert lxc(lxcpath, "attach", "-n", name, "--", "cat", "/proc/1/comm").stdout.strip() == "systemd"
        out = lxc(lxcpath, "attach", "-n", name, "--", "/opt/venv/bin/python", "-c",
                  "import dflash_trainer, torch; print(dflash_trainer.__version__, torch.__version__, "
                  "torch.version.cuda)").stdout.split()
        assert out == ["0.1.0", "2.11.0+cu128", "12.8"]
        doctor = lxc(lxcpath, "attach", "-n", name, "--", "/opt/venv/bin/dflash-doctor", check=False)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "CLEAN" in doctor.stdout
        # on the image's own Python 3.13, against the build manifest the build recorded
        report = json.loads(lxc(lxcpath, "attach", "-n", name, "--", "/opt/venv/bin/dflash-doctor", "--json").stdout)
        assert report["python"].startswith("3.13.") and report["manifest"] == "/opt/venv.manifest.json"
        assert report["manifest_sha256"] == two_builds[0]["venv_manifest_sha256"]
        stray = lxc(lxcpath, "attach", "-n", name, "--", "/opt/venv/bin/python", "-c",
                    "import sysconfig; open(sysconfig.get_paths()['purelib'] + '/sglang.pth', 'w')", check=False)
        assert stray.returncode != 0 and "Read-only file system" in stray.stderr
    finally:
        lxc(lxcpath, "stop", "-n", name, "-k", check=False)
        lxc(lxcpath, "destroy", "-n", name, check=False)


# --- errors and checks that need no daemon ---------------------------------------------------------
def test_build_refuses_a_lock_for_another_python_before_touching_docker(standins, tmp_path):
    # the stand-in lock is for this machine's Python (==3.11.*); the image's Debian 13 base has 3.13
    with pytest.raises(build.BuildError, match=rf"pylock.toml needs Python =={standins.python}\.\*, but the image's "
                                               r"Debian base has Python 3\.13 \(image/rootfs.toml\)"):
        build.build(standins.project, tmp_path / "empty", standins.trainer_wheel, tmp_path / "out",
                    docker_url="unix:///nonexistent.sock")
    assert not (tmp_path / "out").exists()


def test_build_refuses_an_incomplete_wheelhouse_before_touching_docker(standins, tmp_path):
    cfg = dict(rootfs.load_config(), python=standins.python)  # a base with this machine's Python
    with pytest.raises(build.BuildError, match="missing or does not match the lock: run `make wheelhouse`"):
        build.build(standins.project, tmp_path / "empty", standins.trainer_wheel, tmp_path / "out",
                    docker_url="unix:///nonexistent.sock", cfg=cfg)
    assert not (tmp_path / "out").exists()


def test_no_daemon_gives_a_clear_error():
    with pytest.raises(build.BuildError, match="no docker daemon at unix:///nonexistent.sock.*start one"):
        build.docker_client("unix:///nonexistent.sock")


def test_template_check_names_what_proxmox_would_reject(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text('ID=debian\nVERSION_ID="13"\n')
    (root / ".dockerenv").write_text("")
    big = root / "etc/owned-by-70000"
    big.write_text("")
    if os.geteuid() == 0:
        os.chown(big, 70000, 70000)
    with pytest.raises(template.TemplateError) as err:
        template.check(root)
    msg = str(err.value)
    assert "no /sbin" in msg and "no /sbin/init" in msg and "no /etc/debian_version" in msg
    assert "/.dockerenv is present" in msg
    if os.geteuid() == 0:
        assert "/etc/owned-by-70000 (70000:70000)" in msg


def test_scrub_leaves_what_proxmox_expects(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for f in ("hosts", "hostname", "resolv.conf"):
        (root / "etc" / f).write_text("")
    (root / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (root / ".dockerenv").write_text("")
    template.scrub(root)
    assert not (root / ".dockerenv").exists() and not (root / "etc/resolv.conf").exists()
    assert "localhost" in (root / "etc/hosts").read_text()
    assert (root / "etc/machine-id").read_text() == ""
