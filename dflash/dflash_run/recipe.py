"""The recipe chain: regenerate -> train -> eval as one detached job, each stage started when the one before finished.

The chain's directory holds its plan (recipe.json: each stage's directory and command line, the output of one
wired into the next's input), its state (supervisor.json: the stage it is on; stages.json: how each stage
ended) and its log (logs/recipe.log). Each stage is a job of its own in a subdirectory (regen/, run/, eval/), run by that job's
supervisor as `dflash-run start` runs it (restarts after a fault, graceful stop), so `dflash-run status --job
train --run-dir DIR/run` works on it too. The embedded default first builds its tiny target (embedded/).

In a container the stages are the jobs `make deploy` described (deployed_plan): each one's launch.json, rendered
from the inventory, is its stage's command line, so the inventory's settings for each job are the chain's.

A second start continues: a stage that finished is not run again while its fingerprint (fingerprint(): its command
line, a deployed job's environment, the contents of the config file it reads, its data files: each one's size and
contents, or time above HASHED_UP_TO) is the one it finished with; one whose fingerprint changed runs again, and so
does every stage after it (each reads the output of the one before): a training that runs again trains anew from
step 0, its previous run moved aside to a directory beside it (afresh()), not resumed, which with train.steps as it
was would train nothing. The one that stopped or failed starts again (training resumes from its last checkpoint,
regeneration answers only the rest), a training afresh as a finished one when its fingerprint changed or a stage
before it runs again. A failed stage stops the chain with the stage's error line.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from importlib.util import find_spec
from pathlib import Path

from . import status, supervise
from .jobs import JOBS, RECIPE, TRAIN, holds_run, move_run_aside, replaced_dir
from .procs import alive, job_processes, of_run

PLAN = "recipe.json"
ENDED = "stages.json"  # how each stage ended (its state, exit code, when): what a second start skips
EMBEDDED = "embedded"  # --target embedded: the embedded default's tiny target, built by the chain's first stage
BUILD_TARGET = "target"  # that first stage's name (not a supervised job: it builds in seconds, cached)


def default_data() -> str:
    """The bundled chats the embedded default trains on (found without importing the trainer)."""
    spec = find_spec("dflash_trainer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no dflash_trainer here: give the chain its prompts with --data FILE")
    return str(Path(next(iter(spec.submodule_search_locations))) / "assets" / "tiny_chat.jsonl")


def launcher(python: str, nproc: int) -> list[str]:
    """How a stage's module starts: one process, or torchrun with one process per GPU."""
    return [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else [python]


def here(path: str) -> str:
    """A path that names something here, made absolute (the stages run in their own directories); anything else
    (a hub dataset's name, a bundled config's name) as given."""
    return os.path.abspath(path) if glob.glob(path) else path


def make_plan(chain_dir: Path, config: str, target: str, data: list[str], sets: list[str],
              stage_args: dict[str, list[str]], nproc: int = 1, python: str = sys.executable) -> dict:
    """Each stage's directory and command line. The outputs feed the next stage: regeneration's shards are the
    run's data.train, the run's directory (drafter, target, held-out prompts) is the evaluation's --run."""
    chain_dir, config, data = chain_dir.absolute(), here(config), [here(d) for d in data]
    target = target if target == EMBEDDED else here(target)
    regen, run, ev = chain_dir / "regen", chain_dir / "run", chain_dir / "eval"
    stages = []
    if target == EMBEDDED:
        built = chain_dir / EMBEDDED
        stages.append({"name": BUILD_TARGET, "dir": str(built), "argv": [
            python, "-m", "dflash_trainer.embedded", str(built), *stage_args.get(BUILD_TARGET, [])]})
        target = str(built / "target")
    # the tiny target's context is 512 tokens: answers as long as its build's own (regenerate's default is 2048)
    sized = ["--max-new-tokens", "48"] if stages else []
    stages.append({"name": "regenerate", "dir": str(regen), "argv": [
        *launcher(python, nproc), "-m", "dflash_trainer.regenerate", "--target", target, "--data", *data,
        "--out", str(regen), *sized, *stage_args.get("regenerate", [])]})
    train_sets = [f"target.path={target}", "data.train=" + json.dumps([str(regen / "part-*.jsonl")]), *sets]
    stages.append({"name": "train", "dir": str(run), "argv": [
        *launcher(python, nproc), "-m", "dflash_trainer.train", "--config", config, "--output-dir", str(run),
        *[a for s in train_sets for a in ("--set", s)], *stage_args.get("train", [])]})
    stages.append({"name": "eval", "dir": str(ev), "argv": [
        python, "-m", "dflash_trainer.eval", "--run", str(run), "--out", str(ev), *stage_args.get("eval", [])]})
    return {"job": RECIPE.name, "stages": stages, "max_restarts": 3, "restart_delay_s": 10}


def deployed_plan(job_dirs: dict[str, Path]) -> dict:
    """The chain of the jobs deployed in a container: each stage runs its job's own launch.json (command line,
    environment, restarts, stop timeout) in that job's directory, as `make train` would. The inventory wires
    them: regeneration's shards are the run's data.train, the evaluation's --run is the run's directory.
    SystemExit (naming the fix) when a job was not deployed."""
    stages = []
    for name in ("regenerate", "train", "eval"):
        if name in job_dirs:
            job_dir = job_dirs[name].absolute()
            launch = supervise.load_launch(job_dir, JOBS[name])
            stages.append({"name": name, "dir": str(job_dir), "argv": launch["argv"], "env": launch.get("env") or {},
                           "deployed": True})
    return {"job": RECIPE.name, "stages": stages}


class InputMissing(Exception):
    """A file a stage's command reads is not there (bad input, exit 2); the message names it and the fix."""

    def __init__(self, message: str, stage: str):
        super().__init__(message)
        self.stage = stage


def config_file(name: str) -> Path | None:
    """The file `--config NAME` reads, resolved by the trainer's own rule; None when there is none."""
    # torch-free: the supervisor's start stays light
    from dflash_trainer.config import ConfigError, config_path

    try:
        return config_path(name)
    except ConfigError:
        return None


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values a command line gives `flag`, in order: `FLAG V`, `FLAG=V`, and for a flag that takes several
    (regeneration's --data, the evaluation's --prompts), each value up to the next option."""
    values, taking = [], False
    for arg in argv:
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            taking = name == flag and not eq
            values += [value] if name == flag and eq else []
        elif taking:
            values.append(arg)
    return values


def training_data(argv: list[str]) -> list[str]:
    """A training's data.train and data.eval as it reads them: its --config (the trainer's default: embedded) with its
    --set, read by the trainer's own loader (torch-free). None from a config it refuses: the stage says why itself."""
    from dflash_trainer.config import ConfigError, load_config

    named = flag_values(argv, "--config")
    try:
        cfg = load_config(named[-1] if named else "embedded", flag_values(argv, "--set"), whole_run=False)
    except (ConfigError, OSError, ValueError):
        return []
    return [*cfg.data.train, *cfg.data.eval]


