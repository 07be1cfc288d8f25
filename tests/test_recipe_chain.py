"""The recipe chain (dflash_run.recipe): regenerate -> train -> eval as one detached job.

End to end on a CPU with the embedded default, made small with --set and --args: a stop in the middle of
training, a second start that finishes the chain without redoing regeneration, status at each point, and a
stage that refuses its input stopping the chain with its error."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import ANY

import pytest
from dflash_run import jobs, recipe, supervise

CLI = [sys.executable, "-m", "dflash_run"]
SMALL = ["--args", "target=--pretrain-steps 2 --max-new-tokens 8",
         "--args", "regenerate=--max-new-tokens 8 --limit 24",
         "--args", "eval=--limit 1 --device cpu",
         "--set", "train.checkpoint_every=2", "--set", "train.log_every=1",
         "--set", "eval.prompts=2", "--set", "eval.max_new_tokens=8"]


def dflash_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def chain_status(chain: Path) -> str:
    res = dflash_run("status", "--job", "recipe", "--run-dir", str(chain))
    assert res.returncode == 0, res.stderr
    return res.stdout


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return False


def stamps(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(directory.iterdir()) if p.is_file()}


def test_plan_wires_each_stage_output_into_the_next(tmp_path):
    plan = recipe.make_plan(tmp_path / "c", "qwen3-8b", "/models/q", ["chats.jsonl"], ["train.steps=5"],
                            {"eval": ["--limit", "3"]}, nproc=4, python="py")
    stages = {s["name"]: s for s in plan["stages"]}
    assert list(stages) == ["regenerate", "train", "eval"]  # a real target: nothing to build
    regen, train, ev = stages["regenerate"]["argv"], stages["train"]["argv"], stages["eval"]["argv"]
    assert regen[:5] == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    assert regen[regen.index("--out") + 1] == stages["regenerate"]["dir"]
    shards = json.dumps([str(Path(stages["regenerate"]["dir"]) / "part-*.jsonl")])
    assert f"data.train={shards}" in train and "target.path=/models/q" in train and "train.steps=5" in train
    assert train[train.index("--output-dir") + 1] == stages["train"]["dir"]
    assert ev[ev.index("--run") + 1] == stages["train"]["dir"] and ev[-2:] == ["--limit", "3"]
    embedded = recipe.make_plan(tmp_path / "e", "embedded", "embedded", ["d.jsonl"], [], {})
    build = embedded["stages"][0]
    assert build["name"] == "target"
    regen = embedded["stages"][1]["argv"]
    assert regen[regen.index("--target") + 1] == str(Path(build["dir"]) / "target")
    assert regen[-2:] == ["--max-new-tokens", "48"]  # the tiny target's context is 512 tokens
    with_args = recipe.make_plan(tmp_path / "e", "embedded", "embedded", ["d.jsonl"], [],
                                 {"regenerate": ["--max-new-tokens", "8"]})["stages"][1]["argv"]
    assert with_args[-4:] == ["--max-new-tokens", "48", "--max-new-tokens", "8"]  # the last one given wins


def test_paths_given_relative_are_made_absolute_for_the_stages(tmp_path, monkeypatch):
    (tmp_path / "chats.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    plan = recipe.make_plan(Path("c"), "qwen3-8b", "embedded", ["chats.jsonl", "org/hub-set"], [], {})
    regen = plan["stages"][1]["argv"]
    assert regen[regen.index("--data") + 1:regen.index("--out")] == [str(tmp_path / "chats.jsonl"), "org/hub-set"]
    assert plan["stages"][0]["dir"] == str(tmp_path / "c" / "embedded")
    assert "qwen3-8b" in plan["stages"][2]["argv"]  # a bundled config's name stays a name


def deploy_jobs(root: Path) -> dict[str, Path]:
    """Each job's launch.json as `make deploy` writes it, in its own directory."""
    dirs = {"regenerate": root / "regen", "train": root / "run", "eval": root / "run" / "eval"}
    for name, job_dir in dirs.items():
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / supervise.LAUNCH).write_text(json.dumps({
            "job": name, "argv": ["/venv/bin/python", "-m", f"dflash_trainer.{name}", "--out", str(job_dir)],
            "env": {"HF_HOME": "/srv/hf"}, "max_restarts": 3, "supervisor": "systemd"}))
    return dirs


