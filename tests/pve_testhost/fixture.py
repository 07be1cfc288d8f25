"""Start/stop the PVE test host from Python (the `pve_host` pytest fixture and `make testhost-up`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .containers import lxcpath_for

REPO_ROOT = Path(__file__).resolve().parents[2]
LXC_ENV = ["--clear-env", "--set-var", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "--set-var", "HOME=/root"]


@dataclass
class PveHost:
    api_host: str
    api_port: int
    api_url: str
    ca_cert: str
    node: str
    storage: str
    root_password: str
    token_id: str
    token_secret: str
    ssh_port: int
    ssh_user: str
    ssh_key: str
    state_dir: str
    pid: int
    gpus: list = field(default_factory=list)

    def __repr__(self) -> str:  # never show the secrets in pytest output
        return f"PveHost(api_url={self.api_url!r}, ssh_port={self.ssh_port}, state_dir={self.state_dir!r})"

    # --- what the API received -----------------------------------------------------------------------
    def calls(self) -> list[dict]:
        text = (Path(self.state_dir) / "calls.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def reset_calls(self) -> None:
        (Path(self.state_dir) / "calls.jsonl").write_text("")

    # --- containers ----------------------------------------------------------------------------------
    def pve_conf(self, vmid: int) -> Path:
        return Path(self.state_dir) / "pve" / "lxc" / f"{vmid}.conf"

    def container_exists(self, vmid: int) -> bool:
        return self.pve_conf(vmid).exists()

    def exec_in_container(self, vmid: int, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """Run argv inside the CT (through the host's mount namespace, like `pct exec`)."""
        return subprocess.run(["nsenter", "-t", str(self.pid), "-m", "--", "lxc-attach", "-n", str(vmid),
                               "-P", str(lxcpath_for(self.state_dir)), *LXC_ENV, "--", *argv],
                              capture_output=True, text=True, timeout=timeout, check=False)

    def set_task_failure(self, kind: str, message: str) -> None:
        if not kind.isidentifier():
            raise ValueError(f"task kind {kind!r} is not a PVE task type such as 'vzcreate' or 'vzstart'")
        (Path(self.state_dir) / "control" / f"fail-{kind}").write_text(message)

    def ssh(self, command: str, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.ssh_argv() + [command], capture_output=True, text=True, timeout=timeout,
                              input=input, check=False)

    def ssh_argv(self) -> list[str]:
        return ["ssh", "-p", str(self.ssh_port), "-i", self.ssh_key, "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                f"{self.ssh_user}@{self.api_host}"]


def start(state_dir: str | os.PathLike, timeout: float = 60) -> tuple[PveHost, subprocess.Popen]:
    state = Path(state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PVE_TESTHOST_NS", None)
    with open(state / "serve.stderr", "w") as log:  # the child keeps its own copy of the fd
        proc = subprocess.Popen([sys.executable, "-m", "tests.pve_testhost", "serve", "--state-dir", str(state)],
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline() if proc.stdout else ""
    if not line or time.monotonic() > deadline:
        proc.wait(timeout=10)
        raise RuntimeError(f"the PVE test host did not start (exit {proc.returncode}): "
                           f"{(state / 'serve.stderr').read_text()[-2000:]}")
    info = json.loads(line)
    return PveHost(**info), proc


def stop(proc: subprocess.Popen | int, timeout: float = 120) -> None:
    """SIGTERM the host; it stops and removes every container it made, then sshd, then itself."""
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if isinstance(proc, subprocess.Popen):
        proc.wait(timeout=timeout)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the PVE test host (pid {pid}) did not stop within {timeout} s")


def missing_prerequisites() -> str | None:
    """Why the test host cannot run here (None when it can); the tests skip with this reason."""
    import shutil

    if os.geteuid() != 0:
        return "the PVE test host needs root (LXC containers, mount namespaces)"
    for tool in ("lxc-start", "lxc-usernsexec", "nsenter", "unshare", "ssh", "ssh-keygen", "zstd"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing: run .ci/setup-lxc.sh (Debian: lxc openssh-server busybox-static zstd)"
    if not Path("/usr/sbin/sshd").exists():
        return "sshd is missing: apt-get install openssh-server (.ci/setup-lxc.sh)"
    if not any(Path(p).exists() for p in ("/bin/busybox", "/usr/bin/busybox")):
        return "busybox is missing: apt-get install busybox-static (.ci/setup-lxc.sh)"
    return None


def pve_host_session(state_dir: Path):
    """Generator behind the `pve_host` fixture: start, yield, stop (which removes every container)."""
    import pytest

    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    host, proc = start(state_dir)
    try:
        yield host
    finally:
        stop(proc)
        left = sorted(p.name for p in (Path(state_dir) / "pve" / "lxc").glob("*.conf"))
        if left:
            raise RuntimeError(f"the PVE test host left containers behind: {left}")
