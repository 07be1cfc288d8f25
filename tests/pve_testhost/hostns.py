"""The test host's own view of the machine: a private mount namespace with PVE's paths and GPU stand-ins.

Inside it, /etc, /var/lib, /dev, /usr/sbin, /usr/bin and /root are overlays whose upper layers live in the
state directory, so `/etc/pve`, `/var/lib/vz`, `/usr/sbin/pct`, `/usr/bin/nvidia-smi`, the `/dev/nvidia*`
stand-ins and `/root/NVIDIA-Linux-x86_64-<driver>.run` exist for the API server, LXC and SSH sessions only,
never for the machine.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

STANDIN_DRIVER = "580.95.05"
STANDIN_GPU_NAME = "NVIDIA H200"
STANDIN_GPUS = 2
NVIDIA_MAJOR = 195  # fixed by the driver: nvidia0.. (minor N), nvidia-modeset 254, nvidiactl 255
REPO_ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def mount_overlay(target: str, extra_lower: Path | None, layer: Path) -> None:
    mount_overlay_on(target, target if extra_lower is None else f"{extra_lower}:{target}", layer)


def mount_overlay_on(target: str, lowerdir: str | Path, layer: Path) -> None:
    """An overlay on target with these lower dirs, its upper and work dirs under layer."""
    upper, work = layer / "upper", layer / "work"
    upper.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    run("mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lowerdir},upperdir={upper},workdir={work}", target)


def free_majors(count: int) -> list[int]:
    """Unused character majors, picked the way the kernel hands out dynamic ones (from 511 down)."""
    used = set()
    section = None
    for line in Path("/proc/devices").read_text().splitlines():
        if line.endswith(":"):
            section = line
        elif line.strip() and section == "Character devices:":
            used.add(int(line.split()[0]))
    return [m for m in range(511, 233, -1) if m not in used][:count]


def real_gpu_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists()


def gpu_standins(state: Path) -> dict:
    """The stand-in devices: what /dev and /proc/devices show on a 2-GPU NVIDIA host."""
    uvm, caps = free_majors(2)
    return {"gpus": [{"index": i, "minor": i, "uuid": f"GPU-7e57{i:04x}-0000-4000-8000-00000000000{i}"}
                     for i in range(STANDIN_GPUS)],
            "uvm_major": uvm, "caps_major": caps, "driver": STANDIN_DRIVER}


def write_standin_tools(bindir: Path, sbindir: Path, state: Path, info: dict) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    sbindir.mkdir(parents=True, exist_ok=True)
    pct = sbindir / "pct"
    # pct runs in the API server's namespace (where LXC runs), like every node-side operation.
    pct.write_text("#!/bin/sh\n# pct of the PVE test host\n"
                   f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))} PVE_TESTHOST_STATE={shlex.quote(str(state))}\n"
                   f"exec nsenter -t {os.getpid()} -m -- {shlex.quote(sys.executable)} -m tests.pve_testhost pct \"$@\"\n")
    pct.chmod(0o755)
    if info is None:
        return
    gpus = "".join(f'    echo "GPU {g["index"]}: {STANDIN_GPU_NAME} (UUID: {g["uuid"]})"\n' for g in info["gpus"])
    smi = bindir / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
# Stand-in nvidia-smi of the PVE test host (there is no GPU on this machine).
case "$1" in
  -L|--list-gpus)
{gpus}    ;;
  --query-gpu=driver_version*)
    for i in $(seq 1 {len(info['gpus'])}); do echo "{info['driver']}"; done ;;
  *)
    echo "NVIDIA-SMI {info['driver']}    Driver Version: {info['driver']}    CUDA Version: 13.0"
{gpus}    ;;
esac
""")
    smi.chmod(0o755)


def standin_installer(version: str) -> str:
    """NVIDIA-Linux-x86_64-<version>.run as the roles use it: refuses to run without --no-kernel-module (the
    host's module is shared), installs libnvidia-ml.so.<version> and an nvidia-smi that lists the GPU device
    nodes the container can actually see."""
    return textwrap.dedent("""\
        #!/bin/sh
        # Stand-in NVIDIA-Linux-x86_64-{ver}.run of the PVE test host (no GPU here).
        case " $* " in *" --no-kernel-module "*) ;; *) echo "refusing: kernel module install asked" >&2; exit 3;; esac
        mkdir -p /usr/lib/x86_64-linux-gnu /usr/bin
        rm -f /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.*
        echo "{ver}" > /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{ver}
        cat > /usr/bin/nvidia-smi <<'EOS'
        #!/bin/sh
        [ -c /dev/nvidiactl ] || {{ echo "NVIDIA-SMI has failed: /dev/nvidiactl missing" >&2; exit 9; }}
        [ -c /dev/nvidia-uvm ] || {{ echo "NVIDIA-SMI has failed: /dev/nvidia-uvm missing" >&2; exit 9; }}
        for d in /dev/nvidia[0-9]*; do
          [ -c "$d" ] || continue
          n=${{d#/dev/nvidia}}
          echo "GPU $n: NVIDIA H200 (UUID: GPU-standin-$n)"
        done
        EOS
        chmod 0755 /usr/bin/nvidia-smi
        echo "installed userspace {ver} $*" >> /var/log/nvidia-installer.log
        """).format(ver=version)


