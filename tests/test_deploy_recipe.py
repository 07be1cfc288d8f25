"""`make recipe INVENTORY=...` end to end: provision, deploy, then regenerate -> train -> eval as one chain of the
deployed jobs, supervised inside a real LXC container of the Proxmox VE test host (the process supervisor: busybox
init), so it goes on without the `make` that started it. Stopped in the middle of training, a second `make recipe`
continues: regeneration is not done again, training resumes from its checkpoint, the evaluation writes eval.json.

The container is the one tests/test_deploy_container.py describes (the dev venv runs the jobs, on the CPU, with a
tiny target); tests/test_recipe_chain.py runs the same chain without Proxmox.
"""
from __future__ import annotations

import json

import pytest

from tests.helpers.deploy import Site, out, venv_inputs, wait_for

pytest_plugins = ["tests.image_standins"]
pytestmark = [pytest.mark.lxc, pytest.mark.slow]

VMID = 9304
PROMPTS, SHARD = 16, 8
STEPS, EVERY = 300, 10
CHAIN = "/srv/dflash/recipe/default"  # training_run_recipe_dir's default, in the container


@pytest.fixture(scope="module")
def site(pve_host, tmp_path_factory, standins, stocked_wheelhouse, tiny_target):
    s = Site(pve_host, tmp_path_factory.mktemp("deploy-recipe"), venv_inputs(standins, stocked_wheelhouse),
             tiny_target, vmid=VMID, steps=STEPS, every=EVERY, run_vars={
                 "training_run_regenerate_data": ["/srv/dflash/tiny/train.jsonl"],
                 "training_run_regenerate_args": ["--max-new-tokens", "8", "--limit", str(PROMPTS),
                                                  "--shard-size", str(SHARD)],
                 # no training data, no held-out set named: the chain trains on regeneration's shards by default,
                 # and evaluates on the run's held-out prompts
                 "training_run_data_train": None, "training_run_data_eval": None,
                 "training_run_eval_args": ["--limit", "2", "--max-new-tokens", "8"]})
    yield s
    s.destroy()


def ended(site: Site) -> bool:
    return site.state("recipe").get("state") in ("finished", "failed", "stopped")


def stamps(directory) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(directory.glob("part-*.jsonl"))}


def test_recipe_stopped_in_training_and_continued_to_its_evaluation(site):
    site.provision_busybox()
    proc = site.make("rebuild")  # the frozen environment, from the stand-in lock (the template has none)
    assert proc.returncode == 0, out(proc)[-3000:]

    # ---- make recipe: provision (nothing to change), deploy, then the chain, detached in the container
    proc = site.make("recipe")
    assert proc.returncode == 0, out(proc)[-3000:]
    said = " ".join(proc.stdout.split())
    assert f"recipe chain in {CHAIN}: regenerate to run, train to run, eval to run" in said, proc.stdout[-3000:]
    assert "make recipe-status / make recipe-logs / make recipe-stop" in said
    regen_dir, run_dir = site.job_dir("regenerate"), site.run_dir
    wait_for(lambda: site.checkpoints() and site.checkpoints()[-1] >= EVERY, 600, "the first checkpoint", site,
             failed=lambda: site.state("recipe").get("state") == "failed", job="recipe")
    assert 'train = ["/srv/dflash/regen/default/part-*.jsonl"]' in (run_dir / "run.toml").read_text()
    assert len(list(regen_dir.glob("part-*.jsonl"))) == PROMPTS // SHARD

    status = site.make("recipe-status")
    said = " ".join(status.stdout.split())  # the YAML callback may fold long lines
    assert status.returncode == 0 and "state: running at stage train" in said, status.stdout
    assert "regenerate finished, train running, eval not started" in said and "progress: train: step" in said

    # ---- make recipe-stop: training stops after its checkpoint; the chain records where it stopped
    proc = site.make("recipe-stop")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert site.state("recipe")["state"] == "stopped" and site.state("recipe")["stage"] == "train"
    assert site.state("train")["state"] == "stopped" and not (run_dir / "summary.json").exists()
    assert site.exec("sh", "-c", "ps | grep -v grep | grep -q dflash_trainer").returncode != 0
    stopped_at = site.checkpoints()[-1]
    assert stopped_at < STEPS
    status = site.make("recipe-status")
    said = " ".join(status.stdout.split())
    assert "state: stopped at stage train" in said and "train stopped, eval not started" in said, status.stdout
    shards = stamps(regen_dir)

    # ---- make recipe again: regeneration is not redone, training resumes, the evaluation runs
    proc = site.make("recipe")
    assert proc.returncode == 0, out(proc)[-3000:]
    said = " ".join(proc.stdout.split())
    assert "regenerate finished before (not run again), train to run, eval to run" in said, proc.stdout[-3000:]
    wait_for(lambda: ended(site), 600, "the chain to finish", site, failed=lambda: False, job="recipe")
    assert site.state("recipe")["state"] == "finished", (site.job_dir("recipe") / "logs" / "recipe.log").read_text()
    report = json.loads((site.job_dir("eval") / "eval.json").read_text())
    assert report["overall"]["tau"] >= 1.0
    assert stamps(regen_dir) == shards
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and len(summary["losses"]) == STEPS - stopped_at  # only the rest was trained
    train_log = (run_dir / "logs" / "train.log").read_text()
    assert train_log.count("] start: ") == 2 and "--resume" in train_log.split("] start: ")[2].splitlines()[0]
    assert (regen_dir / "logs" / "regenerate.log").read_text().count("] start: ") == 1

    status = site.make("recipe-status")
    said = " ".join(status.stdout.split())
    assert "state: finished" in said and "regenerate finished, train finished, eval finished" in said, status.stdout
    assert f"result: tau {report['overall']['tau']:.2f}" in said
    logs = site.make("recipe-logs")
    assert logs.returncode == 0 and "stage regenerate: finished before, not run again" in logs.stdout, logs.stdout