DATA_FLAGS = ("--data", "--prompts")  # regeneration's prompts, the evaluation's prompt sets


# A data file up to this size is known by its contents (SHA-256), so a touch, a copy or a checkout that rewrote the
# same bytes is no change; a larger one by its size and modification time (reading it at each plan costs too much).
HASHED_UP_TO = 256 * 2**20


def file_sha256(name: str) -> str:
    with open(name, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def data_files(stage: dict, contents: bool = True) -> dict[str, list]:
    """The size and modification time of each local file a stage reads its rows or prompts from (regeneration's
    --data, the evaluation's --prompts, a training's data.train and data.eval), and with contents its SHA-256 when
    it is no larger than HASHED_UP_TO (what a stage is recorded with; a comparison reads a file only where it must:
    same_data). Globs expanded and relative paths taken from the stage's directory, where it runs. Not hub datasets,
    nor a path that is not there (the stage refuses it itself), nor files a directory holds (--dump-features)."""
    argv, found = stage["argv"], {}
    sources = [v for flag in DATA_FLAGS for v in flag_values(argv, flag)]
    if TRAIN.matches(argv):
        sources += training_data(argv)
    for source in sources:
        path = Path(stage["dir"]) / source  # an absolute source stays itself
        for name in [str(path)] if path.is_file() else glob.glob(str(path)):
            with contextlib.suppress(OSError):  # removed meanwhile: not there, as a path that never was
                st = os.stat(name)
                if Path(name).is_file():
                    digest = [file_sha256(name)] if contents and st.st_size <= HASHED_UP_TO else []
                    found[os.path.abspath(name)] = [st.st_size, st.st_mtime_ns, *digest]
    return found


def same_data(name: str, then: list, now: list) -> bool:
    """A data file is as recorded (then: [size, time] or [size, time, SHA-256]; now: as data_files gives it): not when
    its size differs; when its time is the same (not read); otherwise when its contents are the recorded ones, read
    now, where both are known by their contents (no larger than HASHED_UP_TO). A record from before contents were
    recorded, or of a file above the bound, goes by the time."""
    if then[0] != now[0]:
        return False
    if then[1] == now[1]:
        return True
    if len(then) > 2 and now[0] <= HASHED_UP_TO:
        with contextlib.suppress(OSError):  # unreadable now: changed, as a file that went away
            return (now[2] if len(now) > 2 else file_sha256(name)) == then[2]
    return False


def data_changed(then: dict, now: dict) -> list[str]:
    """The data files added, removed or changed (same_data), sorted."""
    return sorted(p for p in {**then, **now} if p not in then or p not in now or not same_data(p, then[p], now[p]))


def fingerprint(stage: dict, contents: bool = True) -> dict:
    """What a stage is known by, recorded when it starts: its command line, its environment (a deployed job's
    launch.json: what `make deploy` rendered from the inventory), the SHA-256 of each config file its --config
    names (a deployed training's run.toml) and each data file it reads (data_files; contents: with their SHA-256,
    as recorded). A stage that finished is run again when this is no longer what it finished with. Not its restart
    policy (that does not change what it writes). InputMissing names a config that is not there."""
    argv, files = stage["argv"], {}
    for name in flag_values(argv, "--config"):
        path = config_file(name)
        if path is None:
            fix = ("make deploy INVENTORY=... writes it (the inventory's training settings), then make recipe again"
                   if stage.get("deployed") else "give --config a TOML file or a bundled config's name "
                   "(make recipe RECIPE_ARGS='--config ...')")
            raise InputMissing(f"the {stage['name']} stage reads the config {name}, which is not there: {fix}",
                               stage["name"])
        files[str(path.absolute())] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"argv": argv, "env": stage.get("env") or {}, "files": files, "data": data_files(stage, contents)}