def test_a_deployed_chain_runs_each_jobs_own_launch(tmp_path):
    dirs = deploy_jobs(tmp_path)
    chain = tmp_path / "chain"
    res = dflash_run("recipe", "--plan-only", "--run-dir", str(chain),
                     *[f"--job-dir={n}={d}" for n, d in reversed(list(dirs.items()))])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"recipe chain in {chain}: regenerate to run, train to run, eval to run"
    plan = recipe.read_plan(chain)
    assert [s["name"] for s in plan["stages"]] == ["regenerate", "train", "eval"]  # the chain's order, not the flags'
    assert all(s["deployed"] and s["dir"] == str(dirs[s["name"]]) for s in plan["stages"])
    assert plan["stages"][1]["argv"][-2:] == ["--out", str(dirs["train"])]
    assert not (chain / "supervisor.json").exists()  # planned, not started
    recipe.write_ended(chain, {"regenerate": {"state": "finished"}})
    res = dflash_run("recipe", "--plan-only", "--run-dir", str(chain), *[f"--job-dir={n}={d}" for n, d in dirs.items()])
    assert "regenerate finished before (not run again), train to run" in res.stdout
    # a redeploy that changed regeneration's command line runs it again
    launch = json.loads((dirs["regenerate"] / supervise.LAUNCH).read_text())
    (dirs["regenerate"] / supervise.LAUNCH).write_text(json.dumps(dict(launch, argv=launch["argv"] + ["--limit", "9"])))
    res = dflash_run("recipe", "--plan-only", "--run-dir", str(chain), *[f"--job-dir={n}={d}" for n, d in dirs.items()])
    assert "the deployed jobs changed: regenerate will run again" in res.stdout


def test_a_deployed_chain_keeps_the_deployed_launch(tmp_path):
    """The chain's stage runs the job as make deploy described it (its environment too), and leaves its
    launch.json as deploy wrote it."""
    job_dir = tmp_path / "run"
    job_dir.mkdir()
    child = "import os, pathlib; pathlib.Path('summary.json').write_text(os.environ['MARK'])"
    deployed = json.dumps({"job": "train", "argv": [sys.executable, "-c", child, "-m", "dflash_trainer.train"],
                           "env": {"MARK": "from the inventory"}, "supervisor": "systemd"})
    (job_dir / supervise.LAUNCH).write_text(deployed)
    chain = tmp_path / "chain"
    recipe.save_plan(chain, recipe.deployed_plan({"train": job_dir}))
    res = dflash_run("run", "--job", "recipe", "--run-dir", str(chain))  # what the chain's systemd unit runs
    assert res.returncode == 0, res.stdout + res.stderr
    assert (job_dir / "summary.json").read_text() == "from the inventory"
    assert (job_dir / supervise.LAUNCH).read_text() == deployed
    assert recipe.read_ended(chain)["train"]["state"] == "finished"


def test_deployed_stages_are_checked_before_anything_is_written(tmp_path):
    chain = tmp_path / "chain"
    res = dflash_run("recipe", "--run-dir", str(chain), "--job-dir=train=/x", "--config", "embedded")
    assert res.returncode == 2 and "--job-dir takes the stages from the deployed jobs" in res.stderr
    res = dflash_run("recipe", "--run-dir", str(chain), "--job-dir=bogus=/x")
    assert res.returncode == 2 and "STAGE one of regenerate, train, eval" in res.stderr
    res = dflash_run("recipe", "--run-dir", str(chain), f"--job-dir=train={tmp_path / 'never'}")
    assert res.returncode != 0 and "the training was not deployed" in res.stderr and "make deploy" in res.stderr
    assert not chain.exists()


def test_a_killed_chain_leaves_its_stage_running_and_recipe_stop_stops_it(tmp_path):
    """SIGKILL takes the chain's process (and the stage's supervisor inside it) away, not the stage's own process,
    which runs in a session of its own: status names it, recipe-stop stops it gracefully, and then a start may
    continue the chain."""
    run = tmp_path / "run"
    run.mkdir()
    child = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
             "pathlib.Path('up').touch(); time.sleep(60)")
    (run / supervise.LAUNCH).write_text(json.dumps({"job": "train", "argv": [
        sys.executable, "-c", child, "-m", "dflash_trainer.train", "--output-dir", str(run)]}))
    chain = tmp_path / "chain"
    recipe.save_plan(chain, recipe.deployed_plan({"train": run}))
    assert dflash_run("start", "--job", "recipe", "--run-dir", str(chain)).returncode == 0
    assert wait_for(lambda: (run / "up").exists(), 20)
    os.kill(int(supervise.read_state(chain)["pid"]), 9)
    assert wait_for(lambda: "state:       dead at stage train" in chain_status(chain), 10)
    stage = int(supervise.read_state(run)["job_pid"])
    assert f"left running: training process {stage} still writes to {run}: stop it (make recipe-stop" in \
        chain_status(chain)
    res = dflash_run("stop", "--job", "recipe", "--run-dir", str(chain))
    assert res.returncode == 0 and "the recipe chain's process is gone; its train stage still ran" in res.stdout
    assert "stopped 1 training process(es)" in res.stdout, res.stdout
    assert wait_for(lambda: not recipe.stray_processes(chain), 10)
    assert "next:        `make recipe` continues" in chain_status(chain)


