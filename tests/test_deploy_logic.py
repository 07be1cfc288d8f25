"""The deployment stage's logic without a container: the role's jinja2 run config and each job's launch
description and systemd unit (rendered by a real ansible-playbook run of the role's own tasks; the run config
read by the trainer's own loader), input validation, the run controller's preflight checks, and its process
supervisor (restart with --resume, graceful stop, status) of the dflash-run package the trainer wheel ships."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from dflash_run import preflight, procs, status, supervise
from dflash_run.jobs import EVAL, REGENERATE, TRAIN, job_of

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "ansible" / "roles" / "training_run"

ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
CLI = [str(Path(sys.executable).parent / "dflash-run")]  # the trainer wheel's entry point, as the containers run it


# ---- rendering: the role's templates through ansible-playbook ---------------------------------------
def render_all(base: Path, variants: dict[str, dict]) -> subprocess.CompletedProcess:
    """Run the role's validate.yml and its templates on localhost, once per variant (the defaults + that
    variant's overrides), into base/<variant>: run.toml, and <job>/launch.json and <job>/dflash-job.service for
    each job deploy renders, recipe/dflash-job.service (the chain's unit) and recipe/stages.json (the chain's
    --job-dir arguments). One ansible-playbook run for them all (its start-up is most of the time)."""
    each = {"training_run_each_job": "{{ item.0 }}"}
    plays = []
    for name, overrides in variants.items():
        out = base / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "overrides.json").write_text(json.dumps(overrides))
        plays.append({
            "name": name, "hosts": "localhost", "connection": "local", "gather_facts": False,
            # the role's defaults and vars, the defaults of its dependency, the `training` role (training_venv_path,
            # ...), then the variant's overrides: a later vars file wins, as the inventory wins over the defaults
            "vars_files": [str(ROLE.parent / "training" / "defaults" / "main.yml"), str(ROLE / "defaults" / "main.yml"),
                           str(ROLE / "vars" / "main.yml"), str(out / "overrides.json")],
            "vars": {"ansible_python_interpreter": sys.executable, "training_run_supervisor_kind": "process"},
            # The templates through Ansible's own templar (lookup), written by one module call per variant: a
            # module call costs about half a second on 2 cores, and deploy's template tasks make ten.
            "tasks": [
                {"name": "validate", "ansible.builtin.include_tasks": str(ROLE / "tasks" / "validate.yml")},
                {"name": "run config", "ansible.builtin.set_fact": {
                    "rendered_files": {"run.toml": "{{ lookup('template', '%s') }}" % (ROLE / "templates" / "run.toml.j2")}}},
                {"name": "jobs", "ansible.builtin.set_fact": {"rendered_files": (
                    "{{ rendered_files | combine({item.0 ~ '/' ~ item.1: lookup('template', '%s/' ~ item.1 ~ '.j2')}) }}"
                    % (ROLE / "templates"))},
                 "vars": each, "loop": ("{{ training_run_deployed_jobs | product(training_run_job_files) | list"
                                         " + [['recipe', 'dflash-job.service']] }}")},
                {"name": "recipe stages", "ansible.builtin.set_fact": {"rendered_files": (
                    "{{ rendered_files | combine({'recipe/stages.json': training_run_recipe_stages | to_json}) }}")}},
                {"name": "write them", "ansible.builtin.copy": {"content": "{{ rendered_files | to_json }}",
                                                                "dest": str(out / "rendered.json"), "mode": "0644"}},
            ],
        })
    (base / "play.yml").write_text(yaml.safe_dump(plays))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="False",
               ANSIBLE_INVENTORY_UNPARSED_WARNING="False", ANSIBLE_HOME=str(base / "ah"),
               ANSIBLE_LOCAL_TEMP=str(base / "at"))
    proc = subprocess.run([str(ANSIBLE_PLAYBOOK), str(base / "play.yml")], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    for name in variants:
        if (rendered := base / name / "rendered.json").is_file():
            for rel, text in json.loads(rendered.read_text()).items():
                (base / name / rel).parent.mkdir(parents=True, exist_ok=True)
                (base / name / rel).write_text(text)
    return proc


def render(tmp_path: Path, **overrides) -> subprocess.CompletedProcess:
    """One variant, into tmp_path/only."""
    return render_all(tmp_path, {"only": overrides})


VARIANTS = {
    "trainer": {"training_run_root": "/srv/d", "training_run_name": "qwen3-8b",
                    "training_run_target_path": "/srv/d/models/Qwen3-8B", "training_run_target_gpus": 5,
                    "training_run_drafter_gpus": 3, "training_run_data_train": ["/srv/d/data/a.jsonl", "org/ds"],
                    "training_run_settings": {"train": {"steps": 2000, "lr": 6e-4, "attention": "flex"},
                                           "drafter": {"block_size": 16, "mask_token_id": 151669},
                                           "eval": {"prompts": 8}},
                    "training_run_env": {"HF_HOME": "/srv/d/hf"}},
    "jobs": {"training_run_root": "/srv/d", "training_run_target_path": "/srv/d/models/Qwen3-8B",
                 "training_run_target_gpus": 5, "training_run_drafter_gpus": 3,
                 "training_run_regenerate_data": ["/srv/d/data/chats-*.jsonl", "org/ds"],
                 "training_run_regenerate_args": ["--max-new-tokens", "2048"],
                 "training_run_eval_prompts": ["/srv/d/data/mt-bench.jsonl"], "training_run_eval_args": ["--limit", "80"]},
    "cpu": {"training_run_target_path": "/m", "training_run_device": "cpu", "training_run_drafter_gpus": 2,
                "training_run_regenerate_data": ["/d.jsonl"]},
    "single": {"training_run_target_path": "embedded", "training_run_device": "cpu",
                   "training_run_python": "/usr/bin/python3"},
    # ExecStart must name an executable that exists here: this venv's dflash-run (root: filled in by the fixture)
    "systemd": {"training_run_target_path": "/m", "training_run_python": sys.executable, "training_run_name": "ci",
                    "training_run_regenerate_data": ["/d.jsonl"]},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("rendered")
    variants = {**VARIANTS, "systemd": {**VARIANTS["systemd"], "training_run_root": str(base / "systemd")}}
    proc = render_all(base, variants)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return base


def test_run_config_renders_for_the_trainer(rendered):
    from dflash_trainer.config import load_config

    tmp_path = rendered / "trainer"
    cfg = load_config(str(tmp_path / "run.toml"), [])
    assert cfg.output_dir == "/srv/d/runs/qwen3-8b"
    assert cfg.target.path == "/srv/d/models/Qwen3-8B"
    assert (cfg.parallel.target_ranks, cfg.parallel.drafter_ranks) == (5, 3)
    assert cfg.data.train == ["/srv/d/data/a.jsonl", "org/ds"] and cfg.data.eval == []
    assert cfg.train.compile_cache_dir == "/srv/d/compile-cache"
    assert (cfg.train.steps, cfg.train.lr, cfg.drafter.mask_token_id, cfg.eval.prompts) == (2000, 6e-4, 151669, 8)
    launch = json.loads((tmp_path / "train" / "launch.json").read_text())
    # T + D = 8 ranks: torchrun from the environment's bin, the trainer module, the rendered config
    assert launch["job"] == "train"
    assert launch["argv"][:4] == ["/opt/venv/bin/torchrun", "--standalone", "--nproc-per-node", "8"]
    assert launch["argv"][4:] == ["-m", "dflash_trainer.train", "--config", "/srv/d/runs/qwen3-8b/run.toml",
                                  "--output-dir", "/srv/d/runs/qwen3-8b"]
    assert launch["env"] == {"HF_HOME": "/srv/d/hf"} and launch["max_restarts"] == 3
    unit = (tmp_path / "train" / "dflash-job.service").read_text().splitlines()
    # systemd restarts the supervisor (the venv's dflash-run, which always resumes); SIGTERM goes to it alone
    for line in ("ExecStart=/opt/venv/bin/dflash-run run --run-dir /srv/d/runs/qwen3-8b --job train",
                 "Restart=on-failure", "KillMode=mixed", "SyslogIdentifier=dflash-train-qwen3-8b",
                 "RequiresMountsFor=/srv/d/runs/qwen3-8b", "StartLimitBurst=4", "TimeoutStopSec=930"):
        assert line in unit
    assert not any("PYTHONPATH" in line for line in unit)
    # no regeneration prompts: deploy leaves the regeneration out, and the chain with it
    assert (tmp_path / "eval" / "launch.json").is_file() and not (tmp_path / "regenerate").exists()
    assert "regenerate" not in (tmp_path / "recipe" / "stages.json").read_text()


def test_regenerate_and_eval_jobs_render(rendered):
    tmp_path = rendered / "jobs"
    regen = json.loads((tmp_path / "regenerate" / "launch.json").read_text())
    # one process per GPU of the run (5 + 3), the run's target answers, shards on the persistent storage
    assert regen["job"] == "regenerate" and regen["max_restarts"] == 3
    assert regen["argv"] == ["/opt/venv/bin/torchrun", "--standalone", "--nproc-per-node", "8",
                             "-m", "dflash_trainer.regenerate", "--target", "/srv/d/models/Qwen3-8B",
                             "--data", "/srv/d/data/chats-*.jsonl", "org/ds", "--out", "/srv/d/regen/default",
                             "--max-new-tokens", "2048"]
    ev = json.loads((tmp_path / "eval" / "launch.json").read_text())
    # one process on one GPU; a failure is not retried (the same inputs fail the same way)
    assert ev["job"] == "eval" and ev["max_restarts"] == 0
    assert ev["argv"] == ["/opt/venv/bin/python", "-m", "dflash_trainer.eval", "--run", "/srv/d/runs/default",
                          "--out", "/srv/d/runs/default/eval", "--device", "cuda",
                          "--prompts", "/srv/d/data/mt-bench.jsonl", "--limit", "80"]
    units = {job: (tmp_path / job / "dflash-job.service").read_text().splitlines() for job in ("regenerate", "eval")}
    assert "ExecStart=/opt/venv/bin/dflash-run run --run-dir /srv/d/regen/default --job regenerate" in units["regenerate"]
    assert "Restart=on-failure" in units["regenerate"] and "SyslogIdentifier=dflash-regenerate-default" in units["regenerate"]
    assert "Restart=no" in units["eval"] and not any(x.startswith("StartLimitBurst") for x in units["eval"])
    # the recipe chain: its stages are these jobs, in their directories; the run trains on regeneration's shards
    # without a path in the inventory (training_run_data_train's default); the chain's unit is not restarted by systemd
    assert sorted(json.loads((tmp_path / "recipe" / "stages.json").read_text())) == [
        "--job-dir=eval=/srv/d/runs/default/eval", "--job-dir=regenerate=/srv/d/regen/default",
        "--job-dir=train=/srv/d/runs/default"]
    assert 'train = ["/srv/d/regen/default/part-*.jsonl"]' in (tmp_path / "run.toml").read_text()
    chain = (tmp_path / "recipe" / "dflash-job.service").read_text().splitlines()
    assert "ExecStart=/opt/venv/bin/dflash-run run --run-dir /srv/d/recipe/default --job recipe" in chain
    assert "Restart=no" in chain and "KillMode=mixed" in chain and "SyslogIdentifier=dflash-recipe-default" in chain
    # the jobs' names, commands and directories the controller knows are the ones the role renders
    for job, launch in ((REGENERATE, regen), (EVAL, ev)):
        assert job.matches(launch["argv"]) and not TRAIN.matches(launch["argv"])
        assert procs.Proc(1, launch["argv"], "/", job).output_dir() == Path(
            {"regenerate": "/srv/d/regen/default", "eval": "/srv/d/runs/default/eval"}[job.name])


def test_cpu_jobs_are_single_processes(rendered):
    tmp_path = rendered / "cpu"
    regen = json.loads((tmp_path / "regenerate" / "launch.json").read_text())["argv"]
    assert regen[:3] == ["/opt/venv/bin/python", "-m", "dflash_trainer.regenerate"]
    assert json.loads((tmp_path / "eval" / "launch.json").read_text())["argv"][-2:] == ["--device", "cpu"]


def test_single_rank_run_is_one_process(rendered):
    from dflash_trainer.config import load_config

    tmp_path = rendered / "single"
    assert load_config(str(tmp_path / "run.toml"), []).target.path == "embedded"
    assert json.loads((tmp_path / "train" / "launch.json").read_text())["argv"][:3] == ["/usr/bin/python3", "-m",
                                                                                         "dflash_trainer.train"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is missing (Debian: systemd)")
def test_systemd_unit_passes_systemd_analyze(rendered):
    tmp_path = rendered / "systemd"  # ExecStart names this venv's dflash-run: an executable that exists here
    for job in ("train", "regenerate", "eval", "recipe"):
        unit = tmp_path / f"dflash-{job}-ci.service"
        shutil.copy(tmp_path / job / "dflash-job.service", unit)
        check = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60,
                               check=False)
        assert check.returncode == 0 and str(unit) not in check.stdout + check.stderr, check.stderr  # no complaint


# One ansible-playbook run per case (its start-up is most of the time): test-fast checks two rules, the slow
# tests every rule.
@pytest.mark.parametrize("bad, named", [
    ({"training_run_target_path": ""}, "training_run_target_path must be set"),
    pytest.param({"training_run_target_path": "x", "training_run_drafter_gpus": 0},
                 "training_run_drafter_gpus >= 1 (are 0, 0)", marks=pytest.mark.slow),
    pytest.param({"training_run_target_path": "x", "training_run_regenerate_gpus": 0},
                 "training_run_regenerate_gpus must be >= 1", marks=pytest.mark.slow),
    pytest.param({"training_run_target_path": "x", "training_run_target_gpus": -1},
                 "training_run_target_gpus must be >= 0", marks=pytest.mark.slow),
    ({"training_run_target_path": "x", "training_run_name": "../etc"}, "training_run_name must be letters"),
    pytest.param({"training_run_target_path": "x", "training_run_output_dir": "runs/a"}, "must be absolute paths",
                 marks=pytest.mark.slow),
    # deploy installs the shared trainer wheel with uv: both must be files on the controller, checked first
    pytest.param({"training_run_target_path": "x",
                  "training_venv_trainer_wheel": "/nonexistent/dflash_trainer-0.1.0-py3-none-any.whl",
                  "training_venv_uv": sys.executable},  # a file: only the wheel is wrong
                 "training_venv_trainer_wheel names /nonexistent/dflash_trainer-0.1.0-py3-none-any.whl, which is not a file",
                 marks=pytest.mark.slow),
    pytest.param({"training_run_target_path": "x", "training_venv_trainer_wheel": str(REPO / "pyproject.toml")},
                 "training_venv_uv must name a uv binary on the controller", marks=pytest.mark.slow),
])
def test_bad_variables_are_refused_before_rendering(tmp_path, bad, named):
    proc = render(tmp_path, **bad)
    assert proc.returncode != 0
    # Every rule is checked (one loop): only the broken one fails, and its message names the fix.
    failed = [json.loads(m) for m in re.findall(r"^failed: \[[^\]]+\] \(item=[^)]*\) => (\{.*\})$", proc.stdout, re.MULTILINE)]
    assert len(failed) == 1, [f["msg"] for f in failed]
    assert named in failed[0]["msg"] and "Fix it in the inventory" in failed[0]["msg"]
    assert not (tmp_path / "only" / "run.toml").exists()  # nothing rendered


# ---- preflight -----------------------------------------------------------------------------------------
# nvidia-smi --query-gpu=index,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits
IDLE = "0, 1, 143771, 0\n1, 1, 143771, 0\n"
BUSY = "0, 1, 143771, 0\n1, 80312, 143771, 97\n"
APPS = "48213, /usr/bin/python3, 80300\n"


def test_gpu_checks():
    assert preflight.check_gpus(IDLE, "", need=2, max_used_mib=500) == []
    busy = preflight.check_gpus(BUSY, APPS, need=2, max_used_mib=500)
    assert [p.check for p in busy] == ["gpus", "gpus"]
    assert "GPU 1 has 80312 MiB" in busy[0].detail and "48213" in busy[1].detail and "kill 48213" in busy[1].fix
    few = preflight.check_gpus(IDLE, "", need=8, max_used_mib=500)
    assert "needs 8 GPUs" in few[0].detail and "proxmox_gpu_devices" in few[0].fix
    assert preflight.query_gpus(0, 500) == []  # a CPU run needs no nvidia-smi


def test_disk_writable_and_persistent(tmp_path):
    assert preflight.check_disk(tmp_path, 0.001) == []
    (low,) = preflight.check_disk(tmp_path / "new" / "run", 10**9)
    assert low.check == "disk" and "GiB free" in low.detail
    blocker = tmp_path / "file"
    blocker.write_text("")
    (bad,) = preflight.check_writable(blocker / "cache", "compile cache directory")
    assert "not writable" in bad.detail and "compile cache directory" in bad.fix
    assert preflight.check_writable(tmp_path / "cache", "compile cache directory") == []
    mountinfo = ("22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
                 "40 22 8:1 /var/lib/vz/runs /srv/dflash rw,relatime - ext4 /dev/sda1 rw\n"
                 "41 22 0:5 / /srv/my\\040disk rw - ext4 /dev/sdb1 rw\n")
    (on_root,) = preflight.check_persistent(Path("/srv/runs/a"), mountinfo)  # /srv/runs is not /srv/dflash
    assert on_root.check == "storage" and "mpN" in on_root.fix
    assert preflight.check_persistent(Path("/srv/dflash/runs/a"), mountinfo) == []  # a bind mount counts
    assert preflight.check_persistent(Path("/srv/my disk/x"), mountinfo) == []
    assert preflight.check_persistent(Path("/proc/self"), None) == []  # this machine's real mountinfo

def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "run.toml"
    bad.write_text('[train]\nstepz = 3\n')
    (p,) = preflight.check_config(bad)
    assert "stepz" in p.detail and "training_run_" in p.fix


# ---- supervisor, status, stop (real processes) ------------------------------------------------------
# The child stands in for nothing: it is the workload the supervisor runs; the container test runs the
# real trainer under the same supervisor.
FLAKY = textwrap.dedent("""\
    import pathlib, sys, time
    run = pathlib.Path.cwd()
    n = len(list(run.glob("attempt-*")))
    (run / f"attempt-{n}").write_text(" ".join(sys.argv[1:]))
    (run / "config.json").write_text("{}")  # as the trainer writes it once it has loaded: a run to resume
    print(f"attempt {n} args {sys.argv[1:]}", flush=True)
    if n:  # the second attempt does all its work: its result, as the trainer and regeneration write it
        (run / "summary.json").write_text("{}")
    sys.exit(3 if n == 0 else 0)
    """)

SLOW_SAVE = textwrap.dedent("""\
    import pathlib, signal, sys, time
    run = pathlib.Path.cwd()
    tmp = run / "checkpoints" / ".tmp-step-00000002"
    tmp.mkdir(parents=True)
    def term(*_):
        (run / "term-at").write_text(repr(time.time()))
        sys.exit(143)
    signal.signal(signal.SIGTERM, term)
    print("saving", flush=True)
    time.sleep(2)
    (tmp / "training_state.json").write_bytes(b"")
    (run / "saved-at").write_text(repr(time.time()))
    tmp.rename(run / "checkpoints" / "step-00000002")
    time.sleep(60)
    """)


def launch(run_dir: Path, script: str, **extra) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "child.py").write_text(script)
    (run_dir / supervise.LAUNCH).write_text(json.dumps(
        {"argv": [sys.executable, str(run_dir / "child.py")], "restart_delay_s": 0, "max_restarts": 2, **extra}))


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_restart_after_failure_resumes(tmp_path):
    run = tmp_path / "run"
    launch(run, FLAKY)
    assert supervise.run(run, restart=True) == 0
    # the first start finds no run (the trainer's --resume would refuse it); the restart continues the run
    assert (run / "attempt-0").read_text() == "" and (run / "attempt-1").read_text() == "--resume"
    st = supervise.read_state(run)
    assert st["state"] == "finished" and st["restarts"] == 1
    log = (run / supervise.LOG).read_text()
    assert "attempt 0" in log and "restart 1/2" in log and "attempt 1" in log and "finished" in log


def test_gives_up_after_max_restarts(tmp_path):
    run = tmp_path / "run"
    launch(run, "import sys; print('boom', flush=True); sys.exit(5)", max_restarts=1)
    assert supervise.run(run, restart=True) == 5
    assert supervise.read_state(run)["state"] == "failed"
    assert (run / supervise.LOG).read_text().count("boom") == 2


def test_detached_supervisor_stops_after_the_checkpoint_in_progress(tmp_path):
    run = tmp_path / "run"
    launch(run, SLOW_SAVE)
    cli, env = CLI, dict(os.environ)
    assert subprocess.run([*cli, "start", "--run-dir", str(run)], env=env, timeout=30, check=False).returncode == 0
    assert wait_for(lambda: "saving" in (run / supervise.LOG).read_text())
    rep = status.report(run, None)
    assert rep["state"] == "running" and rep["supervisor"] == "process"
    again = subprocess.run([*cli, "start", "--run-dir", str(run)], env=env, capture_output=True, text=True,
                           check=False)
    assert again.returncode == 1 and "already running" in again.stdout
    stop = subprocess.run([*cli, "stop", "--run-dir", str(run), "--timeout", "30"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert stop.returncode == 0, stop.stderr
    # SIGTERM only reached the trainer once its checkpoint was complete
    assert float((run / "term-at").read_text()) >= float((run / "saved-at").read_text())
    rep = status.report(run, None)
    assert rep["state"] == "stopped" and rep["last_checkpoint"] == 2 and rep["pids"] == []
    assert "stopping after the checkpoint in progress" in "\n".join(rep["log_tail"])
    assert "checkpoint:  step 2" in status.format_report(rep)


TERM_THEN_SAVE = textwrap.dedent("""\
    import pathlib, signal, sys, time
    run = pathlib.Path.cwd()
    def term(*_):  # the graceful stop: the final checkpoint takes a while
        with open(run / "terms", "a") as f:
            f.write("TERM\\n")
        time.sleep(4)
        (run / "saved").write_text("step 7")
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    with open(run / "ready", "a") as f:  # this worker stops gracefully from here on
        f.write("ready\\n")
    print("training", flush=True)
    time.sleep(120)
    """)


@pytest.mark.slow  # a torchrun job with workers that import torch
def test_torchrun_job_stops_after_its_workers_final_save(tmp_path):
    """Under torchrun the stop signals the workers, not torchrun: torchrun would forward the signal and
    SIGKILL its workers after its shutdown timeout (30 s, hard-coded before torch 2.12; 1 s here), before
    a long final checkpoint is written, and each worker would see the signal twice."""
    run = tmp_path / "run"
    launch(run, TERM_THEN_SAVE)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    spec = json.loads((run / supervise.LAUNCH).read_text())
    spec["argv"] = [torchrun, "--standalone", "--nproc-per-node", "2", str(run / "child.py")]
    (run / supervise.LAUNCH).write_text(json.dumps(spec))
    env = dict(os.environ, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
    assert subprocess.run([*CLI, "start", "--run-dir", str(run)], env=env, timeout=30, check=False).returncode == 0
    assert wait_for(lambda: (run / supervise.LOG).read_text().count("training") == 2, timeout=60)
    stop = subprocess.run([*CLI, "stop", "--run-dir", str(run), "--timeout", "60"], env=env, capture_output=True,
                          text=True, timeout=90, check=False)
    assert stop.returncode == 0, stop.stderr
    assert (run / "saved").read_text() == "step 7"
    assert (run / "terms").read_text() == "TERM\n" * 2  # once per worker
    assert "stopped (trainer exit 0)" in (run / supervise.LOG).read_text()
    assert status.report(run, None)["pids"] == []


def test_a_killed_save_does_not_hold_up_the_stop(tmp_path):
    """A .tmp-step-* older than the trainer (a save that was SIGKILLed) is not a checkpoint in progress."""
    run = tmp_path / "run"
    stale = run / "checkpoints" / ".tmp-step-00000004-x1"
    stale.mkdir(parents=True)
    os.utime(stale, (time.time() - 60, time.time() - 60))
    launch(run, "import time; print('training', flush=True); time.sleep(120)")
    assert supervise.checkpoint_in_progress(run) and not supervise.checkpoint_in_progress(run, since=time.time())
    cli, env = CLI, dict(os.environ)
    assert subprocess.run([*cli, "start", "--run-dir", str(run)], env=env, timeout=30, check=False).returncode == 0
    assert wait_for(lambda: "training" in (run / supervise.LOG).read_text())
    t0 = time.monotonic()
    stop = subprocess.run([*cli, "stop", "--run-dir", str(run), "--timeout", "60"], env=env, capture_output=True,
                          text=True, timeout=90, check=False)
    assert stop.returncode == 0, stop.stderr
    assert time.monotonic() - t0 < 20  # not the whole timeout
    assert f"stopped (trainer exit -{signal.SIGTERM.value})" in (run / supervise.LOG).read_text()  # not SIGKILL
    fresh = run / "checkpoints" / ".tmp-step-00000008-x2"  # a save of a running trainer is waited for
    fresh.mkdir()
    assert supervise.checkpoint_in_progress(run, since=time.time() - 5)


def test_foreground_trainer_is_found_and_stopped(tmp_path):
    """A local `make train` (no supervisor): preflight sees it, train-stop ends it."""
    run = tmp_path / "run"
    # the command line of `python -m dflash_trainer.train --output-dir RUN`, without loading the trainer
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", "dflash_trainer.train",
                              "--output-dir", str(run)])
    try:
        # until the child has exec'd: before that, its /proc/<pid>/cmdline is still the parent's
        assert wait_for(lambda: procs.of_run(run, procs.job_processes()), timeout=10)
        mine = procs.of_run(run, procs.job_processes())
        assert [p.pid for p in mine] == [child.pid]
        (stale,) = preflight.check_stale(run, mine, "make train-stop")
        assert f"training process {child.pid} of this run" in stale.detail and f"kill {child.pid}" in stale.fix
        assert status.report(run, None)["state"] == "running (foreground, unsupervised)"
        assert supervise.stop(run, None, timeout_s=20) == 0
        assert child.wait(timeout=20) == -signal.SIGTERM
    finally:
        child.kill()


@pytest.mark.slow  # a torchrun job with workers that import torch
def test_foreground_torchrun_job_is_stopped_through_its_workers(tmp_path):
    """A local torchrun launch: train-stop signals the workers (each once), torchrun exits by itself after
    their final save, which outlasts torchrun's own shutdown timeout (1 s here)."""
    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(TERM_THEN_SAVE.replace("run = pathlib.Path.cwd()",
                                             "run = pathlib.Path(sys.argv[sys.argv.index('--output-dir') + 1])"))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    child = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", str(script), "-m",
                              "dflash_trainer.train", "--output-dir", str(run)], start_new_session=True,
                             env=dict(os.environ, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1"))
    try:
        assert wait_for(lambda: len(procs.of_run(run, procs.job_processes())) == 3, timeout=60)  # torchrun + 2
        assert wait_for(lambda: len(procs.torchrun_workers(child.pid)) == 2, timeout=30)
        # a worker signalled before its handler is installed dies of the signal (exit -15, torchrun exits 1)
        assert wait_for(lambda: (run / "ready").is_file() and (run / "ready").read_text().count("ready") == 2,
                        timeout=60)
        assert supervise.stop(run, None, timeout_s=60) == 0
        assert child.wait(timeout=30) == 0
        assert (run / "saved").read_text() == "step 7" and (run / "terms").read_text() == "TERM\n" * 2
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)


