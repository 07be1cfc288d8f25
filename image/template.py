"""Proxmox VE system-container template from a built image: scrub, check, pack reproducibly.

`docker export` is not byte-stable (mtimes of files made at container creation) and carries Docker
traces (/.dockerenv, empty /etc/hosts). The export is unpacked, cleaned, checked against what
`pct create` needs, and re-packed with sorted names, clamped mtimes and no atime/ctime, so the same
inputs give the same .tar.zst, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from dflash_image.commands import ToolError, find
from dflash_image.digest import sha256_of

MAX_ID = 65535  # unprivileged containers map ids 0..65535; a higher one makes `pct create` fail
HOSTS = "127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n"


class TemplateError(ToolError):
    """The root filesystem would not make a working Proxmox template."""


def template_name(release: str, trainer_version: str, lock_sha: str, arch: str = "amd64") -> str:
    """Named like Proxmox's own (debian-13-standard_13.1-2_amd64.tar.zst): <os>-<rel>-<name>_<ver>_<arch>."""
    return f"debian-{release}-dflash-trainenv_{trainer_version}-{lock_sha[:12]}_{arch}.tar.zst"


def unpack_export(chunks, root: Path) -> None:
    """Unpack a `docker export` stream as root (ownership kept), without /dev nodes or /.dockerenv."""
    tar = find("tar", "install GNU tar")
    root.mkdir(parents=True)
    proc = subprocess.Popen([tar, "-x", "-p", "--numeric-owner", "--same-owner", "-C", root,
                             "--exclude=dev/*", "--exclude=.dockerenv"], stdin=subprocess.PIPE)
    try:
        for chunk in chunks:
            proc.stdin.write(chunk)
    finally:
        proc.stdin.close()
    if proc.wait() != 0:
        raise TemplateError(f"unpacking the container export into {root} failed (exit {proc.returncode}); "
                            "it needs root and a filesystem that keeps ownership")


def scrub(root: Path) -> None:
    """Remove Docker's traces; leave what Proxmox rewrites at every start in a neutral state."""
    (root / ".dockerenv").unlink(missing_ok=True)
    (root / "etc/hosts").write_text(HOSTS)
    (root / "etc/hostname").write_text("localhost\n")
    resolv = root / "etc/resolv.conf"
    if resolv.is_file() and not resolv.is_symlink() and resolv.stat().st_size == 0:
        resolv.unlink()
    (root / "etc/machine-id").write_text("")  # systemd makes a new one on first boot
    for d in ("dev", "proc", "sys", "run", "tmp"):
        (root / d).mkdir(exist_ok=True)


def check(root: Path) -> None:
    """What `pct create` and a systemd boot need; raises TemplateError naming each problem."""
    problems = []
    if not (root / "sbin").exists() and not (root / "sbin").is_symlink():
        problems.append("no /sbin (pct refuses archives without it)")
    for path, why in (("etc/os-release", "Proxmox detects the OS type from it"),
                      ("etc/debian_version", "the Debian setup plugin reads it"),
                      ("sbin/init", "a system container needs an init (install systemd-sysv)"),
                      ("sbin/ifup", "Proxmox writes /etc/network/interfaces for ifupdown (install ifupdown)")):
        if not os.path.lexists(root / path):
            problems.append(f"no /{path}: {why}")
    if os.path.lexists(root / ".dockerenv"):
        problems.append("/.dockerenv is present (systemd would think it runs in Docker)")
    high = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_uid > MAX_ID or st.st_gid > MAX_ID:
                high.append(f"/{os.path.relpath(os.path.join(dirpath, name), root)} ({st.st_uid}:{st.st_gid})")
    if high:
        problems.append(f"{len(high)} file(s) owned by a uid/gid above {MAX_ID}, which an unprivileged container "
                        f"cannot map: {', '.join(high[:5])}; chown them in the image")
    if problems:
        raise TemplateError("the root filesystem is not a usable Proxmox template: " + "; ".join(problems))


def pack(root: Path, dest: Path, source_date_epoch: int, zstd_level: int = 10) -> tuple[str, str]:
    """Deterministic tar | zstd into dest; writes dest.sha256. Returns (sha256 of dest, of the plain tar)."""
    tar, zstd = find("tar", "install GNU tar"), find("zstd", "apt-get install zstd")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    tar_cmd = [tar, "-c", "-f", "-", "-C", root, "--sort=name", "--format=posix", "--numeric-owner",
               "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
               f"--mtime=@{source_date_epoch}", "--clamp-mtime", "."]
    plain = hashlib.sha256()
    with open(tmp, "wb") as out:
        t = subprocess.Popen([str(c) for c in tar_cmd], stdout=subprocess.PIPE)
        z = subprocess.Popen([zstd, "-q", f"-{zstd_level}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
        for chunk in iter(lambda: t.stdout.read(1 << 20), b""):
            plain.update(chunk)
            z.stdin.write(chunk)
        z.stdin.close()
        if t.wait() != 0 or z.wait() != 0:
            tmp.unlink(missing_ok=True)
            raise TemplateError(f"packing {root} failed (tar exit {t.returncode}, zstd exit {z.returncode})")
    tmp.rename(dest)
    digest = sha256_of(dest)
    dest.with_name(dest.name + ".sha256").write_text(f"{digest}  {dest.name}\n")
    return digest, plain.hexdigest()

