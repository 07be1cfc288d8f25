"""`make regenerate / eval INVENTORY=...` end to end: the DFlash recipe in a real LXC container of the Proxmox VE
test host, each job detached under the run controller (dflash-run), its output on the mount point. The target
regenerates the answers, the drafter trains on them, the evaluation measures it; a rerun of the regeneration
resumes (answers nothing twice); a job is refused while another one holds the container.

The container is the one tests/test_deploy_container.py describes (busybox init, so the process supervisor; the
dev venv runs the jobs, on the CPU, with a tiny target). tests/test_deploy_logic.py renders the systemd units of
these jobs and has systemd-analyze check them; tests/test_deploy_systemd.py runs the training's unit.
"""
from __future__ import annotations

import json

import pytest

from tests.helpers.deploy import Site, out, venv_inputs, wait_for

pytest_plugins = ["tests.image_standins"]
pytestmark = [pytest.mark.lxc, pytest.mark.slow]

VMID = 9303
PROMPTS, SHARD = 24, 8
STEPS, EVERY = 60, 20
REGEN = "/srv/dflash/regen/default"  # training_run_regenerate_out's default, in the container


@pytest.fixture(scope="module")
def site(pve_host, tmp_path_factory, standins, stocked_wheelhouse, tiny_target):
    s = Site(pve_host, tmp_path_factory.mktemp("deploy-jobs"), venv_inputs(standins, stocked_wheelhouse), tiny_target,
             vmid=VMID, steps=STEPS, every=EVERY, run_vars={
                 "training_run_regenerate_data": ["/srv/dflash/tiny/train.jsonl"],
                 "training_run_regenerate_args": ["--max-new-tokens", "8", "--limit", str(PROMPTS),
                                                  "--shard-size", str(SHARD)],
                 "training_run_data_train": [f"{REGEN}/part-*.jsonl"],  # the drafter learns the target's answers
                 "training_run_eval_args": ["--limit", "2", "--max-new-tokens", "8"]})
    yield s
    s.destroy()


def finished(site: Site, job: str) -> bool:
    return site.state(job).get("state") in ("finished", "failed")


def test_regenerate_train_eval_in_the_container(site):
    site.provision_busybox()
    proc = site.make("rebuild")
    assert proc.returncode == 0, out(proc)[-3000:]

    # ---- deploy: each job's launch description, in its own directory on the mount point
    proc = site.make("deploy")
    assert proc.returncode == 0, out(proc)[-3000:]
    regen_dir, eval_dir = site.job_dir("regenerate"), site.job_dir("eval")
    assert json.loads((regen_dir / "launch.json").read_text())["job"] == "regenerate"
    assert json.loads((eval_dir / "launch.json").read_text())["job"] == "eval"
    assert "make train | eval | regenerate INVENTORY=..." in proc.stdout

    # ---- regenerate: detached, the shards land on the mount point
    proc = site.make("regenerate")
    assert proc.returncode == 0, out(proc)[-3000:]
    assert f"tail -f {REGEN}/logs/regenerate.log" in proc.stdout
    wait_for(lambda: finished(site, "regenerate"), 300, "the regeneration", site, job="regenerate")
    assert site.state("regenerate")["state"] == "finished"
    shards = sorted(regen_dir.glob("part-*.jsonl"))
    assert len(shards) == PROMPTS // SHARD
    rows = [json.loads(line) for shard in shards for line in shard.read_text().splitlines()]
    assert len(rows) == PROMPTS and all(sum(r["loss_mask"]) > 0 for r in rows)
    status = site.make("regenerate-status")
    assert status.returncode == 0 and "state:       finished (supervisor: process" in status.stdout, status.stdout
    assert f"shards:      {PROMPTS // SHARD} (data.train takes {REGEN}/part-*.jsonl)" in status.stdout
    assert f"summary:     {PROMPTS} prompts answered" in status.stdout
    logs = site.make("regenerate-logs")
    assert logs.returncode == 0 and "dflash_trainer.regenerate" in logs.stdout and "finished" in logs.stdout, logs.stdout

    # ---- regenerate again: it resumes, answering nothing twice, and leaves the shards as they were
    written = {p.name: p.stat().st_mtime_ns for p in shards}
    proc = site.make("regenerate")
    assert proc.returncode == 0, out(proc)[-3000:]
    wait_for(lambda: finished(site, "regenerate"), 300,
             "the second regeneration", site, job="regenerate")
    log = (regen_dir / "logs" / "regenerate.log").read_text()
    assert log.count("] start: ") == 2
    assert f"{PROMPTS} already answered in {REGEN}, 0 to go" in log.split("] start: ")[2], log[-2000:]
    assert {p.name: p.stat().st_mtime_ns for p in regen_dir.glob("part-*.jsonl")} == written

    # ---- train on the regenerated shards; a job started meanwhile is refused by its preflight
    proc = site.make("train")
    assert proc.returncode == 0, out(proc)[-3000:]
    busy = site.make("eval")
    assert busy.returncode != 0 and "training process" in out(busy) and "is still running" in out(busy)
    assert f"make train-stop INVENTORY={site.inv}" in out(busy)
    assert not (eval_dir / "supervisor.json").exists()  # nothing was started
    wait_for(lambda: finished(site, "train"), 480, "the training", site)
    assert site.state()["state"] == "finished"
    config = json.loads((site.run_dir / "config.json").read_text())
    assert config["data"]["train"] == [f"{REGEN}/part-*.jsonl"]

    # ---- eval: the run's drafter against its target, on its held-out prompts; the results on the mount point
    proc = site.make("eval")
    assert proc.returncode == 0, out(proc)[-3000:]
    wait_for(lambda: finished(site, "eval"), 300, "the evaluation", site, job="eval")
    assert site.state("eval")["state"] == "finished"
    report = json.loads((eval_dir / "eval.json").read_text())
    assert report["overall"]["prompts"] == 2 and report["overall"]["tau"] >= 1.0
    assert (eval_dir / "eval.png").is_file()
    status = site.make("eval-status")
    assert status.returncode == 0 and "state:       finished" in status.stdout
    said = " ".join(status.stdout.split())  # the YAML callback may fold long lines
    assert f"result: tau {report['overall']['tau']:.2f}, speedup" in said, status.stdout
    assert "on 2 prompts (held-out): /srv/dflash/runs/default/eval/eval.json, eval.png" in said, status.stdout
    stop = site.make("eval-stop")  # nothing left to stop: said, not an error
    assert stop.returncode == 0 and "nothing to stop: no evaluation process writes to" in stop.stdout