def test_local_make_targets_without_inventory(tmp_path):
    """No INVENTORY: train-status / train-logs / train-stop act on this machine's run ($(RUN_DIR))."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("INVENTORY", "MAKEFLAGS")}

    def make(*args):  # -o: never (re)install the venv these tests run in
        return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", *args, f"RUN_DIR={run}"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", "dflash_trainer.train",
                              "--output-dir", str(run)])
    try:
        st = make("train-status")
        assert st.returncode == 0 and "running (foreground, unsupervised)" in st.stdout and str(child.pid) in st.stdout
        logs = make("train-logs")
        assert logs.returncode != 0 and "printed to its terminal" in logs.stdout
        stop = make("train-stop")
        assert stop.returncode == 0 and "stopped 1 training process" in stop.stdout
        assert child.wait(timeout=20) == -signal.SIGTERM
        assert "state:       never started" in make("train-status").stdout
    finally:
        child.kill()


# ---- the run controller as a package: the standard library only, jobs told apart ---------------------
def test_controller_imports_with_the_standard_library_only():
    """The containers run it even when the trainer's dependencies fail to import: no site-packages at all."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import dflash_run.cli, dflash_run.preflight; "
            "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'__main__'}))")
    res = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(REPO / "dflash")], capture_output=True,
                         text=True, check=False, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['dflash_run']"