UNRECORDED = "it finished before the chain recorded its config's contents"


def why_again(now: dict, record: dict | None, planned_argv: list[str] | None = None) -> str | None:
    """Why a stage that ended (record: how, in stages.json) runs again, now: its fingerprint(); None when it is
    skipped (finished) or resumed (stopped or failed). planned_argv: its command line in the plan before, all a
    finished record written before fingerprints can be compared by."""
    state = (record or {}).get("state")
    then = (record or {}).get("fingerprint")
    if state is None or (then is None and state != "finished"):  # not started; or resumed, as an earlier version did
        return None
    if then is None:  # an earlier version's record: its config's contents are unknown, so a stage that reads one reruns
        if (planned_argv or now["argv"]) != now["argv"]:
            return "its command line changed"
        return UNRECORDED if now["files"] else None
    if then.get("argv") != now["argv"]:
        return "its command line changed"
    if then.get("env", {}) != now["env"]:
        return "its environment changed"
    if changed := differ(then.get("files") or {}, now["files"]):
        return f"config changed since it {state}: {', '.join(changed)}"
    if "data" in then and (changed := data_changed(then["data"], now["data"])):  # not in an earlier version's record
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"data changed since it {state}: {', '.join(changed[:3])}{more}"
    return None


def differ(then: dict, now: dict) -> list[str]:
    """The files whose record differs (added, removed or changed), sorted."""
    return sorted(p for p in {**then, **now} if then.get(p) != now.get(p))


def reruns(plan: dict, ended: dict, before: dict[str, list[str]] | None = None) -> dict[str, str]:
    """The stages that run again, each with why: a finished one whose fingerprint changed, or before which a stage
    runs (its output is this one's input); a training that stopped or failed, likewise, instead of being resumed (on
    what changed under it). before: each stage's command line in the previous plan. InputMissing when a config a
    stage reads is not there (whether the stage finished or not: it would fail)."""
    now = {stage["name"]: fingerprint(stage, contents=False) for stage in plan.get("stages", [])}
    again, upstream = {}, None
    for stage in plan.get("stages", []):
        name, state = stage["name"], (ended.get(stage["name"]) or {}).get("state")
        why = None
        if state == "finished" or (name == TRAIN.name and state in ("stopped", "failed")):
            why = why_again(now[name], ended[name], (before or {}).get(name))
            why = why or (upstream and f"{upstream} runs again before it")
        if why:
            again[name] = why
        if why or state != "finished":
            upstream = upstream or name
    return again


