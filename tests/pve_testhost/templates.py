"""CT templates for the test host, built once and cached: a tiny Debian-flavoured one (busybox-static) for
fast container starts, and the image stage's Debian 13 base (init: systemd) for what needs a real systemd."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

TEMPLATE_NAME = "debian-12-testhost_1.0-1_amd64.tar.zst"
PYTHON_TEMPLATE_NAME = "debian-12-testhost-python_1.0-2_amd64.tar.zst"
# Parts of the stdlib no test CT needs; leaving them out keeps the python template small.
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "pydoc_data", "__pycache__"}
# Libraries of Debian's Essential libc6 and libgcc-s1, so on every stock template: uv (which the
# training_venv role pushes in) links them, python does not.
ESSENTIAL_LIBS = ("libgcc_s.so.1", "librt.so.1", "libpthread.so.0", "libdl.so.2")
DEFAULT_CACHE = Path(__file__).resolve().parents[2] / "build" / "testhost"

# PID 1 of the test CTs: stays up, and ends cleanly on the signals LXC and PVE use to stop a CT.
# Mounts /run and /dev/shm as systemd does in a real CT (python's multiprocessing needs /dev/shm).
INIT = """#!/bin/sh
trap 'exit 0' PWR TERM INT USR1 USR2
mount -t tmpfs tmpfs /run 2>/dev/null
mkdir -p /dev/shm && mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm 2>/dev/null
while :; do sleep 1000 & wait $!; done
"""

OS_RELEASE = """PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
"""


def find_busybox() -> Path:
    for cand in ("/bin/busybox", "/usr/bin/busybox"):
        if Path(cand).is_file():
            return Path(cand)
    raise FileNotFoundError("busybox is missing: install the Debian package busybox-static (.ci/setup-lxc.sh)")


def _shared_libs(binaries: list[Path]) -> set[Path]:
    libs: set[Path] = set()
    for b in binaries:
        out = subprocess.run(["ldd", str(b)], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            parts = line.split("=>")[-1].split()
            if parts and parts[0].startswith("/"):
                libs.add(Path(parts[0]))
    return libs


def _add_python(root: Path) -> None:
    """This machine's python3 (interpreter, stdlib, the shared libraries they load) into the rootfs."""
    # The distribution's python (its stdlib sits in /usr/lib), not a venv's or pyenv's.
    exe = Path(os.path.realpath("/usr/bin/python3"))
    if not exe.is_file():
        raise FileNotFoundError("/usr/bin/python3 is missing; apt-get install python3 (copied into the template)")
    stdlib = Path(subprocess.run([str(exe), "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    (root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(exe, root / "usr" / "bin" / exe.name)
    if exe.name != "python3":
        (root / "usr" / "bin" / "python3").symlink_to(exe.name)
    shutil.copytree(stdlib, root / stdlib.relative_to("/"), symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_SKIP])
    essential = {lib for name in ESSENTIAL_LIBS if (lib := Path("/lib/x86_64-linux-gnu") / name).exists()}
    for lib in _shared_libs([exe, *sorted((stdlib / "lib-dynload").glob("*.so"))]) | essential:
        target = root / lib.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(lib), target)
    (root / "lib64").mkdir(exist_ok=True)
    ld = Path("/lib64/ld-linux-x86-64.so.2")
    if ld.exists() and not (root / "lib64" / ld.name).exists():
        shutil.copy2(os.path.realpath(ld), root / "lib64" / ld.name)


def build_test_template(dest_dir: str | os.PathLike = DEFAULT_CACHE, python: bool = False) -> Path:
    """Build the tiny CT template in dest_dir (reused when already there).

    python=False: `debian-12-testhost_1.0-1_amd64.tar.zst` (~1 MB, busybox only).
    python=True: `debian-12-testhost-python_1.0-2_amd64.tar.zst`, plus this machine's python3 (~21 MB)
    and the libc6/libgcc-s1 libraries a stock Debian has (uv needs them).
    """
    dest_dir = Path(dest_dir)
    dest = dest_dir / (PYTHON_TEMPLATE_NAME if python else TEMPLATE_NAME)
    if dest.is_file():
        return dest
    busybox = find_busybox()
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        root = Path(tmp) / "rootfs"
        for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "tmp", "run", "root",
                  "var/log", "var/tmp", "home", "mnt", "opt"):
            (root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "tmp", 0o1777)
        os.chmod(root / "root", 0o700)
        shutil.copy2(busybox, root / "bin" / "busybox")
        applets = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, check=True).stdout
        for applet in applets.split():
            target = root / applet
            if applet in ("sbin/init", "linuxrc") or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.path.relpath(root / "bin" / "busybox", target.parent))
        (root / "sbin" / "init").write_text(INIT)
        os.chmod(root / "sbin" / "init", 0o755)
        (root / "etc" / "os-release").write_text(OS_RELEASE)
        (root / "etc" / "debian_version").write_text("12.12\n")
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
        (root / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\nnogroup:x:65534:\n")
        (root / "etc" / "shadow").write_text("root:*:20000:0:99999:7:::\n")
        os.chmod(root / "etc" / "shadow", 0o640)
        (root / "etc" / "hostname").write_text("localhost\n")
        if python:
            _add_python(root)
        part = Path(tmp) / (dest.name + ".part")
        subprocess.run(["tar", "--zstd", "--numeric-owner", "--owner=0", "--group=0", "-cf", str(part),
                        "-C", str(root), "."], check=True)
        part.replace(dest)
    return dest


def build_systemd_template(rootfs_tar: str | os.PathLike, dest_dir: str | os.PathLike = DEFAULT_CACHE) -> Path:
    """The image stage's Debian 13 base (image/rootfs.py: mmdebstrap, systemd-sysv, python3) as a CT template.

    Its /sbin/init is systemd, as in the frozen template and a stock Proxmox Debian template, so the
    training_run role's systemd path runs for real. Named after the rootfs (whose name carries the hash
    of its inputs): `debian-13-testhost-systemd_1.1-<hash>_amd64.tar.zst`, reused when already there.

    One test-only change: tmp.mount is masked. Debian 13 mounts a tmpfs on /tmp at boot, over the
    container's bind mounts; the tests bind-mount this checkout at its own path, which may be under /tmp
    (a CI clone), and the tmpfs would hide it.
    """
    rootfs_tar = Path(rootfs_tar)
    tag = rootfs_tar.stem.rsplit("-", 1)[-1]
    dest = Path(dest_dir) / f"debian-13-testhost-systemd_1.1-{tag}_amd64.tar.zst"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        # mmdebstrap's tar is already a rootfs archive (./dev entries included: PVE's extract skips them);
        # a copy gets the mask appended, the cached rootfs is shared with the image tests.
        tar = Path(tmp) / "rootfs.tar"
        shutil.copyfile(rootfs_tar, tar)
        with tarfile.open(tar, "a") as archive:
            mask = tarfile.TarInfo("./etc/systemd/system/tmp.mount")
            mask.type, mask.linkname = tarfile.SYMTYPE, "/dev/null"
            archive.addfile(mask)
        subprocess.run(["zstd", "-q", "-f", "-T0", "-3", str(tar), "-o", str(part)], check=True)
    part.replace(dest)
    return dest