def test_jobs_are_told_apart_by_their_command_lines():
    torchrun = ["/opt/venv/bin/python", "/opt/venv/bin/torchrun", "--standalone", "--nproc-per-node", "8", "-m",
                "dflash_trainer.regenerate", "--target", "/m", "--out", "/srv/regen"]
    assert REGENERATE.matches(torchrun) and not TRAIN.matches(torchrun) and not EVAL.matches(torchrun)
    assert procs.Proc(7, torchrun, "/", REGENERATE).output_dir() == Path("/srv/regen")
    script = ["/opt/venv/bin/python", "/opt/venv/bin/dflash-eval", "--run", "r", "--out=r/eval"]
    assert EVAL.matches(script) and procs.Proc(7, script, "/srv", EVAL).output_dir() == Path("/srv/r/eval")
    # the controller itself (its unit's name), a shell mentioning the module, a checkout's path: none is a job
    for argv in (["/opt/venv/bin/dflash-run", "preflight", "--unit", "dflash-train-default"],
                 ["sh", "-c", "ps | grep dflash_trainer.train"], ["python", "/home/u/dflash-trainer/x.py"]):
        assert not any(j.matches(argv) for j in (TRAIN, REGENERATE, EVAL))
    # another job's directory (or module) as an argument does not make a process that job
    evaluation = ["/opt/venv/bin/python", "/opt/venv/bin/dflash-eval", "--run", "/srv/runs/dflash-train",
                  "--note", "dflash_trainer.train"]
    assert job_of(evaluation) is EVAL and not TRAIN.matches(evaluation)
    assert job_of(["/opt/venv/bin/dflash-train", "--config", "c.toml"]) is TRAIN
    assert job_of(["python3", "-u", "-m", "dflash_trainer.train", "--out", "/srv/dflash-eval"]) is TRAIN