def finished(plan: dict) -> dict:
    """stages.json after each stage of the plan finished, as the chain records it (with what it ran with)."""
    return {s["name"]: {"state": "finished", "rc": 0, "fingerprint": recipe.fingerprint(s)} for s in plan["stages"]}


def test_a_changed_stage_and_those_after_it_run_again(tmp_path):
    chain = tmp_path / "c"
    first = recipe.make_plan(chain, "embedded", "/t", ["a.jsonl"], [], {}, python="py")
    assert recipe.save_plan(chain, first) == {}
    recipe.write_ended(chain, finished(first))
    assert recipe.save_plan(chain, first) == {}  # the same plan again: nothing is redone
    assert recipe.save_plan(chain, recipe.make_plan(chain, "embedded", "/t", ["a.jsonl"], ["train.steps=9"], {},
                                                    python="py")) == {"train": "its command line changed",
                                                                      "eval": "train runs again before it"}
    assert list(recipe.read_ended(chain)) == ["regenerate"]


def deployed_with_config(root: Path) -> tuple[dict, Path]:
    """The deployed jobs of deploy_jobs, the training reading its run.toml as make deploy renders it."""
    dirs = deploy_jobs(root)
    config = dirs["train"] / "run.toml"
    config.write_text("[train]\nsteps = 100\n")
    launch = json.loads((dirs["train"] / supervise.LAUNCH).read_text())
    launch["argv"] += ["--config", str(config)]
    (dirs["train"] / supervise.LAUNCH).write_text(json.dumps(launch))
    return dirs, config


def test_a_changed_config_reruns_its_stage_and_those_after_it(tmp_path):
    """The deployed run.toml edited (train.steps) with the command line as it was: training and the evaluation of
    its drafter run again, regeneration is kept; the status says why. The same config again: all skipped."""
    dirs, config = deployed_with_config(tmp_path)
    chain = tmp_path / "chain"
    plan = recipe.deployed_plan(dirs)
    assert recipe.save_plan(chain, plan) == {}
    recipe.write_ended(chain, finished(plan))
    assert recipe.save_plan(chain, recipe.deployed_plan(dirs)) == {}  # unchanged: all skipped
    assert recipe.plan_summary(chain).endswith("eval finished before (not run again)")

    config.write_text("[train]\nsteps = 200\n")
    why = f"config changed since it finished: {config}"
    # the status says it before the chain is planned again ...
    assert recipe.report(chain)["stages"]["train"] == f"finished, runs again at the next start ({why})"
    assert recipe.save_plan(chain, recipe.deployed_plan(dirs)) == {"train": why, "eval": "train runs again before it"}
    assert list(recipe.read_ended(chain)) == ["regenerate"]
    # ... and after, until the stage has run: a plan made again keeps why
    assert recipe.save_plan(chain, recipe.deployed_plan(dirs)) == {}
    assert recipe.plan_summary(chain) == (f"recipe chain in {chain}: regenerate finished before (not run again), "
                                          f"train to run again ({why}), eval to run again (train runs again before it)")
    assert recipe.report(chain)["stages"] == {"regenerate": "finished", "train": f"to run again ({why})",
                                              "eval": "to run again (train runs again before it)"}


def test_a_record_from_before_fingerprints_reruns_a_stage_that_reads_a_config(tmp_path):
    """stages.json written by an earlier version holds no fingerprint: whether the training's config changed since
    is unknown, so it runs again (and the evaluation after it); regeneration reads no config and is compared by its
    command line as before."""
    dirs, _ = deployed_with_config(tmp_path)
    chain = tmp_path / "chain"
    recipe.save_plan(chain, recipe.deployed_plan(dirs))
    recipe.write_ended(chain, {n: {"state": "finished", "rc": 0} for n in dirs})
    assert recipe.save_plan(chain, recipe.deployed_plan(dirs)) == {
        "train": "it finished before the chain recorded its config's contents", "eval": "train runs again before it"}


def test_a_config_that_is_not_there_is_refused_naming_it_and_the_fix(tmp_path):
    dirs, config = deployed_with_config(tmp_path)
    chain = tmp_path / "chain"
    recipe.save_plan(chain, recipe.deployed_plan(dirs))
    planned = (chain / recipe.PLAN).read_text()
    config.unlink()
    res = dflash_run("recipe", "--plan-only", "--run-dir", str(chain), *[f"--job-dir={n}={d}" for n, d in dirs.items()])
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"the train stage reads the config {config}, which is not there: make deploy INVENTORY=" in res.stderr
    assert (chain / recipe.PLAN).read_text() == planned  # nothing written
    res = dflash_run("recipe", "--plan-only", "--run-dir", str(tmp_path / "local"), "--config", "nope.toml")
    assert res.returncode == 2 and "reads the config nope.toml, which is not there: give --config a TOML" in res.stderr
    assert "not there" in recipe.report(chain)["stages"]["train"]  # the status says it, and does not fail