def proc_devices_text(info: dict) -> str:
    """/proc/devices with the NVIDIA majors added to the character devices, sorted as the kernel lists them."""
    text = Path("/proc/devices").read_text()
    chars, rest = text.split("\n\n", 1) if "\n\n" in text else (text, "")
    entries = [ln for ln in chars.splitlines()[1:] if ln.strip()]
    entries += [f"{NVIDIA_MAJOR:3d} nvidia-frontend", f"{info['uvm_major']:3d} nvidia-uvm",
                f"{info['caps_major']:3d} nvidia-caps"]
    entries.sort(key=lambda ln: int(ln.split()[0]))
    return "Character devices:\n" + "\n".join(entries) + "\n\n" + rest


def enter_private_namespace(argv: list[str]) -> None:
    """Re-exec this program in a new mount namespace (same PID: unshare execs it)."""
    env = dict(os.environ, PVE_TESTHOST_NS="1")
    os.execvpe("unshare", ["unshare", "--mount", "--propagation", "private", "--", sys.executable, *argv], env)


def setup_namespace(state: Path) -> dict | None:
    """Mount the node's view. Returns the stand-in GPU info (None when a real GPU driver is loaded)."""
    layers = state / "layers"
    # A fresh node view every start: the overlays' upper layers of an earlier run are dropped.
    shutil.rmtree(layers, ignore_errors=True)
    mount_dev_overlay(layers)
    info = None if real_gpu_present() else gpu_standins(state)
    mount_tool_overlays(layers, state, info)
    bind_pve_paths(state)
    set_up_root_account()
    if info is not None:
        make_gpu_nodes(info)
        write_proc_standins(state, info)
    return info


def mount_dev_overlay(layers: Path) -> None:
    """/dev as an overlay (the stand-in nodes go in its upper layer), its sub-mounts put back on top."""
    # Keep the real /dev reachable for the sub-mounts (pts, shm, mqueue) we put back on top.
    hostdev = layers / "hostdev"
    hostdev.mkdir(parents=True, exist_ok=True)
    run("mount", "--rbind", "/dev", str(hostdev))
    run("mount", "--make-rprivate", str(hostdev))
    mount_overlay_on("/dev", hostdev, layers / "dev")
    for sub in ("pts", "shm", "mqueue", "hugepages"):
        if (hostdev / sub).is_dir() and os.path.ismount(hostdev / sub):
            run("mount", "--rbind", str(hostdev / sub), f"/dev/{sub}")


def mount_tool_overlays(layers: Path, state: Path, info: dict | None) -> None:
    """pct and the stand-in NVIDIA tools over /usr, writable /etc and /var/lib, the driver installer in /root."""
    write_standin_tools(layers / "bin-extra", layers / "sbin-extra", state, info)
    mount_overlay("/usr/bin", layers / "bin-extra", layers / "usr-bin")
    mount_overlay("/usr/sbin", layers / "sbin-extra", layers / "usr-sbin")
    mount_overlay("/etc", None, layers / "etc")
    mount_overlay("/var/lib", None, layers / "var-lib")
    if info is not None:  # where an admin who installed the host driver from NVIDIA's .run keeps it
        root_extra = layers / "root-extra"
        root_extra.mkdir(parents=True, exist_ok=True)
        installer = root_extra / f"NVIDIA-Linux-x86_64-{info['driver']}.run"
        installer.write_text(standin_installer(info["driver"]))
        installer.chmod(0o755)
        mount_overlay("/root", root_extra, layers / "root")