def afresh(stage: dict, why: str) -> bool:
    """A stage that runs again (why; finished, stopped or failed) trains anew from step 0, its previous run moved to a
    directory beside it (jobs.replaced_dir): a training whose directory holds a run. Resumed, a finished run with
    train.steps as it was would train nothing new, a stopped one would go on from a checkpoint of what changed. Not a record from before fingerprints: whether its config changed is
    unknown, so it resumes as it did then (a run that did not change trains nothing again)."""
    return stage["name"] == TRAIN.name and why != UNRECORDED and holds_run(Path(stage["dir"]))


def said_again(why: str, kept: str | Path | None) -> str:
    """Why a stage runs again, and, for a training, that it starts afresh and where its previous run goes."""
    return f"{why}; starts afresh from step 0, the previous run is kept as {kept}" if kept else why


def mark_reruns(plan: dict, ended: dict, again: dict[str, str]) -> dict[str, str]:
    """The stages that run again (again: each with why) as the plan and stages.json record them until they
    have run: their records go, each planned stage keeps why (`again`) and, for a training that starts afresh, where
    its previous run goes (`afresh`). Returns what to say of each."""
    said = {}
    for stage in plan["stages"]:
        name = stage["name"]
        if name in again:
            ended.pop(name)
            stage["again"] = again[name]
            stage.pop("afresh", None)
            if afresh(stage, again[name]):
                stage["afresh"] = str(replaced_dir(Path(stage["dir"])))
            said[name] = said_again(again[name], stage.get("afresh"))
    return said


def read_plan(chain_dir: Path) -> dict | None:
    return status.read_json(chain_dir / PLAN)


def write_plan(chain_dir: Path, plan: dict) -> None:
    tmp = chain_dir / (PLAN + ".tmp")
    tmp.write_text(json.dumps(plan, indent=1))
    tmp.replace(chain_dir / PLAN)


def save_plan(chain_dir: Path, plan: dict) -> dict[str, str]:
    """Write the plan; a stage whose fingerprint changed (and every stage after it) runs again (reruns, mark_reruns):
    its record in stages.json goes, the plan keeps why for the status until it has run. Returns those stages, each
    with what to say of it. InputMissing (nothing written) when a config a stage reads is not there."""
    previous = read_plan(chain_dir) or {}
    before = {s["name"]: s["argv"] for s in previous.get("stages", [])}
    kept = {s["name"]: s for s in previous.get("stages", []) if s.get("again")}
    ended = read_ended(chain_dir)
    said = mark_reruns(plan, ended, reruns(plan, ended, before))
    for stage in plan["stages"]:  # planned to run again before, not started since: still so, as decided then
        if stage["name"] not in said and stage["name"] not in ended and stage["name"] in kept:
            earlier = kept[stage["name"]]
            stage["again"] = earlier["again"]
            if earlier.get("afresh") and earlier["dir"] == stage["dir"]:  # beside the directory it was decided for
                stage["afresh"] = earlier["afresh"]
    chain_dir.mkdir(parents=True, exist_ok=True)
    write_ended(chain_dir, ended)
    write_plan(chain_dir, plan)
    return said


def plan_summary(chain_dir: Path) -> str:
    """What a start of the planned chain runs: each stage, and whether it finished before (then it is skipped) or
    runs again (and why)."""
    ended = read_ended(chain_dir)
    return f"recipe chain in {chain_dir}: " + ", ".join(
        f"{s['name']} " + ("finished before (not run again)" if ended.get(s["name"], {}).get("state") == "finished"
                           else f"to run again ({said_again(s['again'], s.get('afresh'))})" if s.get("again")
                           else "to run")
        for s in (read_plan(chain_dir) or {}).get("stages", []))


def read_ended(chain_dir: Path) -> dict:
    return status.read_json(chain_dir / ENDED) or {}


def write_ended(chain_dir: Path, ended: dict) -> None:
    tmp = chain_dir / (ENDED + ".tmp")
    tmp.write_text(json.dumps(ended, indent=1))
    tmp.replace(chain_dir / ENDED)