def test_the_chain_reruns_a_finished_stage_whose_config_changed(tmp_path):
    """The chain itself (as its systemd unit runs it, with no new plan) compares what a finished stage ran with."""
    job_dir = tmp_path / "run"
    job_dir.mkdir()
    config = job_dir / "run.toml"
    config.write_text("[train]\nsteps = 1\n")
    child = ("import pathlib; p = pathlib.Path('starts'); p.write_text(p.read_text() + 'x' if p.exists() else 'x'); "
             "pathlib.Path('summary.json').write_text('{}')")  # a training that finished
    (job_dir / supervise.LAUNCH).write_text(json.dumps({"job": "train", "argv": [
        sys.executable, "-c", child, "-m", "dflash_trainer.train", "--config", str(config)]}))
    chain = tmp_path / "chain"
    recipe.save_plan(chain, recipe.deployed_plan({"train": job_dir}))
    for edit, starts in ((None, "x"), (None, "x"), ("[train]\nsteps = 2\n", "xx")):
        if edit:
            config.write_text(edit)
        res = dflash_run("run", "--job", "recipe", "--run-dir", str(chain))
        assert res.returncode == 0, res.stdout + res.stderr
        assert (job_dir / "starts").read_text() == starts
    log = (chain / "logs" / "recipe.log").read_text()
    assert "stage train: finished before, not run again" in log
    assert f"(again: config changed since it finished: {config})" in log


def a_finished_run(run: Path, steps: int = 2) -> None:
    """What a training run that finished leaves in its directory (the trainer's files, by name)."""
    (run / "checkpoints" / f"step-{steps:08d}").mkdir(parents=True)
    (run / "drafter").mkdir()
    (run / "config.json").write_text("{}")
    (run / "summary.json").write_text(json.dumps({"steps": steps}))
    (run / "trackers.json").write_text("{}")
    (run / "logs").mkdir(exist_ok=True)
    (run / "logs" / "train.log").write_text("the first run\n")


def test_a_finished_training_that_runs_again_is_said_to_start_afresh(tmp_path):
    """Its config changed: make recipe and recipe-status say the training starts afresh and where its previous run
    is kept (the status before the plan: as a pattern, the directory is named when planned); the evaluation after it
    runs again as before. A record from before fingerprints resumes, as it did then."""
    dirs, config = deployed_with_config(tmp_path)
    a_finished_run(dirs["train"])
    chain = tmp_path / "chain"
    plan = recipe.deployed_plan(dirs)
    recipe.save_plan(chain, plan)
    recipe.write_ended(chain, finished(plan))
    config.write_text("[train]\nsteps = 100\n[optim]\nlr = 1e-3\n")
    why = f"config changed since it finished: {config}"
    assert recipe.report(chain)["stages"]["train"] == (
        f"finished, runs again at the next start ({why}; starts afresh from step 0, the previous run is kept as "
        f"{dirs['train']}.replaced-<UTC time then>)")
    res = dflash_run("recipe", "--plan-only", "--run-dir", str(chain), *[f"--job-dir={n}={d}" for n, d in dirs.items()])
    assert res.returncode == 0, res.stderr
    kept = recipe.read_plan(chain)["stages"][1]["afresh"]
    assert re.fullmatch(re.escape(f"{dirs['train']}.replaced-") + r"\d{8}T\d{6}Z", kept), kept
    said = f"{why}; starts afresh from step 0, the previous run is kept as {kept}"
    assert f"the deployed jobs changed: train will run again ({said}); eval will run again" in res.stdout
    assert f"train to run again ({said}), eval to run again (train runs again before it)" in res.stdout
    assert recipe.report(chain)["stages"]["train"] == f"to run again ({said})"
    assert not Path(kept).exists() and (dirs["train"] / "summary.json").exists()  # planned: nothing moved yet
    # planned again before it started: the same decision, the same directory
    assert recipe.save_plan(chain, recipe.deployed_plan(dirs)) == {}
    assert recipe.read_plan(chain)["stages"][1]["afresh"] == kept

    recipe.write_ended(chain, {n: {"state": "finished", "rc": 0} for n in dirs})  # an earlier version's records
    again = recipe.save_plan(chain, recipe.deployed_plan(dirs))
    assert again["train"] == recipe.UNRECORDED and "afresh" not in recipe.read_plan(chain)["stages"][1]


