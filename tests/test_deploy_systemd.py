"""`make deploy / train / train-status / train-logs / train-stop` through the systemd unit, end to
end: the training_run role's production path (templates/dflash-train.service.j2) in a real LXC container of
the Proxmox VE test host whose init is systemd, with the real trainer (CPU, a tiny target).

The container is made from the image stage's Debian 13 base (image/rootfs.py: the mmdebstrap rootfs under
the frozen template, systemd-sysv and python3; `build_systemd_template`), so `auto` picks the unit. What
differs from a real node, said plainly (the rest as in tests/test_deploy_container.py):
- provisioning builds the frozen environment (/opt/venv) from the stand-in lock with the CT's own
  python3; the drift doctor guards it, for real;
- the stand-in lock has no real torch: the trainer runs with this machine's dev venv, through a venv shim
  mounted at /opt/dev-python (pyvenv.cfg `home` = this machine's Python, mounted read-only; site-packages =
  the dev venv's, in the repository, mounted read-only at its own path). A shim, because where this
  machine's Python is Debian's (/usr, as in CI) it cannot be mounted at its own path over the CT's /usr.
  The CT's own Debian 13 libraries serve it and torch: no host library mount. The shim's bin/dflash-run is
  the run controller's console script, written the way pip writes one.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.helpers.deploy import Site, out, venv_inputs, wait_for
from tests.helpers.provision import REPO
from tests.pve_testhost.templates import build_systemd_template

pytest_plugins = ["tests.image_standins"]
pytestmark = [pytest.mark.lxc, pytest.mark.slow]

VMID = 9302
STEPS, EVERY = 600, 10
UNIT = "dflash-train-default"
DEV_PYTHON = "/opt/dev-python"
FIND_TRAINERS = """
import os
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    if b"dflash_trainer.train" in argv and argv[argv.index(b"dflash_trainer.train") - 1] == b"-m":
        print(pid)