def stray_processes(chain_dir: Path) -> list[str]:
    """Stage processes still running with no chain over them (its process was killed, SIGKILL or a reboot of a
    container that kept running them): a second start must not run the stage beside them."""
    procs = job_processes()
    return [f"{p.job.what} process {p.pid} still writes to {s['dir']}: stop it (make recipe-stop, or dflash-run stop "
            f"--job recipe --run-dir {chain_dir}), then start the chain again"
            for s in (read_plan(chain_dir) or {}).get("stages", []) if s["name"] in JOBS
            for p in of_run(s["dir"], procs, JOBS[s["name"]])]


def stop(chain_dir: Path, unit: str | None, timeout_s: float) -> int:
    """The chain's graceful stop. A chain whose process is gone (SIGKILL, out of memory) may have left its stage's
    process running: that one gets the same graceful stop, through its stage's directory."""
    chain_dir = chain_dir.absolute()
    st = supervise.read_state(chain_dir)
    chain_alive = st.get("state") in ("running", "starting") and alive(int(st.get("pid") or 0))
    strays = [] if chain_alive else [
        s for s in (read_plan(chain_dir) or {}).get("stages", [])
        if s["name"] in JOBS and of_run(s["dir"], job_processes(), JOBS[s["name"]])]
    if not strays:
        return supervise.stop(chain_dir, unit, timeout_s, RECIPE)
    print(f"the recipe chain's process is gone; its {', '.join(s['name'] for s in strays)} stage still ran:")
    return max(supervise.stop(Path(s["dir"]), None, timeout_s, JOBS[s["name"]]) for s in strays)