def test_a_changed_data_file_reruns_the_stage_that_reads_it(tmp_path):
    """Regeneration's --data and a training's data.train (in its config, a glob) are known by each file's size and
    contents: a file edited, added or removed reruns its stage and those after it; touched by nothing, all skipped. A
    record from before data was recorded is not rerun for it."""
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text('{"messages": []}\n')
    shards = tmp_path / "mine"
    shards.mkdir()
    (shards / "part-0.jsonl").write_text("{}\n")
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\ntrain = ["{shards}/part-*.jsonl"]\n')
    chain, run = tmp_path / "c", str(tmp_path / "run")
    plan = {"stages": [
        {"name": "regenerate", "dir": str(tmp_path), "argv": ["py", "-m", "dflash_trainer.regenerate", "--data",
                                                             prompts.name, "--out", "regen"]},  # from its directory
        {"name": "train", "dir": run, "argv": ["py", "-m", "dflash_trainer.train", "--config", str(config)]},
        {"name": "eval", "dir": str(tmp_path / "eval"), "argv": ["py", "-m", "dflash_trainer.eval", "--run", run]}]}
    assert recipe.fingerprint(plan["stages"][1])["data"] == {
        str(shards / "part-0.jsonl"): [3, ANY, hashlib.sha256(b"{}\n").hexdigest()]}
    recipe.save_plan(chain, plan)
    recipe.write_ended(chain, finished(plan))
    assert recipe.save_plan(chain, plan) == {}

    (shards / "part-1.jsonl").write_text("{}\n")
    assert recipe.save_plan(chain, plan) == {
        "train": f"data changed since it finished: {shards / 'part-1.jsonl'}", "eval": "train runs again before it"}
    recipe.write_ended(chain, finished(plan))
    prompts.write_text('{"messages": []}\n{"messages": []}\n')
    assert recipe.save_plan(chain, plan) == {"regenerate": f"data changed since it finished: {prompts}",
                                             "train": "regenerate runs again before it",
                                             "eval": "regenerate runs again before it"}

    recipe.write_ended(chain, {name: dict(record, fingerprint={k: v for k, v in record["fingerprint"].items()
                                                               if k != "data"})
                               for name, record in finished(plan).items()})
    prompts.write_text("")
    assert recipe.save_plan(chain, plan) == {}


def one_data_file_chain(tmp_path: Path) -> tuple[dict, Path, Path]:
    """A regeneration reading one prompts file, and the chain's directory, everything recorded as finished."""
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text('{"messages": []}\n')
    plan = {"stages": [{"name": "regenerate", "dir": str(tmp_path), "argv": [
        "py", "-m", "dflash_trainer.regenerate", "--data", str(prompts), "--out", "regen"]}]}
    chain = tmp_path / "c"
    recipe.save_plan(chain, plan)
    recipe.write_ended(chain, finished(plan))
    return plan, prompts, chain


