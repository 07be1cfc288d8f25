"""A run's figures to the trackers train.report_to names (TensorBoard, Weights & Biases, MLflow), and its
progress as plain log lines.

Each tracker is an optional package: a run refuses to start when train.report_to names one that is not
installed (config.semantic_problems says which, with its pip command). Credentials come from each tracker's
own login or environment (WANDB_API_KEY, MLFLOW_TRACKING_URI and its credentials) and never pass through this
code or its logs. Which tracker runs hold a run's figures is recorded in OUTPUT/trackers.json, so that
`dflash-eval --run OUTPUT` logs its results to the same runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import missing_trackers

TRACKERS_FILE = "trackers.json"  # OUTPUT/trackers.json: the tracker runs a training run logged to


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, out: Path, **_):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tb"))  # a later writer (dflash-eval) adds a file beside
        self.record = {"dir": str(out / "tb")}

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def summary(self, values: dict) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in values.items() if _plain(v))
        self.writer.add_text("summary", text)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, out: Path, run_config: dict, run_name: str, project: str | None, resume: dict | None, **_):
        import wandb

        if resume:  # dflash-eval --run: the training run's own W&B run
            self.run = wandb.init(project=resume.get("project"), id=resume["id"], resume="allow", dir=str(out))
        else:
            self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT"), name=run_name,
                                  config=run_config, dir=str(out))
        self.record = {"id": getattr(self.run, "id", None), "project": getattr(self.run, "project", project)}

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def summary(self, values: dict) -> None:
        for key, value in values.items():
            if _plain(value):
                self.run.summary[key] = value

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    name = "mlflow"

    def __init__(self, out: Path, run_config: dict, run_name: str, resume: dict | None, **_):
        import mlflow

        if resume:
            mlflow.set_tracking_uri(resume["tracking_uri"])
            self.run = mlflow.start_run(run_id=resume["run_id"])
        else:  # MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME choose where, as mlflow documents
            self.run = mlflow.start_run(run_name=run_name)
            mlflow.log_params(dict(_flat(run_config)))
        self.mlflow = mlflow
        self.record = {"run_id": self.run.info.run_id, "tracking_uri": mlflow.get_tracking_uri()}

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(dict(values), step=step)

    def summary(self, values: dict) -> None:
        self.mlflow.log_metrics({f"summary/{k}": v for k, v in values.items()
                                 if isinstance(v, int | float) and not isinstance(v, bool)})

    def close(self) -> None:
        self.mlflow.end_run()


_SINKS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}


def _plain(value) -> bool:
    return isinstance(value, int | float | str) or value is None


def _flat(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value if _plain(value) else json.dumps(value)


class Metrics:
    """The trackers of one run: scalars at a step, the run's summary at the end."""

    def __init__(self, out: Path, report_to: list[str], run_config: dict | None = None, run_name: str | None = None,
                 wandb_project: str | None = None, log=print, resume: dict | None = None, record: bool = True):
        """resume: OUTPUT/trackers.json's records (a resumed run, dflash-eval --run): a tracker named there
        continues its run, one that is not starts one. record: write OUTPUT/trackers.json (a training run)."""
        self.out = Path(out)
        self.sinks = []
        for name in report_to:
            if name == "none":
                continue
            sink = _SINKS[name](out=self.out, run_config=run_config or {}, run_name=run_name or self.out.name,
                                project=wandb_project, resume=(resume or {}).get(name))
            self.sinks.append(sink)
        if record and self.sinks:
            (self.out / TRACKERS_FILE).write_text(json.dumps({s.name: s.record for s in self.sinks}, indent=1))
        if self.sinks:
            log("metrics: " + ", ".join(f"{s.name} ({', '.join(f'{k} {v}' for k, v in s.record.items())})"
                                        for s in self.sinks))

    @staticmethod
    def records(out: Path) -> dict:
        """OUTPUT/trackers.json: tracker -> what names its run ({} when there is none, or it does not read)."""
        try:
            records = json.loads((Path(out) / TRACKERS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in records.items() if k in _SINKS and isinstance(v, dict)} \
            if isinstance(records, dict) else {}

    @classmethod
    def of_run(cls, out: Path, log=print) -> Metrics:
        """The trackers a training run in `out` logged to (OUTPUT/trackers.json; none when it has no such file)."""
        records = cls.records(out)
        known = list(records)
        for name, install in missing_trackers(known):
            log(f"note: the run logged to {name}, which is not installed here: its figures get no evaluation "
                f"results ({install} adds them)")
            known.remove(name)
        return cls(out, known, log=log, resume=records, record=False)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """values: 'group/name' -> number."""
        for sink in self.sinks:
            sink.scalars(values, step)

    def summary(self, values: dict) -> None:
        for sink in self.sinks:
            sink.summary(values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


# ---- progress as plain log lines -----------------------------------------------------------------
# A terminal shows progress bars; a log (a pipe, a file, journald) gets one whole line per interval
# instead, each starting with the job's name ("train:", "regenerate:", "eval:") so `dflash-run status`
# can show the last one.

def plain_progress() -> bool:
    """True when stderr is not a terminal, or lines go out as JSON: progress goes out as lines, not a bar."""
    import sys

    from .console import console

    return not sys.stderr.isatty() or console.json_lines


def say_progress(line: str, **figures) -> None:
    """A progress line; with --log-format json, one JSON object with the figures (step, loss, tokens_per_s,
    tau, ...) as fields beside the line."""
    import sys

    from .console import console

    if console.json_lines:
        console.json_line(line, **figures)
    else:
        print(line, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """3725 -> 1h02m05s, 65 -> 1m05s, 7.2 -> 7s."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def eta(done: int, total: int, seconds: float) -> str:
    """The time left at the pace of `done` items in `seconds`."""
    if done <= 0 or seconds <= 0:
        return "?"
    return duration((total - done) * seconds / done)


class PlainProgress:
    """One plain line at the first item, every `every_s` seconds and at the last item (plain_progress() only).

    in_flight: items worked on at once (a batch, requests in flight). Their first finishes say nothing of the
    pace (one answer of 128 in flight ends after a second, the rest minutes later), so an ETA is given only once
    that many are done, the first batch's worth (or all, for fewer items): before that the line says when."""

    def __init__(self, total: int, every_s: float = 30.0, enabled: bool | None = None, in_flight: int = 1):
        import time

        self.total = total
        self.in_flight = max(1, in_flight)
        self.every_s = every_s
        self.enabled = plain_progress() if enabled is None else enabled
        self.started = self.last = time.perf_counter()
        self.said_any = False

    def elapsed(self) -> float:
        import time

        return time.perf_counter() - self.started

    def due(self, done: int) -> bool:
        import time

        if not self.enabled:
            return False
        now = time.perf_counter()
        if done >= self.total or not self.said_any or now - self.last >= self.every_s:
            self.last, self.said_any = now, True
            return True
        return False

    def timing(self, done: int) -> str:
        elapsed = self.elapsed()
        settled = min(self.in_flight, self.total)
        if done < settled:
            return f"elapsed {duration(elapsed)}, ETA after {settled:,} done"
        return f"elapsed {duration(elapsed)}, ETA {eta(done, self.total, elapsed)}"


def slot_summary(slot_accuracy: list[float]) -> str:
    """Per-slot accuracy of the slots after the anchor: the first three, the last and the mean."""
    slots = slot_accuracy[1:]  # slot 0 is the anchor itself
    if not slots:
        return "n/a"
    head = "/".join(f"{a:.2f}" for a in slots[:3])
    tail = f" .. {slots[-1]:.2f}" if len(slots) > 3 else ""
    return f"{head}{tail} (mean {sum(slots) / len(slots):.2f})"