"""


def dev_python(work: Path) -> dict[str, str]:
    """The venv shim for the CT (see the module docstring); returns the mount points it needs."""
    base = Path(os.path.realpath(sys.base_prefix))
    at = Path("/opt/host-python") if base == Path("/usr") else base  # never over the CT's own /usr
    exe = Path(os.path.realpath(sys.executable))  # the interpreter behind the dev venv's bin/python
    shim = work / "dev-python"
    (shim / "bin").mkdir(parents=True)
    (shim / "bin" / "python").symlink_to(at / exe.relative_to(base))
    # the run controller's console script, as pip writes it into a venv's bin (the role calls bin/dflash-run)
    ctl = shim / "bin" / "dflash-run"
    ctl.write_text(f"#!{DEV_PYTHON}/bin/python\nimport sys\nfrom dflash_run.cli import main\nsys.exit(main())\n")
    ctl.chmod(0o755)
    site_dir = shim / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_dir.mkdir(parents=True)
    (site_dir / "site-packages").symlink_to(sysconfig.get_paths()["purelib"])
    (shim / "pyvenv.cfg").write_text(f"home = {at}/bin\ninclude-system-site-packages = false\n"
                                     f"version = {platform.python_version()}\n")
    return {"mp0": f"{REPO},mp={REPO},ro=1", "mp1": f"{base},mp={at},ro=1", "mp3": f"{shim},mp={DEV_PYTHON},ro=1"}


def unit(site: Site, *props: str) -> dict[str, str]:
    res = site.exec("systemctl", "show", UNIT, "-p", ",".join(props))
    return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


def trainer_pids(site: Site) -> list[int]:
    """Trainer processes in the CT: argv `... -m dflash_trainer.train ...` (the minimal Debian base has no ps)."""
    res = site.exec("python3", "-c", FIND_TRAINERS)
    assert res.returncode == 0, res.stderr
    return [int(p) for p in res.stdout.split()]


def starts(site: Site) -> list[str]:
    """The run log, one piece per trainer start (dflash-run writes `[dflash_run ...] start: argv`)."""
    log = site.run_dir / "logs" / "train.log"
    return log.read_text().split("] start: ")[1:] if log.is_file() else []


@pytest.fixture(scope="module")
def site(pve_host, debian_rootfs, tmp_path_factory, debian13_standins, tiny_target):
    work = tmp_path_factory.mktemp("deploy-systemd")
    # the stand-in lock for this Debian 13 CT's python3: the real requires-python, ==3.13.*
    s = Site(pve_host, work, venv_inputs(debian13_standins, debian13_standins.wheelhouse), tiny_target, vmid=VMID,
             template=build_systemd_template(debian_rootfs), steps=STEPS, every=EVERY,
             run_vars={"training_run_python": f"{DEV_PYTHON}/bin/python", "training_run_env": {}})
    s.mounts = dict(dev_python(work), mp2=f"{s.persist},mp=/srv/dflash")
    yield s
    if s.host.container_exists(VMID):
        journal = s.exec("journalctl", "-u", UNIT, "--no-pager", "-n", "300").stdout  # shown when the test fails
        print(f"journal of {UNIT} (systemd's own lines and the run's output):\n{journal}")
    s.destroy()


def test_systemd_unit_train_restart_stop_resume(site):
    # ---- provision (the frozen environment built from the stand-in lock), then the mount points
    proc = site.prov.run(site.inv)
    assert proc.returncode == 0, out(proc)[-3000:]
    site.remount(site.mounts)
    booted = ""
    for _ in range(120):  # until systemd has finished booting (degraded: a unit a CT cannot run, modules-load)
        booted = site.exec("systemctl", "is-system-running")
        if booted.stdout.strip() in ("running", "degraded"):
            break
        time.sleep(0.5)
    assert booted.stdout.strip() in ("running", "degraded"), booted.stdout + booted.stderr
    assert site.exec("cat", "/proc/1/comm").stdout.strip() == "systemd"

    # ---- deploy: `auto` finds systemd; the unit is installed and loaded
    proc = site.make("deploy")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert json.loads((site.run_dir / "launch.json").read_text())["supervisor"] == "systemd"
    assert unit(site, "LoadState", "ActiveState") == {"LoadState": "loaded", "ActiveState": "inactive"}
    again = site.make("deploy")
    assert again.returncode == 0 and "changed=0" in again.stdout  # idempotent

    # ---- train: the preflight, then `systemctl start`; how to follow it
    proc = site.make("train")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert f"journalctl -fu {UNIT}" in proc.stdout
    assert site.exec("systemctl", "is-active", UNIT).stdout.strip() == "active"
    failed = lambda: site.exec("systemctl", "is-failed", UNIT).stdout.strip() == "failed"
    wait_for(lambda: site.checkpoints() and site.checkpoints()[-1] >= EVERY, 300, "the first checkpoint", site,
             failed=failed)
    status = site.make("train-status")
    assert status.returncode == 0 and "state:       running (supervisor: systemd, restarts: 0)" in status.stdout
    assert "checkpoint:  step" in status.stdout and f"of {STEPS}" in status.stdout, status.stdout
    busy = site.make("train")  # a second start: the preflight finds the running trainer
    assert busy.returncode != 0 and "is still running" in out(busy), out(busy)[-3000:]
    logs = site.make("train-logs")
    # the first start of a deployment is a new run: --resume comes once the directory holds one
    assert logs.returncode == 0 and "dflash_trainer.train" in logs.stdout and "--resume" not in logs.stdout
    assert "drafter: " in logs.stdout  # the trainer's own output
    wait_for(lambda: "drafter: " in site.exec("journalctl", "-u", UNIT, "--no-pager").stdout, 60,
             "the trainer's output in the journal", site, failed=failed)  # journald has it too

    # ---- a failure: the trainer is killed (SIGKILL); systemd restarts it and it resumes from its checkpoint
    (pid,) = trainer_pids(site)
    assert json.loads((site.run_dir / "supervisor.json").read_text())["job_pid"] == pid
    assert site.exec("sh", "-c", 'kill -KILL "$1"', "sh", str(pid)).returncode == 0  # the shell's kill: no procps
    latest = int(os.readlink(site.run_dir / "checkpoints" / "latest").split("-")[1])  # the trainer's last one
    wait_for(lambda: len(starts(site)) == 2 and "resumed from" in starts(site)[1], 120, "the restart", site,
             failed=failed)
    first, restarted = starts(site)
    assert "resumed from" not in first and "trainer failed (exit -9)" in first
    assert "--resume" in restarted.splitlines()[0]  # the restart's command line
    resumed_at = int(restarted.split("resumed from")[1].split(" at step ")[1].split()[0])
    assert resumed_at == latest
    assert unit(site, "NRestarts")["NRestarts"] == "1"
    wait_for(lambda: site.checkpoints()[-1] > resumed_at, 300, "a checkpoint after the restart", site, failed=failed)
    status = site.make("train-status")
    assert "state:       running (supervisor: systemd, restarts: 1)" in status.stdout, status.stdout
    logs = site.make("train-logs")  # the run's log, and what systemd said about the unit
    assert logs.returncode == 0 and "resumed from" in logs.stdout, logs.stdout
    assert f"systemd about {UNIT}" in logs.stdout and "restart counter is at 1" in logs.stdout, logs.stdout

    # ---- graceful stop: the trainer finishes its step, writes a checkpoint there and exits 0
    proc = site.make("train-stop")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert f"stopped {UNIT} (unit inactive, result success): stopped;" in proc.stdout, proc.stdout
    assert unit(site, "ActiveState", "Result") == {"ActiveState": "inactive", "Result": "success"}
    assert not trainer_pids(site)
    log = (site.run_dir / "logs" / "train.log").read_text()
    stopped_at = int(log.split("stopped at step ")[1].split(":")[0])
    assert resumed_at < stopped_at < STEPS and site.checkpoints()[-1] == stopped_at
    assert not list((site.run_dir / "checkpoints").glob(".tmp-step-*"))
    assert "stopped (trainer exit 0)" in log
    assert site.state()["state"] == "stopped"
    status = site.make("train-status")
    assert "state:       stopped (supervisor: systemd" in status.stdout and f"step {stopped_at} of {STEPS}" in status.stdout

    # ---- train again: resumes from the stop and finishes
    proc = site.make("train")
    assert proc.returncode == 0, out(proc)[-3000:]
    wait_for(lambda: site.state().get("state") == "finished"
             and site.exec("systemctl", "is-active", UNIT).stdout.strip() == "inactive", 420,
             "the resumed run to finish", site, failed=failed)
    summary = json.loads((site.run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and len(summary["losses"]) == STEPS - stopped_at
    assert len(starts(site)) == 3 and f"at step {stopped_at}" in starts(site)[2]
    assert unit(site, "Result")["Result"] == "success"
    status = site.make("train-status")
    assert "state:       finished" in status.stdout and f"summary:     {STEPS} steps" in status.stdout