def bind_pve_paths(state: Path) -> None:
    """PVE's paths, backed by plain directories of the state dir so the tests can read them."""
    from .containers import lxcpath_for

    for src, dst in (("pve", "/etc/pve"), ("vz", "/var/lib/vz"), ("lxc", str(lxcpath_for(state)))):
        (state / src).mkdir(parents=True, exist_ok=True)
        Path(dst).mkdir(parents=True, exist_ok=True)
        run("mount", "--bind", str(state / src), dst)


def set_up_root_account() -> None:
    """Root's subordinate ids as on PVE, and a root account that can log in with a key."""
    # PVE hosts map unprivileged CTs through root's subordinate ids (lxc-usernsexec needs them).
    for f in ("/etc/subuid", "/etc/subgid"):
        lines = [ln for ln in Path(f).read_text().splitlines() if not ln.startswith("root:")] \
            if Path(f).exists() else []
        Path(f).write_text("\n".join(lines + ["root:100000:65536"]) + "\n")
    # Debian images often lock root with '!'.
    shadow = Path("/etc/shadow")
    text = shadow.read_text()
    shadow.write_text("\n".join(("root:*:" + ln.split(":", 2)[2]) if ln.startswith("root:") else ln
                                for ln in text.splitlines()) + "\n")


def make_gpu_nodes(info: dict) -> None:
    """The stand-in /dev/nvidia* character devices, with the driver's majors and minors."""
    os.mknod("/dev/nvidiactl", 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, 255))
    os.mknod("/dev/nvidia-modeset", 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, 254))
    for g in info["gpus"]:
        os.mknod(f"/dev/nvidia{g['minor']}", 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, g["minor"]))
    os.mknod("/dev/nvidia-uvm", 0o666 | 0o020000, os.makedev(info["uvm_major"], 0))
    os.mknod("/dev/nvidia-uvm-tools", 0o666 | 0o020000, os.makedev(info["uvm_major"], 1))
    Path("/dev/nvidia-caps").mkdir(exist_ok=True)
    for minor in (1, 2):
        os.mknod(f"/dev/nvidia-caps/nvidia-cap{minor}", 0o400 | 0o020000, os.makedev(info["caps_major"], minor))
    for node in Path("/dev").glob("nvidia*"):
        if not node.is_dir():
            os.chmod(node, 0o666)


def write_proc_standins(state: Path, info: dict) -> None:
    """/proc/driver/nvidia/version and /proc/devices as the driver would show them.

    They are put over /proc only in the SSH sessions' namespace and inside the CTs: a /proc with mounts on
    top would stop unprivileged CTs from mounting their own proc (the kernel's visibility rule).
    """
    procfs = state / "lxc" / ".procfs"  # <lxcpath>/.procfs on the node
    (procfs / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
    (procfs / "driver" / "nvidia" / "version").write_text(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {info['driver']}  Tue Sep 23 10:33:09 UTC 2025\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1) \n")
    (procfs / "devices").write_text(proc_devices_text(info))


def ssh_config(state: Path, port: int) -> Path:
    d = state / "ssh"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    hostkey = d / "ssh_host_ed25519_key"
    if not hostkey.exists():
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pve-testhost", "-f", str(hostkey))
    client = d / "id_ed25519"
    if not client.exists():
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pve-testhost-client", "-f", str(client))
    (d / "authorized_keys").write_text((d / "id_ed25519.pub").read_text())
    cfg = d / "sshd_config"
    cfg.write_text(f"""# sshd of the PVE test host: its own port, keys and config, nothing shared with the machine's.
Port {port}
ListenAddress 127.0.0.1
HostKey {hostkey}
AuthorizedKeysFile {d / 'authorized_keys'}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {d / 'sshd.pid'}
Subsystem sftp /usr/lib/openssh/sftp-server
AcceptEnv LANG LC_*
MaxSessions 50
MaxStartups 50:30:100
""")
    return cfg


def procfs_standin(state: Path) -> Path | None:
    d = state / "lxc" / ".procfs"
    return d if (d / "driver" / "nvidia" / "version").exists() else None


def start_sshd(state: Path, port: int) -> subprocess.Popen:
    """sshd in a child mount namespace that adds the /proc stand-ins on top of the node's view."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    cfg = ssh_config(state, port)
    sshd = f"exec /usr/sbin/sshd -D -f {shlex.quote(str(cfg))} -E {shlex.quote(str(state / 'ssh' / 'sshd.log'))}"
    procfs = procfs_standin(state)
    if procfs is not None:
        sshd = (f"mount --bind {shlex.quote(str(procfs / 'driver'))} /proc/driver && "
                f"mount --bind {shlex.quote(str(procfs / 'devices'))} /proc/devices && {sshd}")
    return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", sshd])