def later(path: Path) -> None:
    """path's modification time a second on: what a touch, a copy or a checkout of the same bytes does."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_a_data_file_is_known_by_its_contents_not_its_time(tmp_path):
    """The same bytes with a new time (touched, copied, checked out again) are no change; other bytes of the same
    size are, whatever the time says."""
    plan, prompts, chain = one_data_file_chain(tmp_path)
    later(prompts)
    assert recipe.save_plan(chain, plan) == {}
    before = prompts.stat().st_mtime_ns
    prompts.write_text('{"messages": [1]}'[:-1] + "\n")  # the same size, other bytes
    assert prompts.stat().st_size == len('{"messages": []}\n')
    os.utime(prompts, ns=(before, before + 10**9))
    assert recipe.save_plan(chain, plan) == {"regenerate": f"data changed since it finished: {prompts}"}


def test_a_data_file_above_the_bound_is_known_by_its_size_and_time(tmp_path, monkeypatch):
    """A file larger than HASHED_UP_TO is not read: its time decides, as does the time of a file recorded without
    its contents (an earlier version's record)."""
    monkeypatch.setattr(recipe, "HASHED_UP_TO", 4)
    plan, prompts, chain = one_data_file_chain(tmp_path)
    assert len(recipe.read_ended(chain)["regenerate"]["fingerprint"]["data"][str(prompts)]) == 2  # size and time
    assert recipe.save_plan(chain, plan) == {}
    later(prompts)
    assert recipe.save_plan(chain, plan) == {"regenerate": f"data changed since it finished: {prompts}"}


def test_a_training_that_stopped_or_failed_starts_afresh_when_what_it_reads_changed(tmp_path):
    """A training that stopped or failed resumes while nothing changed; when its config changed, or regeneration
    before it runs again (new data), it starts afresh as a finished one does (its previous run kept beside it), and
    make recipe and recipe-status say so."""
    dirs, config = deployed_with_config(tmp_path)
    a_finished_run(dirs["train"])
    chain = tmp_path / "chain"
    plan = recipe.deployed_plan(dirs)
    recipe.save_plan(chain, plan)
    ended = finished(plan)
    del ended["eval"]
    for state in ("stopped", "failed"):
        recipe.write_ended(chain, {**ended, "train": {**ended["train"], "state": state, "rc": 1}})
        assert recipe.save_plan(chain, recipe.deployed_plan(dirs)) == {}  # nothing changed: resumed
        assert recipe.report(chain)["stages"]["train"] == state
        assert "afresh" not in recipe.read_plan(chain)["stages"][1]

    config.write_text("[train]\nsteps = 100\n[optim]\nlr = 1e-3\n")
    why = f"config changed since it failed: {config}"
    assert recipe.report(chain)["stages"]["train"] == (
        f"failed, runs again at the next start ({why}; starts afresh from step 0, the previous run is kept as "
        f"{dirs['train']}.replaced-<UTC time then>)")
    again = recipe.save_plan(chain, recipe.deployed_plan(dirs))
    kept = recipe.read_plan(chain)["stages"][1]["afresh"]
    assert again == {"train": f"{why}; starts afresh from step 0, the previous run is kept as {kept}"}
    assert "train" not in recipe.read_ended(chain)
    assert recipe.report(chain)["stages"]["train"] == f"to run again ({again['train']})"

    stopped = finished(recipe.deployed_plan(dirs))  # recorded with this config; regeneration's command line changes
    recipe.write_ended(chain, {"regenerate": stopped["regenerate"], "train": {**stopped["train"], "state": "stopped"}})
    dirs["regenerate"].joinpath(supervise.LAUNCH).write_text(json.dumps({"job": "regenerate", "argv": [
        "py", "-m", "dflash_trainer.regenerate", "--data", "other.jsonl", "--out", "x"]}))
    again = recipe.save_plan(chain, recipe.deployed_plan(dirs))
    assert again["regenerate"] == "its command line changed"
    assert again["train"].startswith("regenerate runs again before it; starts afresh from step 0")


def test_flag_values_reads_each_form_a_command_line_gives(tmp_path):
    argv = ["py", "-m", "dflash_trainer.regenerate", "--data", "a.jsonl", "b-*.jsonl", "--out", "o", "--data=c.jsonl",
            "--prompts", "p.jsonl"]
    assert recipe.flag_values(argv, "--data") == ["a.jsonl", "b-*.jsonl", "c.jsonl"]
    assert recipe.flag_values(argv, "--out") == ["o"] and recipe.flag_values(argv, "--set") == []


def test_move_run_aside_moves_the_run_only_and_puts_it_all_back_when_a_rename_fails(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    a_finished_run(run)
    for mine in ("launch.json", "run.toml", "supervisor.json"):  # the deployment's and the supervisor's
        (run / mine).write_text("{}")
    (run / "compile-cache").mkdir()
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    real_rename = os.rename

    def no_checkpoints(src, dst):  # a rename that fails halfway, as across file systems
        if Path(src).name == "checkpoints":
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        real_rename(src, dst)

    kept = jobs.replaced_dir(run)
    monkeypatch.setattr(os, "rename", no_checkpoints)
    with pytest.raises(OSError):
        jobs.move_run_aside(run, kept)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before and not kept.exists()
    monkeypatch.setattr(os, "rename", real_rename)
    moved = jobs.move_run_aside(run, kept)
    assert set(moved) == {"config.json", "summary.json", "drafter", "checkpoints", "trackers.json", "logs/train.log"}
    assert (kept / "checkpoints" / "step-00000002").is_dir() and (kept / "logs" / "train.log").is_file()
    assert sorted(p.name for p in run.iterdir()) == ["compile-cache", "launch.json", "logs", "run.toml",
                                                     "supervisor.json"]
    assert not jobs.holds_run(run) and jobs.holds_run(kept)
    assert jobs.replaced_dir(run) != kept  # taken: the next one is another


def fake_training(job_dir: Path, config: Path, fail: bool = False) -> None:
    """A deployed training whose process records each start's arguments and finishes a run of 2 steps as the trainer
    does (a step directory, config.json, summary.json), or fails after its first checkpoint."""
    child = ("import json, pathlib, sys; p = pathlib.Path('starts'); "
             "p.write_text((p.read_text() if p.exists() else '') + ' '.join(sys.argv[1:]) + '\\n'); "
             "pathlib.Path('checkpoints/step-00000001').mkdir(parents=True, exist_ok=True); "
             "pathlib.Path('config.json').write_text('{}'); "
             + ("sys.exit(1)" if fail else
                "pathlib.Path('checkpoints/step-00000002').mkdir(); pathlib.Path('summary.json').write_text("
                "json.dumps({'steps': 2}))"))
    (job_dir / supervise.LAUNCH).write_text(json.dumps({"job": "train", "max_restarts": 0, "argv": [
        sys.executable, "-c", child, "-m", "dflash_trainer.train", "--config", str(config)]}))


def test_the_chain_trains_a_changed_run_afresh_and_resumes_one_that_failed(tmp_path):
    """The chain as its systemd unit runs it: the finished run whose config changed is moved aside whole (the
    deployment's files stay), and the training starts without --resume; that new run failing, the next start resumes
    it (--resume) and moves nothing."""
    job_dir = tmp_path / "run"
    job_dir.mkdir()
    config = job_dir / "run.toml"
    config.write_text("[train]\nsteps = 2\n")
    fake_training(job_dir, config)
    chain = tmp_path / "chain"
    recipe.save_plan(chain, recipe.deployed_plan({"train": job_dir}))
    assert dflash_run("run", "--job", "recipe", "--run-dir", str(chain)).returncode == 0
    assert recipe.read_ended(chain)["train"]["state"] == "finished"

    config.write_text("[train]\nsteps = 2\n[optim]\nlr = 1e-3\n")
    fake_training(job_dir, config, fail=True)
    res = dflash_run("run", "--job", "recipe", "--run-dir", str(chain))
    assert res.returncode == 1, res.stdout + res.stderr
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(kept) == 1 and (kept[0] / "checkpoints" / "step-00000002").is_dir(), kept
    assert json.loads((kept[0] / "summary.json").read_text()) == {"steps": 2}
    assert "start: " in (kept[0] / "logs" / "train.log").read_text()  # the first run's log went with it
    starts = (job_dir / "starts").read_text().splitlines()
    assert len(starts) == 2 and "--resume" not in starts[1]  # afresh
    assert config.exists() and (job_dir / supervise.LAUNCH).exists()  # the deployment's files stay
    assert not (job_dir / "summary.json").exists() and (job_dir / "checkpoints" / "step-00000001").is_dir()
    log = (chain / "logs" / "recipe.log").read_text()
    assert "stage train: trains afresh from step 0; the previous run (" in log and f"is kept in {kept[0]}" in log
    assert "afresh" not in recipe.read_plan(chain)["stages"][0]  # decided once: done

    fake_training(job_dir, config)
    assert dflash_run("run", "--job", "recipe", "--run-dir", str(chain)).returncode == 0
    starts = (job_dir / "starts").read_text().splitlines()
    assert len(starts) == 3 and starts[2].endswith("--resume")  # the failed one resumed
    assert [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")] == kept  # nothing moved again
    assert recipe.read_ended(chain)["train"]["state"] == "finished"


def test_bad_stage_arguments_are_refused_before_anything_is_written(tmp_path):
    res = dflash_run("recipe", "--run-dir", str(tmp_path / "c"), "--args", "bogus=--x")
    assert res.returncode == 2 and "STAGE one of target, regenerate, train, eval" in res.stderr
    assert not (tmp_path / "c").exists()
    res = dflash_run("status", "--job", "recipe", "--run-dir", str(tmp_path / "nope"))
    assert res.returncode == 2 and "no such directory" in res.stdout


def test_a_stage_process_left_running_keeps_the_chain_from_starting(tmp_path):
    chain = tmp_path / "c"
    recipe.save_plan(chain, recipe.make_plan(chain, "embedded", str(tmp_path), ["d.jsonl"], [], {}))
    regen = chain / "regen"
    # a regeneration the killed chain left behind: its module and --out on the command line
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "dflash_trainer.regenerate",
                              "--out", str(regen)])
    try:
        assert wait_for(lambda: recipe.stray_processes(chain), 10)
        res = dflash_run("recipe", "--run-dir", str(chain))
        assert res.returncode == 1 and f"regeneration process {stray.pid} still writes to {regen}" in res.stderr
        assert not regen.exists()  # nothing was started
    finally:
        stray.kill()
        stray.wait()


def test_a_job_that_refuses_its_input_is_not_restarted(tmp_path):
    run = tmp_path / "job"
    run.mkdir()
    child = "import sys; print('bad row', flush=True); sys.exit(2)"
    (run / supervise.LAUNCH).write_text(json.dumps({"argv": [sys.executable, "-c", child],
                                                    "restart_delay_s": 0, "max_restarts": 3}))
    assert supervise.run(run, restart=True) == 2
    assert supervise.read_state(run)["state"] == "failed"
    log = (run / supervise.LOG).read_text()
    assert log.splitlines().count("bad row") == 1 and "not restarted" in log


@pytest.mark.slow
def test_chain_stops_in_training_and_a_second_start_finishes_it(tmp_path):
    chain = tmp_path / "chain"
    res = dflash_run("recipe", "--run-dir", str(chain), *SMALL, "--set", "train.steps=60")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "recipe chain started" in res.stdout
    run = chain / "run"
    assert wait_for(lambda: any((run / "checkpoints").glob("step-*/training_state.json")), 400), chain_status(chain)
    running = chain_status(chain)
    assert "state:       running at stage train" in running
    assert "target finished, regenerate finished, train running, eval not started" in running
    assert "progress:    train: step" in running
    regen = stamps(chain / "regen")
    assets = (chain / "embedded" / "assets.json").stat().st_mtime_ns

    res = dflash_run("stop", "--job", "recipe", "--run-dir", str(chain))
    assert res.returncode == 0, res.stdout + res.stderr
    stopped = chain_status(chain)
    assert "state:       stopped at stage train" in stopped and "train stopped, eval not started" in stopped
    assert "make recipe` continues" in stopped
    assert not (run / "summary.json").exists()  # stopped before its last step

    res = dflash_run("recipe", "--run-dir", str(chain))  # no arguments: the same plan, continued
    assert res.returncode == 0, res.stdout + res.stderr
    assert wait_for(lambda: supervise.read_state(chain).get("state") in ("finished", "failed", "stopped"), 500)
    done = chain_status(chain)
    assert "state:       finished" in done, done
    assert "target finished, regenerate finished, train finished, eval finished" in done
    assert "result:      tau " in done and (chain / "eval" / "eval.json").is_file()
    assert stamps(chain / "regen") == regen  # regeneration was not redone ...
    assert (chain / "embedded" / "assets.json").stat().st_mtime_ns == assets  # ... nor the target built again
    log = (chain / "logs" / "recipe.log").read_text()
    assert "stage regenerate: finished before, not run again" in log
    train_log = (run / "logs" / "train.log").read_text()
    assert train_log.count("start: ") == 2 and "--resume" in train_log.split("start: ")[2].splitlines()[0]
    assert json.loads((run / "summary.json").read_text())["steps"] == 60
    # planned again with nothing changed: what each stage ran with is what it reads now, so nothing runs again
    res = dflash_run("recipe", "--run-dir", str(chain), "--plan-only")
    assert res.returncode == 0 and "to run" not in res.stdout and "eval finished before" in res.stdout, res.stdout


@pytest.mark.slow
def test_a_stage_that_refuses_its_input_stops_the_chain(tmp_path, tiny_target):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n{"bar": 2}\n')
    chain = tmp_path / "chain"
    res = dflash_run("recipe", "--run-dir", str(chain), "--foreground", "--target", tiny_target["target"],
                     "--data", str(bad), timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    failed = chain_status(chain)
    assert "state:       failed at stage regenerate (exit 2)" in failed
    assert "no row of" in failed and "Regeneration needs chat rows" in failed  # the error line, naming the fix
    assert "regenerate failed, train not started, eval not started" in failed
    assert not (chain / "run").exists()  # the chain stopped: training never started


@pytest.mark.slow
def test_a_failed_target_build_stops_the_chain_with_its_error(tmp_path):
    chain = tmp_path / "chain"
    res = dflash_run("recipe", "--run-dir", str(chain), "--foreground", "--args", "target=--pretrain-steps 0")
    assert res.returncode == 2, res.stdout + res.stderr
    failed = chain_status(chain)
    assert "state:       failed at stage target (exit 2)" in failed
    assert "--pretrain-steps: 0: must be >= 1" in failed and "regenerate not started" in failed


@pytest.mark.slow
def test_a_changed_setting_trains_the_recipe_afresh_and_keeps_the_previous_run(tmp_path):
    """The embedded chain finished, then planned again with another learning rate and train.steps as it was: the
    training runs from step 0 with the new rate (resumed, it would have trained nothing), the previous run is kept
    beside it with its checkpoint and drafter, and the evaluation runs again on the new drafter."""
    chain, steps = tmp_path / "chain", ["--set", "train.steps=4"]
    res = dflash_run("recipe", "--run-dir", str(chain), "--foreground", *SMALL, *steps, timeout=500)
    assert res.returncode == 0, res.stdout + res.stderr
    run = chain / "run"
    first_eval = (chain / "eval" / "eval.json").stat().st_mtime_ns
    first_lr = json.loads((run / "config.json").read_text())["train"]["lr"]
    assert first_lr != 1e-4

    res = dflash_run("recipe", "--run-dir", str(chain), "--foreground", *SMALL, *steps, "--set", "train.lr=1e-4",
                     timeout=500)
    assert res.returncode == 0, res.stdout + res.stderr
    kept = sorted(chain.glob("run.replaced-*"))
    assert len(kept) == 1, sorted(p.name for p in chain.iterdir())
    assert f"train will run again (its command line changed; starts afresh from step 0, the previous run is kept " \
           f"as {kept[0]})" in res.stdout
    assert (kept[0] / "checkpoints" / "step-00000004").is_dir() and (kept[0] / "drafter").is_dir()
    assert json.loads((kept[0] / "config.json").read_text())["train"]["lr"] == first_lr
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 1e-4
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    train_log = (run / "logs" / "train.log").read_text()
    assert train_log.count("start: ") == 1 and "--resume" not in train_log  # a new run, from step 0
    assert "resumed from" not in train_log and "train: step 1/4" in train_log
    assert (chain / "eval" / "eval.json").stat().st_mtime_ns != first_eval  # evaluated again
    assert "stage regenerate: finished before, not run again" in (chain / "logs" / "recipe.log").read_text()
    # the kept run is whole where it is: evaluated from its own directory
    res = subprocess.run([sys.executable, "-m", "dflash_trainer.eval", "--run", str(kept[0]), "--limit", "1",
                          "--device", "cpu", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0 and (kept[0] / "eval" / "eval.json").is_file(), res.stdout + res.stderr