class Chain:
    def __init__(self, chain_dir: Path):
        self.dir = chain_dir.absolute()
        plan = read_plan(self.dir)
        if not plan or not isinstance(plan.get("stages"), list):
            raise SystemExit(f"no recipe plan in {self.dir / PLAN}: start the chain with `dflash-run recipe` "
                             "(make recipe)")
        self.plan = plan
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None
        self.log = self.dir / RECIPE.log
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.ended = read_ended(self.dir)

    def note(self, line: str) -> None:
        with open(self.log, "a") as log:
            log.write(f"[dflash_run {supervise.now()}] {line}\n")

    def on_signal(self, signum, _frame) -> None:
        self.stopping.set()
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()

    def state(self, state: str, **extra) -> None:
        supervise.write_state(self.dir, state=state, job=RECIPE.name, pid=os.getpid(),
                              log=str(self.log), supervisor="process", **extra)

    def loop(self) -> int:
        try:  # a config changed since the plan was written (a start without `make recipe`) counts too
            again = reruns(self.plan, self.ended)
        except InputMissing as exc:
            self.note(str(exc))
            self.state("failed", stage=exc.stage, rc=2, error=str(exc))
            return 2
        mark_reruns(self.plan, self.ended, again)  # as save_plan does: the status shows them as to run again
        write_ended(self.dir, self.ended)
        write_plan(self.dir, self.plan)
        for stage in self.plan["stages"]:
            name = stage["name"]
            if self.ended.get(name, {}).get("state") == "finished":
                self.note(f"stage {name}: finished before, not run again")
                continue
            if self.stopping.is_set():
                return self.stopped(name)
            self.state("running", stage=name)
            self.note(f"stage {name}: start in {stage['dir']}" + (f" (again: {again[name]})" if name in again else ""))
            try:
                ran_with = fingerprint(stage)
            except InputMissing as exc:
                self.note(str(exc))
                self.ended[name] = {"state": "failed", "rc": 2, "at": supervise.now()}
                write_ended(self.dir, self.ended)
                self.state("failed", stage=name, rc=2, error=str(exc))
                return 2
            if stage.get("afresh") and (problem := self.keep_previous_run(stage)):
                self.note(problem)
                self.state("failed", stage=name, rc=1, error=problem)
                return 1
            rc, outcome = self.run_stage(stage)
            self.ended[name] = {"state": outcome, "rc": rc, "at": supervise.now(), "fingerprint": ran_with}
            write_ended(self.dir, self.ended)
            if outcome == "stopped" or self.stopping.is_set():
                return self.stopped(name)
            if outcome != "finished":
                error = error_line(stage, self.log)
                self.note(f"stage {name} failed (exit {rc}): {error}")
                self.state("failed", stage=name, rc=rc, error=error)
                return rc or 1
            self.note(f"stage {name}: finished")
        self.note("finished: every stage has run")
        self.state("finished", stage=None, rc=0)
        return 0

    def keep_previous_run(self, stage: dict) -> str | None:
        """A training that runs again starts afresh: the run its directory holds moves to stage["afresh"] (once: the
        plan forgets it then, so a start after a stop or a failure resumes the new run while nothing changed). None, or what went wrong."""
        run_dir, kept = Path(stage["dir"]), Path(stage["afresh"])
        if holds_run(run_dir):
            kept = replaced_dir(run_dir) if kept.exists() else kept  # made meanwhile: never mixed into another one
            try:
                moved = move_run_aside(run_dir, kept)
            except OSError as exc:
                return (f"stage {stage['name']}: its previous run in {run_dir} cannot be moved to {kept} "
                        f"({exc.strerror or exc}; nothing was moved): move it aside yourself (or remove it), then "
                        "make recipe again")
            self.note(f"stage {stage['name']}: trains afresh from step 0; the previous run ({', '.join(moved)}) is "
                      f"kept in {kept}")
        del stage["afresh"]
        write_plan(self.dir, self.plan)
        return None

    def stopped(self, name: str) -> int:
        self.note(f"stopped at stage {name}; {RECIPE.again}")
        self.state("stopped", stage=name, rc=0)
        return 0

    def run_stage(self, stage: dict) -> tuple[int, str]:
        """Run one stage to its end: (exit code, finished / stopped / failed)."""
        stage_dir = Path(stage["dir"])
        stage_dir.mkdir(parents=True, exist_ok=True)
        if stage["name"] == BUILD_TARGET:
            with open(self.log, "a") as log:
                self.child = subprocess.Popen(stage["argv"], stdout=log, stderr=subprocess.STDOUT)
                rc = self.child.wait()
            return rc, "stopped" if self.stopping.is_set() else "finished" if rc == 0 else "failed"
        if not stage.get("deployed"):  # a deployed job's launch.json is make deploy's: used as it is
            launch = {"job": stage["name"], "argv": stage["argv"], "max_restarts": self.plan.get("max_restarts", 3),
                      "restart_delay_s": self.plan.get("restart_delay_s", 10), "supervisor": "process"}
            (stage_dir / supervise.LAUNCH).write_text(json.dumps(launch, indent=1))
        sup = supervise.Supervisor(stage_dir, restart=True, job=JOBS[stage["name"]])
        try:
            rc = sup.loop()  # it takes SIGTERM / SIGINT over while it runs: a stop is its graceful stop
        finally:
            self.handle_signals()
        return rc, supervise.read_state(stage_dir).get("state", "failed")

    def handle_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)


def run_chain(chain_dir: Path) -> int:
    chain = Chain(chain_dir)
    chain.handle_signals()
    return chain.loop()


def error_line(stage: dict, chain_log: Path) -> str:
    """The stage's last line that is not the supervisor's own: the job's error, which names the fix (the target's
    build writes into the chain's log)."""
    log = Path(stage["dir"]) / JOBS[stage["name"]].log if stage["name"] in JOBS else chain_log
    lines = status.tail(log, 200)
    said = [x.strip() for x in lines if x.strip() and not x.startswith("[dflash_run ")]
    return said[-1] if said else f"no output (see {log})"


def next_reruns(plan: dict, ended: dict) -> tuple[dict[str, str], dict[str, str]]:
    """For the status: the stages the next start runs again (reruns), each with what to say of it, and the stage
    that cannot start (a config it reads is not there) with why."""
    try:
        again = reruns(plan, ended)
    except InputMissing as exc:
        return {}, {exc.stage: str(exc)}
    for s in plan.get("stages", []):  # where the previous run goes is decided at that start: said as a pattern
        if s["name"] in again and afresh(s, again[s["name"]]):
            again[s["name"]] = said_again(again[s["name"]], f"{Path(s['dir']).absolute()}.replaced-<UTC time then>")
    return again, {}


