"""`make deploy / train / train-status / train-logs / train-stop / rebuild / doctor` end to end:
real `make` and ansible-playbook runs against the Proxmox VE test host, the real trainer inside a real LXC
container (CPU, a tiny target), supervised, stopped gracefully and resumed from its checkpoint.

How the test container gets what a real one has (and what differs, said plainly):
- the frozen environment (/opt/venv, the default both stages share) is rebuilt by `make rebuild` from the stand-in lock and
  wheelhouse (tests/image_standins.py); the drift doctor guards it, for real;
- the stand-in lock has no real torch, so the trainer runs with this machine's dev venv, bind-mounted
  read-only (mpN: <path>,mp=<path>,ro=1) with its Python installation: `training_run_python` points at it;
- persistent storage is a host folder bind-mounted at /srv/dflash (checkpoints survive the rebuild);
- the stand-in NVIDIA userspace (as in the provisioning tests) keeps the doctor's driver check clean; the
  run itself is a CPU run (training_run_device: cpu), so the GPU preflight is covered by unit tests only;
- the test host's containers run busybox init, not systemd: `auto` picks the process supervisor (the
  documented fallback). tests/test_deploy_systemd.py runs the systemd unit, in a CT whose init is systemd.
"""
from __future__ import annotations

import json

import pytest

from tests.helpers.deploy import EVERY, RUN, VENV, Site, out, venv_inputs, wait_for

# Enough steps that the run outlasts the status, busy-start and log checks made while it trains (at 120, one CI
# run finished training before `make train-stop` came); the resumed run then trains the rest.
STEPS = 480

pytest_plugins = ["tests.image_standins"]
pytestmark = [pytest.mark.lxc, pytest.mark.slow]


@pytest.fixture(scope="module")
def site(pve_host, tmp_path_factory, standins, stocked_wheelhouse, tiny_target):
    s = Site(pve_host, tmp_path_factory.mktemp("deploy"), venv_inputs(standins, stocked_wheelhouse), tiny_target,
             steps=STEPS)
    yield s
    s.destroy()


def test_provision_deploy_train_stop_drift_rebuild_resume(site):
    # ---- provision (no venv yet), then the mount points: repo + Python read-only, persistent storage rw
    site.provision_busybox()

    # ---- deploy refuses a container without the environment, and says how to fix it
    proc = site.make("deploy")
    assert proc.returncode != 0 and f"has no training environment at {VENV}" in out(proc)
    assert f"make rebuild INVENTORY={site.inv}" in out(proc)
    assert not (site.run_dir / "run.toml").exists()

    # ---- rebuild: the environment from the (stand-in) lock; the doctor is clean
    proc = site.make("rebuild")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert site.make("doctor").returncode == 0

    # ---- deploy: run-control package, trainer wheel (installed with uv, --no-deps), rendered run config
    proc = site.make("deploy")
    assert proc.returncode == 0, out(proc)[-3000:]
    run_toml = (site.run_dir / "run.toml").read_text()
    assert 'path = "/srv/dflash/tiny/target"' in run_toml and f"steps = {STEPS}" in run_toml
    assert 'compile_cache_dir = "/srv/dflash/compile-cache"' in run_toml
    assert json.loads((site.run_dir / "launch.json").read_text())["supervisor"] == "process"  # busybox init
    again = site.make("deploy")
    assert again.returncode == 0 and "changed=0" in again.stdout  # idempotent

    # ---- train: preflight, detached process supervisor, status and logs while it runs
    proc = site.make("train")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert f"tail -f /srv/dflash/{RUN}/logs/train.log" in proc.stdout  # how to follow it
    wait_for(lambda: site.checkpoints() and site.checkpoints()[-1] >= EVERY, 300, "the first checkpoint", site)
    status = site.make("train-status")
    assert status.returncode == 0 and "state:       running (supervisor: process" in status.stdout
    assert "checkpoint:  step" in status.stdout and f"of {STEPS}" in status.stdout
    busy = site.make("train")  # a second start: the preflight finds the running trainer
    assert busy.returncode != 0 and "is still running" in out(busy) and "make train-stop INVENTORY=" in out(busy)
    logs = site.make("train-logs")
    # the first start of a deployment is a new run: --resume comes once the directory holds one
    assert logs.returncode == 0 and "dflash_trainer.train" in logs.stdout and "--resume" not in logs.stdout

    # ---- graceful stop: the checkpoint in progress is finished, the trainer is gone
    proc = site.make("train-stop")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert site.state()["state"] == "stopped"
    stopped_at = site.checkpoints()[-1]
    assert EVERY <= stopped_at < STEPS and not list((site.run_dir / "checkpoints").glob(".tmp-step-*"))
    assert site.exec("sh", "-c", "ps | grep -v grep | grep -q dflash_trainer.train").returncode != 0
    assert "stopped (trainer exit" in (site.run_dir / "logs" / "train.log").read_text()

    # ---- drift: a planted .pth in the environment; deploy refuses and changes nothing
    site_packages = site.exec("sh", "-c", f"ls -d {VENV}/lib/python3*/site-packages").stdout.strip()
    assert site.exec("sh", "-c", f"echo 'import os' > {site_packages}/zz_planted.pth").returncode == 0
    before = (site.run_dir / "run.toml").stat().st_mtime_ns
    proc = site.make("deploy")
    assert proc.returncode != 0 and "drift" in out(proc).lower() and "zz_planted.pth" in out(proc)
    assert f"Fix: make rebuild INVENTORY={site.inv}" in out(proc)
    assert (site.run_dir / "run.toml").stat().st_mtime_ns == before
    assert site.make("doctor").returncode != 0

    # ---- rebuild: clean again, run outputs and checkpoints kept (they are on the mount point)
    proc = site.make("rebuild")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert site.checkpoints()[-1] == stopped_at
    doctor = site.make("doctor")
    assert doctor.returncode == 0, out(doctor)[-2000:]
    assert site.make("deploy").returncode == 0

    # ---- train again: it resumes from the checkpoint and finishes
    proc = site.make("train")
    assert proc.returncode == 0, out(proc)[-3000:]
    wait_for(lambda: site.state().get("state") in ("finished", "failed"), 420, "the resumed run to finish", site)
    assert site.state()["state"] == "finished"
    summary = json.loads((site.run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and len(summary["losses"]) == STEPS - stopped_at  # only the rest was trained
    log = (site.run_dir / "logs" / "train.log").read_text()
    assert log.count("] start: ") == 2
    first, resumed = log.split("] start: ")[1:]
    assert "--resume" not in first.splitlines()[0] and "--resume" in resumed.splitlines()[0]
    assert "resumed from" not in first and "resumed from" in resumed  # resumed, not restarted
    status = site.make("train-status")
    assert "state:       finished" in status.stdout and f"summary:     {STEPS} steps" in status.stdout
