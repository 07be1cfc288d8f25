"""Deploy tests' helpers: the PVE test host, one container, an inventory of training_run_* settings, and
`make` with that INVENTORY (tests/test_deploy_*.py); waiting on the run the container supervises."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.frozen import VENV  # noqa: F401 - the deploy tests take it from here too
from tests.helpers.provision import REPO, Provision
from tests.helpers.provision import failure_text as out  # the deploy tests call it out()
from tests.pve_testhost.templates import build_test_template

VMID = 9301
STEPS, EVERY = 120, 4
RUN = "runs/default"  # under the persistent folder
# torch's system libraries (libstdc++, libgomp, ...): this machine's, beside the busybox template's own
# /usr/lib (which holds the stand-in NVIDIA userspace), through training_run_env's LD_LIBRARY_PATH.
HOST_LIBS = os.path.dirname(os.path.realpath("/usr/lib/x86_64-linux-gnu/libstdc++.so.6"))


def ldd_libs(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return [p.split()[0] for line in out.splitlines() if "=>" in line and (p := line.split("=>")[1].strip())
            and p.startswith("/")]


class Site:
    """The test host, one container, an inventory, and `make` with that INVENTORY.

    Defaults: the busybox template with python, this machine's dev venv as the trainer's interpreter, a run
    of STEPS steps with a checkpoint every EVERY; `template`, `vmid`, `steps`, `every` and `run_vars`
    (training_run_* and other group vars; None leaves a setting at the role's default) change them.
    """

    def __init__(self, host, work: Path, inputs: dict, tiny: dict, *, vmid: int = VMID,
                 template: Path | None = None, steps: int = STEPS, every: int = EVERY, run_vars: dict | None = None):
        self.host, self.work, self.uv, self.vmid = host, work, inputs["training_venv_uv"], vmid
        self.persist = work / "persist"
        (self.persist / "tiny").mkdir(parents=True)
        for key in ("target",):
            shutil.copytree(tiny[key], self.persist / "tiny" / key)
        for key in ("train", "eval"):
            shutil.copy2(tiny[key], self.persist / "tiny" / f"{key}.jsonl")
        self.prov = Provision(host, work, template or build_test_template(python=True))
        group_vars = {
            "proxmox_lxc_unprivileged": False,  # writes to the bind-mounted host folder as root
            "proxmox_lxc_memory": 4096,
            "training_venv_enabled": True, **inputs,  # the venv at its default path (VENV)
            "training_run_target_path": "/srv/dflash/tiny/target", "training_run_target_dtype": "float32",
            "training_run_data_train": ["/srv/dflash/tiny/train.jsonl"],
            "training_run_data_eval": ["/srv/dflash/tiny/eval.jsonl"],
            "training_run_device": "cpu", "training_run_python": f"{REPO}/.venv/bin/python",
            "training_run_settings": {
                "drafter": {"num_layers": 2, "block_size": 8},
                "data": {"max_length": 128, "context_buckets": [64, 128]},
                "train": {"steps": steps, "checkpoint_every": every, "micro_batch": 4, "num_anchors": 8,
                          "lr": 3e-3, "dtype": "float32", "log_every": 50, "keep_last": 2},
                "eval": {"prompts": 2, "max_new_tokens": 8}},
            "training_run_env": {"LD_LIBRARY_PATH": f"{sys.base_prefix}/lib:/host-libs"}, "training_run_min_free_gb": 0.1, "training_run_restart_delay_s": 1, "training_run_stop_timeout_s": 120,
            **(run_vars or {}),
        }
        group_vars = {key: value for key, value in group_vars.items() if value is not None}
        self.inv = self.prov.inventory({f"ct{vmid}": {
            "proxmox_lxc_vmid": vmid, "proxmox_lxc_hostname": f"ct{vmid}", "proxmox_gpu_devices": [0],
            "training_venv_stage_dir": str(work / "stage" / "venv"),
            "training_run_stage_dir": str(work / "stage" / "run")}}, **group_vars)
        self.inv.rename(work / "hosts.json")
        self.inv = work / "hosts.json"

    def make(self, *targets: str, timeout: int = 600) -> subprocess.CompletedProcess:
        return make_with(self.host, self.inv, self.work, *targets, timeout=timeout)

    def exec(self, *argv: str) -> subprocess.CompletedProcess:
        return self.host.exec_in_container(self.vmid, list(argv))

    def remount(self, mounts: dict[str, str]) -> None:
        """Set mount points (mpN: volume,mp=path[,ro=1]) the way an admin would: stop, pct set, start."""
        r = self.host.ssh(f"pct stop {self.vmid} && "
                          + " && ".join(f"pct set {self.vmid} -{k} {v}" for k, v in mounts.items())
                          + f" && pct start {self.vmid}")
        assert r.returncode == 0, r.stdout + r.stderr

    def provision_busybox(self) -> None:
        """`make provision` without the venv, then the mounts the busybox template needs: this repository and
        this machine's Python read-only (the trainer runs with the dev venv), the persistent folder at
        /srv/dflash, this machine's libraries for torch; and the libraries uv (the rebuild's and the deploy's
        installer) needs and the template lacks."""
        proc = self.prov.run(self.inv, "-e", "training_venv_enabled=false")
        assert proc.returncode == 0, out(proc)[-3000:]
        self.remount({"mp0": f"{REPO},mp={REPO},ro=1", "mp1": f"{sys.base_prefix},mp={sys.base_prefix},ro=1",
                      "mp2": f"{self.persist},mp=/srv/dflash", "mp3": f"{HOST_LIBS},mp=/host-libs,ro=1"})
        for lib in ldd_libs(self.uv):
            if self.exec("test", "-e", lib).returncode != 0:
                assert self.host.ssh(f"pct push {self.vmid} {lib} {lib}").returncode == 0

    def destroy(self) -> None:
        if self.host.container_exists(self.vmid):
            self.host.ssh(f"pct stop {self.vmid}; pct destroy {self.vmid}")

    @property
    def run_dir(self) -> Path:
        return self.persist / RUN

    def checkpoints(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in (self.run_dir / "checkpoints").glob("step-*")
                      if (p / "training_state.json").is_file() or (p / "training_state.pt").is_file())

    def job_dir(self, job: str = "train") -> Path:
        """Where a job's launch, state, log and output are, seen from this machine (the roles' defaults)."""
        return {"train": self.run_dir, "regenerate": self.persist / "regen" / "default",
                "eval": self.run_dir / "eval", "recipe": self.persist / "recipe" / "default"}[job]

    def state(self, job: str = "train") -> dict:
        try:
            return json.loads((self.job_dir(job) / "supervisor.json").read_text())
        except (OSError, ValueError):
            return {}


def make_with(host, inventory: Path, work: Path, *targets: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`make TARGET... INVENTORY=inventory` as a user runs it: the password from the environment, never printed."""
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_STDOUT_CALLBACK="default",
               ANSIBLE_LOCAL_TEMP=str(work / "tmp"), ANSIBLE_HOME=str(work / "ansible-home"),
               PROXMOX_PASSWORD=host.root_password)
    for key in ("PROXMOX_TOKEN_ID", "PROXMOX_TOKEN_SECRET", "INVENTORY", "MAKEFLAGS"):
        env.pop(key, None)
    # -o: the venv these tests run in is the one make would (re)install; never touch it from here
    proc = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", *targets,
                           f"INVENTORY={inventory}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert host.root_password not in proc.stdout + proc.stderr, "a secret was printed"
    return proc


def wait_for(cond, timeout: float, what: str, site: Site, failed=None, job: str = "train"):
    """Poll cond; stop early when the job failed (by default: its supervisor recorded `failed`)."""
    failed = failed or (lambda: site.state(job).get("state") == "failed")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if failed():
            break
        time.sleep(0.5)
    log = site.job_dir(job) / "logs" / f"{job}.log"
    pytest.fail(f"timed out waiting for {what} ({job} state {site.state(job).get('state')}); log tail:\n"
                + (log.read_text()[-3000:] if log.is_file() else "none"))


def venv_inputs(standins, wheelhouse: Path) -> dict:
    """The training_venv_* rebuild inputs: the stand-in lock, its wheelhouse, the trainer wheel and uv."""
    from tests.image_standins import UV  # here, not at import: pytest registers the module as a plugin first

    return {"training_venv_lock_dir": str(standins.project), "training_venv_wheelhouse": str(wheelhouse),
            "training_venv_trainer_wheel": str(standins.trainer_wheel), "training_venv_uv": UV}