def report(chain_dir: Path, log_lines: int = 5) -> dict:
    """The chain's state, the stage it is on (or stopped or failed at), that stage's last progress line."""
    chain_dir = chain_dir.absolute()
    plan = read_plan(chain_dir)
    st = supervise.read_state(chain_dir)
    state = st.get("state", "never started")
    if plan is None:
        state = NO_CHAIN if not chain_dir.is_dir() else "never started (no recipe.json here: make recipe plans it)"
    elif state in ("running", "starting") and not alive(int(st.get("pid") or 0)):
        state = "dead"  # the chain's process went away without recording why (a reboot, SIGKILL)
    stages = [s["name"] for s in (plan or {}).get("stages", [])]
    ended = read_ended(chain_dir)
    current = st.get("stage")
    stage = next((s for s in (plan or {}).get("stages", []) if s["name"] == current), None)
    job = JOBS.get(current or "")
    latest = status.last_progress(Path(stage["dir"]) / job.log) if stage and job else None
    log = Path(st.get("log") or chain_dir / RECIPE.log)
    again, missing = next_reruns(plan or {}, ended)
    planned_again = {s["name"]: said_again(s["again"], s.get("afresh"))
                     for s in (plan or {}).get("stages", []) if s.get("again")}

    def said(n: str) -> str:
        if n == current and state == "running":
            return "running"
        if n in missing:
            return f"{ended.get(n, {}).get('state', 'not started')}, cannot start: {missing[n]}"
        if n in again:
            return f"{ended.get(n, {}).get('state', 'not started')}, runs again at the next start ({again[n]})"
        if n not in ended and n in planned_again:
            return f"to run again ({planned_again[n]})"
        return (ended.get(n) or {}).get("state", "not started")
    return {"job": RECIPE.name, "run_dir": str(chain_dir), "state": state, "stage": current, "rc": st.get("rc"),
            "stages": {n: said(n) for n in stages},
            "stage_dir": stage and stage["dir"], "last_progress": latest, "error": st.get("error"),
            "result": result(plan) if state == "finished" else None,
            "left_running": stray_processes(chain_dir) if state == "dead" else [],
            "log": str(log), "log_tail": status.tail(log, log_lines)}


def format_report(r: dict) -> str:
    state = r["state"]
    if r["stage"] and state in ("running", "stopped", "failed", "dead"):
        state += f" at stage {r['stage']}" + (f" (exit {r['rc']})" if state == "failed" else "")
    lines = [f"job:         recipe chain in {r['run_dir']}", f"state:       {state}",
             "stages:      " + (", ".join(f"{n} {s}" for n, s in r["stages"].items()) or "none planned")]
    if r["stage_dir"] and r["stage"] in JOBS:
        lines.append(f"stage:       dflash-run status --job {r['stage']} --run-dir {r['stage_dir']}")
    if r["last_progress"]:
        lines.append(f"progress:    {r['last_progress']}")
    if r["state"] == "failed":
        lines += [f"error:       {r['error']}",
                  f"fix:         what the error names, then make recipe continues from {r['stage']}"]
    elif r.get("result"):
        lines.append(f"result:      {r['result']}")
    elif r.get("left_running"):
        lines += [f"left running: {line}" for line in r["left_running"]]
    elif r["state"] in ("stopped", "dead"):
        lines.append(f"next:        {RECIPE.again}")
    lines.append(f"log:         {r['log']}")
    if r["log_tail"]:
        lines += ["last log lines:"] + ["  " + x for x in r["log_tail"]]
    return "\n".join(lines)


def result(plan: dict) -> str | None:
    """The evaluation's numbers and where the drafter is, once the chain finished."""
    dirs = {s["name"]: Path(s["dir"]) for s in plan.get("stages", [])}
    if "eval" not in dirs or "train" not in dirs:
        return None
    overall = (status.read_json(dirs["eval"] / "eval.json") or {}).get("overall") or {}
    tau, speedup = overall.get("tau"), overall.get("speedup")
    return (f"tau {tau:.2f}" if isinstance(tau, (int, float)) else "tau n/a") + \
        (f", speedup {speedup:.2f}x" if isinstance(speedup, (int, float)) else "") + \
        f" ({dirs['eval'] / 'eval.json'}); drafter {dirs['train'] / 'drafter'}"


NO_CHAIN = "never started (no such directory: make recipe creates it, or check the path)"


def exit_code(r: dict) -> int:
    """2 for a chain directory that does not exist (a mistyped path is bad input), else 0."""
    return 2 if r["state"] == NO_CHAIN else 0