# ---- the production path: the chain as its systemd unit, in a CT whose init is systemd -------------------------
SYSTEMD_VMID = 9305
UNIT = "dflash-recipe-default"


@pytest.fixture(scope="module")
def systemd_site(pve_host, debian_rootfs, tmp_path_factory, debian13_standins, tiny_target):
    from tests.pve_testhost.templates import build_systemd_template
    from tests.test_deploy_systemd import DEV_PYTHON, dev_python

    work = tmp_path_factory.mktemp("deploy-recipe-systemd")
    s = Site(pve_host, work, venv_inputs(debian13_standins, debian13_standins.wheelhouse), tiny_target,
             vmid=SYSTEMD_VMID, template=build_systemd_template(debian_rootfs), steps=STEPS, every=EVERY, run_vars={
                 "training_run_python": f"{DEV_PYTHON}/bin/python", "training_run_env": {},
                 "training_run_regenerate_data": ["/srv/dflash/tiny/train.jsonl"],
                 "training_run_regenerate_args": ["--max-new-tokens", "8", "--limit", str(PROMPTS)],
                 "training_run_data_train": None, "training_run_eval_args": ["--limit", "2", "--max-new-tokens", "8"]})
    s.mounts = dict(dev_python(work), mp2=f"{s.persist},mp=/srv/dflash")
    yield s
    if s.host.container_exists(SYSTEMD_VMID):
        print(s.exec("journalctl", "-u", UNIT, "--no-pager", "-n", "200").stdout)  # shown when the test fails
    s.destroy()


def test_recipe_under_its_systemd_unit(systemd_site):
    site = systemd_site
    proc = site.prov.run(site.inv)  # the frozen environment, built from the stand-in lock; then the mount points
    assert proc.returncode == 0, out(proc)[-3000:]
    site.remount(site.mounts)
    wait_for(lambda: site.exec("systemctl", "is-system-running").stdout.strip() in ("running", "degraded"), 60,
             "systemd to boot", site, failed=lambda: False)

    proc = site.make("recipe")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert site.exec("systemctl", "is-active", UNIT).stdout.strip() == "active"
    failed = lambda: site.state("recipe").get("state") == "failed"
    wait_for(lambda: site.checkpoints() and site.checkpoints()[-1] >= EVERY, 600, "the first checkpoint", site,
             failed=failed, job="recipe")
    proc = site.make("recipe-stop")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert f"stopped {UNIT} (unit inactive, result success): stopped" in proc.stdout, proc.stdout
    assert site.state("recipe")["stage"] == "train" and not (site.run_dir / "summary.json").exists()
    shards = stamps(site.job_dir("regenerate"))

    proc = site.make("recipe")
    assert proc.returncode == 0, out(proc)[-3000:]
    wait_for(lambda: ended(site) and site.exec("systemctl", "is-active", UNIT).stdout.strip() == "inactive", 600,
             "the chain to finish", site, failed=lambda: False, job="recipe")
    assert site.state("recipe")["state"] == "finished"
    assert (site.job_dir("eval") / "eval.json").is_file() and stamps(site.job_dir("regenerate")) == shards
    assert json.loads((site.run_dir / "summary.json").read_text())["steps"] == STEPS