def test_preflight_needs_the_jobs_launch(tmp_path):
    (missing,) = preflight.check_launch(tmp_path, REGENERATE)
    assert missing.check == "launch" and "regeneration was not deployed" in missing.detail
    assert "training_run_regenerate_data" in missing.fix
    (tmp_path / supervise.LAUNCH).write_text(json.dumps({"job": "train", "argv": ["x"]}))
    (other,) = preflight.check_launch(tmp_path, EVAL)
    assert "describes the train job, not eval" in other.detail and "directory of its own" in other.fix
    assert preflight.check_launch(tmp_path, TRAIN) == []
    with pytest.raises(SystemExit, match="describes the train job, not eval"):
        supervise.load_launch(tmp_path, EVAL)


def test_a_damaged_launch_is_a_clear_refusal_not_a_traceback(tmp_path):
    """The preflight and `dflash-run start` read launch.json the same way: each damage names itself."""
    for text, says in (("{bad", "is not JSON"), ("[1]", "holds a JSON list, not an object"),
                       ('{"job": ["train"]}', "names the job ['train'], which is none of"),
                       ('{"job": "train"}', "has no command line"),
                       ('{"job": "train", "argv": ["x"], "env": [1]}', "env is not an object")):
        (tmp_path / supervise.LAUNCH).write_text(text)
        (problem,) = preflight.check_launch(tmp_path, TRAIN)
        assert says in problem.detail and "make deploy again" in problem.fix, text
        res = subprocess.run([*CLI, "start", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                             check=False, timeout=60)
        assert res.returncode == 1 and says in res.stderr and "Traceback" not in res.stderr, (text, res.stderr)
    assert not (tmp_path / supervise.STATE).exists()  # refused before anything was recorded


def test_stale_processes_of_any_job_block_a_start(tmp_path):
    regen = procs.Proc(41, ["python", "-m", "dflash_trainer.regenerate", "--out", "/srv/regen"], "/", REGENERATE)
    (p,) = preflight.check_stale(tmp_path, [regen], "make {job}-stop INVENTORY=inv.yml")
    assert "regeneration process 41 of another job (/srv/regen) is still running" in p.detail
    assert p.fix.startswith("make regenerate-stop INVENTORY=inv.yml, or `kill 41`")


# A job that stops cleanly on SIGTERM: what it answered is kept, it exits 0, and writes no summary.json.
STOPS_CLEANLY = textwrap.dedent("""\
    import os, pathlib, signal, sys, time
    run = pathlib.Path.cwd()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    (run / "job-pid").write_text(str(os.getpid()))
    print("answering", flush=True)
    time.sleep(60)
    (run / "summary.json").write_text("{}")
    """)


@pytest.mark.parametrize("job", [REGENERATE, TRAIN])
def test_a_job_signalled_directly_is_stopped_not_finished(job, tmp_path):
    """`kill <pid of the job>` (not of dflash-run): the job stops cleanly with exit 0 and without its result;
    the supervisor records a stop that `make <job>` continues, not a finished job, and does not restart it.
    The result left by an earlier run does not count: a training run finished at step 2, resumed for more
    (checkpoint 4), then stopped; a regeneration's summary of an earlier, shorter pass."""
    run = tmp_path / job.name
    launch(run, STOPS_CLEANLY, job=job.name)
    (run / job.result).write_text(json.dumps({"steps": 2}))
    if job is TRAIN:
        (run / "checkpoints" / "step-00000004").mkdir(parents=True)

    def kill_the_job() -> None:
        if wait_for(lambda: (run / "job-pid").exists() and (run / "job-pid").read_text()):
            os.kill(int((run / "job-pid").read_text()), signal.SIGTERM)

    killer = threading.Thread(target=kill_the_job)
    killer.start()
    assert supervise.run(run, restart=True, job=job) == 0  # the supervisor installs signal handlers: main thread
    killer.join()
    st = supervise.read_state(run)
    assert st["state"] == "stopped" and st["rc"] == 0 and st["restarts"] == 0, st
    log = (run / job.log).read_text()
    assert f"exited 0 before it finished (no new {job.result}" in log and job.again in log, log
    assert "finished" not in log.replace("before it finished", "")


def test_a_job_a_signal_ends_during_its_start_up_is_stopped_not_restarted(tmp_path):
    """`kill <pid of the job>` before it can stop cleanly: it exits 143 (infra/stop_signal.py), and the supervisor
    records a stop, not a failure to restart."""
    run = tmp_path / "regenerate"
    launch(run, STOPS_CLEANLY.replace("sys.exit(0)", "sys.exit(143)"), job=REGENERATE.name)

    def kill_the_job() -> None:
        if wait_for(lambda: (run / "job-pid").exists() and (run / "job-pid").read_text()):
            os.kill(int((run / "job-pid").read_text()), signal.SIGTERM)

    killer = threading.Thread(target=kill_the_job)
    killer.start()
    assert supervise.run(run, restart=True, job=REGENERATE) == 0
    killer.join()
    st = supervise.read_state(run)
    assert st["state"] == "stopped" and st["rc"] == 143 and st["restarts"] == 0, st
    assert "ended by a signal sent to it, not to dflash-run (exit 143)" in (run / REGENERATE.log).read_text()


@pytest.mark.parametrize(("extra", "where"), [([], "."), (["--out", "elsewhere"], "elsewhere"),
                                              (["--out=other"], "other")])
def test_a_job_that_writes_its_result_is_finished_wherever_its_command_line_puts_it(extra, where, tmp_path):
    """The result is looked for where the command line sends it (the last --out, as argparse takes it), and a
    result whose time did not move but that was replaced counts: no clock is compared."""
    run = tmp_path / "eval"
    launch(run, textwrap.dedent(f"""\
        import os, pathlib
        out = pathlib.Path({where!r}); out.mkdir(exist_ok=True)
        (out / "eval.json.tmp").write_text("{{}}")
        os.utime(out / "eval.json.tmp", (0, 0))  # as old as can be: only its identity changed
        os.replace(out / "eval.json.tmp", out / "eval.json")
        """), job="eval")
    (run / where).mkdir(exist_ok=True)
    (run / where / "eval.json").write_text("{}")  # an earlier result of the same size and time
    os.utime(run / where / "eval.json", (0, 0))
    launch_file = run / supervise.LAUNCH
    deployed = json.loads(launch_file.read_text())
    launch_file.write_text(json.dumps({**deployed, "argv": [*deployed["argv"], *extra]}))
    assert supervise.run(run, restart=True, job=EVAL) == 0
    assert supervise.read_state(run)["state"] == "finished", (run / EVAL.log).read_text()


def test_a_finished_training_run_started_again_is_finished(tmp_path):
    """`make train` on a finished run: the trainer says so, changes nothing (its summary.json untouched) and exits
    0; the run is still finished, not stopped."""
    run = tmp_path / "train"
    launch(run, "print('holds a finished run: nothing to continue, nothing changed', flush=True)")
    (run / "summary.json").write_text(json.dumps({"steps": 6}))
    (run / "checkpoints" / "step-00000006").mkdir(parents=True)
    assert supervise.run(run, restart=True, job=TRAIN) == 0
    assert supervise.read_state(run)["state"] == "finished", (run / TRAIN.log).read_text()


def test_a_regeneration_job_is_supervised_without_resume_flags(tmp_path):
    """Regeneration resumes by itself when rerun: the supervisor adds nothing, restarts it, and logs it apart."""
    run = tmp_path / "regen"
    launch(run, FLAKY, job="regenerate")
    assert supervise.run(run, restart=True, job=REGENERATE) == 0
    assert (run / "attempt-0").read_text() == "" and (run / "attempt-1").read_text() == ""
    log = (run / REGENERATE.log).read_text()
    assert "regeneration failed (exit 3); restart 1/2 in 0 s\n" in log and not (run / TRAIN.log).exists()
    st = supervise.read_state(run)
    assert st["state"] == "finished" and st["job"] == "regenerate"


def test_status_reports_each_jobs_progress(tmp_path):
    regen = tmp_path / "regen"
    (regen / "logs").mkdir(parents=True)
    for i in range(3):
        (regen / f"part-{i:05d}.jsonl").write_text("{}\n")
    (regen / "summary.json").write_text(json.dumps({"prompts": 96, "answer_tokens": 4608,
                                                    "this_run": {"tokens_per_s": 812.5}}))
    text = status.format_report(status.report(regen, None, job=REGENERATE))
    assert f"job:         regenerate in {regen}" in text  # run directly (no supervisor): its summary says it ended
    assert "state:       finished (started directly, not by dflash-run)" in text, text
    assert f"shards:      3 (data.train takes {regen}/part-*.jsonl)" in text
    assert "summary:     96 prompts answered, 4608 answer tokens, 812.5 tok/s in the last run" in text
    ev = tmp_path / "eval"
    ev.mkdir()
    assert "result:      none yet" in status.format_report(status.report(ev, None, job=EVAL))
    (ev / "eval.json").write_text(json.dumps({"sets": {"held-out": {}}, "overall": {"prompts": 8, "tau": 2.4567,
                                                                                   "speedup": 1.81}}))
    assert (f"result:      tau 2.46, speedup 1.81x on 8 prompts (held-out): {ev}/eval.json, eval.png"
            in status.format_report(status.report(ev, None, job=EVAL)))


def test_status_of_a_directory_that_does_not_exist_says_so(tmp_path):
    text = status.format_report(status.report(tmp_path / "typo", None))
    assert "state:       never started (no such directory" in text
