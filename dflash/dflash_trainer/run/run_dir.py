"""The run directory: may this start use it, what it resumes from, what it cleans, and the moment the
run takes it over.

    prepare       before anything loads (every rank, reads only): a new run never lands on an earlier
                  one; --resume refuses a different target; damaged checkpoints are found;
                  --auto-resume picks --resume, a new run, or nothing (the run finished); --resume
                  of a finished run with nothing left to train changes nothing
    check_model   once the target's config is known (every rank, reads only): --resume refuses a
                  config that builds a different drafter than the checkpoint holds
    clean         rank 0: leftovers of killed saves and prunes, `latest` copied as a directory
    commit        the lead drafter, after everything loaded: --overwrite removes the earlier run's
                  outputs, and the run's config.json is written (never by a start that fails)

Paths the run stores are absolute, or relative to the run directory when they are inside it, so a
run resumes from any working directory, and after the run directory was moved.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# RUN_OUTPUTS: what a run writes, and --overwrite removes (the recipe chain moves them aside to train anew)
from dflash_run.jobs import RUN_OUTPUTS, TRAIN, other_job_problem

from ..config import RunConfig, path_keys
from ..infra import storage
from . import checkpoint as ckpt

RUN_CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
PROGRESS = "progress.txt"  # the latest progress line, for `dflash-run status` of a run with no log file
# The drafter's published config -> the setting that decides it.
DRAFTER_SHAPE = {
    "num_hidden_layers": "drafter.num_layers",
    "block_size": "drafter.block_size",
    "dflash_config.target_layer_ids": "drafter.target_layer_ids",
    "dflash_config.mask_token_id": "drafter.mask_token_id",
    "intermediate_size": "drafter.intermediate_size",
    "hidden_size": "target.path (the target's shape)",
    "num_attention_heads": "target.path (the target's shape)",
    "num_key_value_heads": "target.path (the target's shape)",
    "head_dim": "target.path (the target's shape)",
    "vocab_size": "target.path (the target's shape)",
    "num_target_layers": "target.path (the target's shape)",
}
# The settings that decide the drafter's shape.
DRAFTER_SETTINGS = sorted({setting for setting in DRAFTER_SHAPE.values() if setting.startswith("drafter.")})
# Settings a resumed run must keep that the drafter's config does not show.
KEPT_ON_RESUME = {
    "target.path": "the drafter learns this target's features",
    "parallel.drafter_sharding": "the checkpoint's optimizer state is in this layout",
}
# Changes that resume fine but continue on other data than an uninterrupted run would.
DATA_ORDER = ("train.micro_batch", "train.grad_accum", "train.seed", "parallel.drafter_ranks", "data.train",
              "data.context_buckets", "data.max_length")
_AGAIN = ("set these back, start a new run with another --output-dir, or replace this run with --overwrite")


class RunDirError(ValueError):
    """The run directory does not allow this start; says why and what to do."""


@dataclass
class RunStart:
    out: Path
    resume: bool
    overwrite: bool
    found: ckpt.Inspection
    recorded: dict | None = None  # --resume: the settings the run recorded (config.json), if readable
    notes: list[str] = field(default_factory=list)  # printed by rank 0 once the start is accepted
    finished: bool = False  # --auto-resume or --resume found a finished run: this start trains nothing

    @property
    def resume_from(self) -> Path | None:
        """The checkpoint to resume from as prepare found it (check_model reads it before clean runs)."""
        return self.found.resume_from if self.resume else None

    @property
    def resume_point(self) -> tuple[int, Path | None]:
        """The step this start begins at and the checkpoint holding it, where clean leaves it: prepare's
        verdict on the checkpoints, for every rank once rank 0 has cleaned (nothing verified again)."""
        if self.resume_from is None:
            return 0, None
        return self.found.resume_step, self.found.resume_dir


# ---- paths as the run stores them --------------------------------------------------------------

def _stored_path(value: str, out: Path, local_only: bool) -> str:
    """Absolute, or relative to the run dir when inside it; hub names as they are (~ is expanded on loading)."""
    path = Path(value)
    if not (local_only or path.exists()):
        return value
    path = path.absolute()
    try:
        return str(path.relative_to(out.absolute()))
    except ValueError:
        return str(path)


def _stored_value(key: str, value, out: Path):
    if value is None or value == "":
        return value
    if key == "output_dir":
        return str(Path(value).absolute())
    local_only = key not in ("target.path", "data.train", "data.eval")
    if isinstance(value, list):
        return [_stored_path(v, out, local_only) for v in value]
    return _stored_path(value, out, local_only)


def _flat(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def stored_config(cfg: RunConfig) -> dict:
    """cfg.to_dict() with every path as the run stores it."""
    out = Path(cfg.output_dir)
    values = cfg.to_dict()
    for key in path_keys():
        section, _, name = key.rpartition(".")
        node = values[section] if section else values
        node[name] = _stored_value(key, node[name], out)
    return values


def _canonical(value, *bases: Path):
    """A stored or given path as one absolute form, for comparing two configs: the first base it exists
    under (a config.json written before paths were stored run-relative holds them cwd-relative)."""
    if isinstance(value, list):
        return [_canonical(v, *bases) for v in value]
    if not isinstance(value, str) or not value:
        return value
    path = Path(value)
    for base in bases:
        candidate = path if path.is_absolute() else base / path
        if candidate.exists():
            return str(candidate.resolve())
    return value


def resolve_stored(value, out: Path):
    """A path (or list of paths) a run's config.json holds, as it resolves now from any directory: relative to
    the run directory, or, in a config written before paths were stored that way, to the current directory."""
    return _canonical(value, Path(out).absolute(), Path.cwd())


# ---- prepare: before anything loads ------------------------------------------------------------

# What makes a directory hold a run (besides step directories under checkpoints/): --resume needs one of them.
RUN_MARKS = (RUN_CONFIG, "summary.json", "drafter/", f"{CHECKPOINTS}/step-*")


def _held(out: Path, found: ckpt.Inspection) -> list[str]:
    held = [name for name in (RUN_CONFIG, "summary.json", "drafter") if (out / name).exists()]
    return held + ([f"{CHECKPOINTS}/"] if found.anything else [])


def _recorded(out: Path) -> dict | None:
    """The run's recorded settings; None when config.json is missing, unreadable or not a JSON object."""
    try:
        value = json.loads((out / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _kept_settings(cfg: RunConfig, recorded: dict, out: Path) -> list[str]:
    """KEPT_ON_RESUME settings that differ from the recorded run (the embedded target lives in the run)."""
    given, before = _flat(cfg.to_dict()), _flat(recorded)
    if given.get("target.path") == "embedded":
        given["target.path"] = str(out / "embedded" / "target")
    problems = []
    for key, why in KEPT_ON_RESUME.items():
        old, new = _canonical(before.get(key), out, Path.cwd()), _canonical(given.get(key), Path.cwd())
        if key in before and old != new:
            problems.append(f"{key}: {before[key]} -> {given[key]} ({why})")
    return problems


def _resume_notes(out: Path, found: ckpt.Inspection) -> list[str]:
    root = found.root
    if found.resume_from is None:
        if found.damaged:
            damaged = "; ".join(f"{path.name}: {problem}" for path, problem in found.damaged)
            raise RunDirError(f"--resume: no intact checkpoint under {root} ({damaged}). Restore the "
                              "checkpoints from a backup, or start over with --overwrite (or another --output-dir)")
        if finished := [name for name in ("drafter", "summary.json") if (out / name).exists()]:
            raise RunDirError(f"--resume: the run in {out} finished ({', '.join(finished)}) and kept no checkpoint "
                              "to continue from (train.checkpoint_every = 0?); train it again with --overwrite, "
                              "or start a new run with another --output-dir")
        return [f"--resume: no checkpoint under {root}; starting from step 0"]
    newer = [(p, problem) for p, problem in found.damaged
             if ckpt.step_of(p) > found.resume_step]
    return [f"checkpoint {p} is damaged ({problem}); resuming from the newest intact one, "
            f"{found.resume_from.name}" for p, problem in newer]


def _check_flags(out: Path, resume: bool, overwrite: bool, auto_resume: bool) -> None:
    if auto_resume and (resume or overwrite):
        flags = [flag for flag, on in (("--resume", resume), ("--overwrite", overwrite)) if on]
        raise RunDirError(f"--auto-resume decides by itself whether to continue the run in {out}, so "
                          f"{' and '.join(flags)} cannot go with it: give --auto-resume alone, or "
                          f"{' or '.join(flags)} without it")
    if resume and overwrite:
        raise RunDirError(f"--resume continues the run in {out} and --overwrite replaces it: give one of them")


DAMAGED = "damaged"


def recorded_summary(out: Path) -> dict | str | None:
    """summary.json of the run in out: its contents, None when there is none, DAMAGED when it does not read
    as a summary (cut short, not JSON, not an object with an integer `steps`)."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return DAMAGED
    return summary if isinstance(summary, dict) and isinstance(summary.get("steps"), int) else DAMAGED


def _finished(out: Path, found: ckpt.Inspection) -> bool:
    """The run in out wrote its summary, and no later start continued it past the steps the summary has (a
    finished run resumed for more steps, then stopped, is unfinished). A damaged summary counts as written."""
    summary = recorded_summary(out)
    if summary is None:
        return False
    return summary == DAMAGED or found.resume_step is None or found.resume_step <= summary["steps"]


def _finished_note(out: Path, detail: str = "") -> str:
    """What a start that finds a finished run (and changes nothing) says."""
    if recorded_summary(out) == DAMAGED:
        detail += (f"its {out / 'summary.json'} is damaged (not a readable summary: restore it, or remove it to "
                   "have it written again); ")
    return (f"{out} holds a finished run ({detail}drafter: {out / 'drafter'}, figures: {out / 'summary.json'}): "
            "nothing to continue, nothing changed.\nTrain it further with --resume and a larger train.steps, "
            "again with --overwrite (make train TRAIN_ARGS=--overwrite), or in another --output-dir (RUN_DIR=...)")


def _damage_note(found: ckpt.Inspection) -> str:
    """What --auto-resume says of damaged checkpoints newer than the one it continues from ("" when none)."""
    newer = [(p, problem) for p, problem in found.damaged
             if found.resume_step is None or (ckpt.step_of(p) or 0) > found.resume_step]
    if not newer:
        return ""
    damaged = "; ".join(f"{p.name} is damaged ({problem})" for p, problem in newer)
    older = f"continuing from the newest intact one, {found.resume_from.name}" if found.resume_from else \
        "no intact checkpoint is left"
    return f" ({damaged}: {older})"


def _auto_resume(out: Path, found: ckpt.Inspection, held: list[str]) -> tuple[str, str | None]:
    """--auto-resume: "finished", "resume" or "new", and what to say about it."""
    damage = _damage_note(found)
    if _finished(out, found):
        if (out / "drafter").exists():
            return "finished", _finished_note(out) + damage
        if found.resume_from is not None:  # as --resume decides: the last checkpoint publishes the drafter again
            return "resume", (f"{out} holds a finished run whose drafter/ is missing: continuing it (--resume) "
                              f"to publish the drafter again{damage}")
        return "finished", _finished_note(out, "its drafter/ is missing and no checkpoint is left to publish it "
                                               "from; ") + damage
    if held:
        return "resume", f"{out} holds an unfinished run: continuing it (--resume){damage}"
    return "new", None


def _auto_choice(cfg: RunConfig, out: Path, found: ckpt.Inspection, held: list[str],
                 say: Callable[[str], None]) -> bool | None:
    """--auto-resume: True to resume, False for a new run, None for a finished run (said, nothing to do)."""
    action, chosen = _auto_resume(out, found, held)
    if action == "finished":  # a changed drafter is not "nothing changed": refused before that is said
        _refuse_other_drafter(cfg, _recorded(out), out)
    if chosen:
        say(chosen)
    return None if action == "finished" else action == "resume"


def prepare(cfg: RunConfig, resume: bool, overwrite: bool, auto_resume: bool = False,
            say: Callable[[str], None] = lambda _: None) -> RunStart:
    """What this start may do with the run directory; RunDirError when it may not start at all. say() hears
    what --auto-resume chose, before a check of the chosen start can refuse it."""
    out = Path(cfg.output_dir)
    _check_flags(out, resume, overwrite, auto_resume)
    _check_not_others(out)
    found = ckpt.inspect(out / CHECKPOINTS)
    held = _held(out, found)
    if auto_resume:
        resume = _auto_choice(cfg, out, found, held, say)
        if resume is None:
            return RunStart(out, False, False, found, finished=True)
    _check_held(out, held, resume, overwrite)
    storage.check_writable(out)
    start = RunStart(out, resume, overwrite, found)
    if resume:
        start.notes += _resume_notes(out, found)
        start.recorded = recorded = _recorded(out)
        if recorded is None and (out / RUN_CONFIG).exists():
            start.notes.append(f"--resume: {out / RUN_CONFIG} is damaged (not a readable JSON object): this start "
                               "cannot compare its settings with the run's and writes the file anew")
        if recorded is not None and (problems := _kept_settings(cfg, recorded, out)):
            raise RunDirError(f"--resume: this config changes what the run in {out} trains:\n  - "
                              + "\n  - ".join(problems) + f"\nA resumed run must keep these: {_AGAIN}")
        if _finished(out, found) and (out / "drafter").exists() and (found.resume_step or 0) >= cfg.train.steps:
            _refuse_other_drafter(cfg, recorded, out)  # the settings checks come before the shortcut
            # Nothing left to train: going on would only publish the drafter again and write a summary without
            # the run's figures (the supervisor resumes every start of a container run, finished or not).
            say(_finished_note(out, f"its last checkpoint is step {found.resume_step}, train.steps is "
                                    f"{cfg.train.steps}; "))
            return RunStart(out, False, False, found, finished=True)
        if found.resume_step is not None and found.resume_step > cfg.train.steps:
            raise RunDirError(f"--resume: the last checkpoint in {out} is step {found.resume_step}, past train.steps = "
                              f"{cfg.train.steps}: give train.steps = {found.resume_step} to publish the drafter of that "
                              f"checkpoint, or more to train further (--set train.steps=N)")
    return start


def _check_not_others(out: Path) -> None:
    """output_dir is a directory that holds nothing of another job's, nor a model: refused whatever the flags
    (--overwrite would remove that job's summary.json, or the model's config.json)."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output_dir {out} is a file, not a directory: give another --output-dir")
    if problem := other_job_problem(out, TRAIN):
        raise RunDirError(problem)
    if (model := _recorded(out)) is not None and "model_type" in model:  # a model's config.json, not a run's
        raise RunDirError(f"{out} holds a model ({out / RUN_CONFIG} has model_type {model['model_type']!r}), not a "
                          "training run: give --output-dir a directory of its own (--overwrite would remove that "
                          "config.json)")


def _check_held(out: Path, held: list[str], resume: bool, overwrite: bool) -> None:
    """A new run never lands on an earlier one; --resume needs a run to continue (a mistyped --output-dir is not
    a new run: --auto-resume is the flag that decides that by itself)."""
    if held and not resume and not overwrite:
        raise RunDirError(f"{out} already holds a run ({', '.join(held)}): continue it with --resume, start a new "
                          "run with another --output-dir, or replace this one with --overwrite")
    if resume and not held:
        why = "it does not exist" if not out.exists() else f"it holds none of {', '.join(RUN_MARKS)}"
        raise RunDirError(f"--resume: there is no run to resume in {out} ({why}): give the --output-dir of the run "
                          "to continue (check the path), or leave --resume out to start a new run there; "
                          "--auto-resume continues a run where there is one and starts a new one where there is none")


def _refuse_other_drafter(cfg: RunConfig, recorded: dict | None, out: Path) -> None:
    """A finished run's shortcut ("nothing changed") with drafter settings other than the run recorded: refused,
    each listed, as check_model refuses them for a run that goes on training."""
    if recorded is None:
        return
    before, now = _flat(recorded), _flat(stored_config(cfg))
    differ = [f"{key}: {before[key]} -> {value}" for key, value in now.items()
              if key in DRAFTER_SETTINGS and key in before
              and _canonical(before[key], out, Path.cwd()) != _canonical(value, out)]
    if differ:
        raise RunDirError(f"this config builds another drafter than the finished run in {out} trained:\n  - "
                          + "\n  - ".join(differ) + f"\nA resumed run must train the same model: {_AGAIN}")


def interrupted_note(out: Path, signal_name: str, second: bool) -> str:
    """What a signal that ended the run where it was (start-up, or a second signal) leaves in `out`: the newest
    whole checkpoint and the --resume that continues from it, or that there is none to continue from."""
    when = f"at once by a second {signal_name}" if second else f"by {signal_name} before training started"
    latest = ckpt.latest_checkpoint(out / CHECKPOINTS) if (out / CHECKPOINTS).is_dir() else None
    if latest is None:
        return f"stopped {when}: {out} holds no checkpoint, so there is nothing to resume; run the command again"
    return (f"stopped {when}: the last checkpoint, {latest.name} in {out / CHECKPOINTS}, is intact; --resume "
            "continues from it")


@contextlib.contextmanager
def removed_if_left_empty(out: Path) -> Iterator[None]:
    """A start that fails leaves no empty output directory behind when it was the one that created it."""
    existed = out.exists()
    try:
        yield
    except BaseException:
        if not existed and out.is_dir() and not any(out.iterdir()):
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


# ---- check_model: the drafter the config builds against the checkpoint's ---------------------

def _get(config: dict, dotted: str):
    for key in dotted.split("."):
        config = config.get(key) if isinstance(config, dict) else None
    return config


def _changes(cfg: RunConfig, recorded: dict) -> list[str]:
    """Settings that differ from the recorded run and may: listed, not refused."""
    out = Path(cfg.output_dir)
    before, now = _flat(recorded), _flat(stored_config(cfg))
    lines = []
    for key, value in now.items():
        if key == "output_dir" or key.startswith("drafter.") or key in KEPT_ON_RESUME or key not in before:
            continue
        if _canonical(before[key], out, Path.cwd()) != _canonical(value, out):
            note = " (the data order differs from an uninterrupted run)" if key in DATA_ORDER else ""
            lines.append(f"{key}: {before[key]} -> {value}{note}")
    return lines


def check_model(start: RunStart, cfg: RunConfig, drafter_config) -> None:
    """--resume: refuse a config whose drafter differs from the checkpoint's; list the allowed changes."""
    if start.resume_from is None:
        return
    try:
        saved = json.loads((start.resume_from / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{start.resume_from}: its config.json cannot be read ({exc}); move the directory "
                          "aside to resume from an earlier checkpoint") from exc
    new = drafter_config.to_dict()
    differ = [f"{key}: {_get(saved, key)} -> {_get(new, key)} ({setting})" for key, setting in DRAFTER_SHAPE.items()
              if _get(saved, key) != _get(new, key)]
    if differ:
        raise RunDirError(f"--resume: this config builds another drafter than {start.resume_from} holds:\n  - "
                          + "\n  - ".join(differ) + f"\nA resumed run must train the same model: {_AGAIN}")
    if start.recorded is not None and (changes := _changes(cfg, start.recorded)):
        start.notes.append("--resume with changed settings: " + "; ".join(changes))


# ---- clean and commit --------------------------------------------------------------------------

def clean(start: RunStart) -> list[str]:
    """Rank 0, once the start is accepted: repair the checkpoint directory."""
    if not start.resume or not start.found.needs_repair():
        return []
    with storage.explained(f"cleaning {start.found.root}", start.found.root,
                           "Make the run directory writable, then --resume again."):
        return ckpt.repair(start.found)


def commit(start: RunStart, cfg: RunConfig) -> None:
    """The lead drafter, after everything loaded: the run takes over the directory."""
    with storage.explained(f"writing the run's files in {start.out}", start.out,
                           "Free space or fix the directory, then start again."):
        if start.overwrite:
            for name in RUN_OUTPUTS:
                storage.remove(start.out / name)
        storage.write_text_atomic(start.out / RUN_CONFIG, json.dumps(stored_config(cfg), indent=2))


def record_progress(out: Path, line: str) -> None:
    """The latest progress line into OUTPUT/progress.txt, replaced whole (a reader never sees half a line) and not
    fsynced (it is rewritten every train.log_every steps, on the training loop's thread). A failed write costs
    only this line: training goes on."""
    tmp = out / f".{PROGRESS}.tmp"
    try:
        tmp.write_text(line + "\n")
        os.replace(tmp, out / PROGRESS)
    except OSError:
        pass
