"""Training scalars to TensorBoard (when installed) and Weights & Biases (when installed and configured).

W&B is on when `train.wandb_project` (or the WANDB_PROJECT environment variable) names a project. Its
credentials come from wandb's own login or WANDB_API_KEY and never pass through this code or its logs.
"""

from __future__ import annotations

import os
from pathlib import Path


class Metrics:
    def __init__(self, tb_dir: Path, run_config: dict, wandb_project: str | None = None, run_name: str | None = None,
                 log=print):
        self.tb = None
        self.wandb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(tb_dir))
        except ImportError:
            log("tensorboard is not installed: no TensorBoard logs (pip install tensorboard)")
        project = wandb_project or os.environ.get("WANDB_PROJECT")
        if project:
            try:
                import wandb
            except ImportError:
                log(f"W&B project {project!r} is configured but wandb is not installed: logging to TensorBoard "
                    "only (pip install wandb, or unset train.wandb_project / WANDB_PROJECT)")
            else:
                self.wandb = wandb.init(project=project, name=run_name, config=run_config, dir=str(tb_dir.parent))
                log(f"W&B: run {getattr(self.wandb, 'name', '?')} in project {project}")

    def scalars(self, values: dict[str, float], step: int) -> None:
        """values: 'group/name' -> number."""
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(dict(values), step=step)

    def summary(self, values: dict) -> None:
        if self.wandb is not None:
            for key, value in values.items():
                if isinstance(value, int | float | str) or value is None:
                    self.wandb.summary[key] = value

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# ---- progress as plain log lines -----------------------------------------------------------------
# A terminal shows progress bars; a log (a pipe, a file, journald) gets one whole line per interval
# instead, each starting with the job's name ("train:", "regenerate:", "eval:") so `dflash-run status`
# can show the last one.

def plain_progress() -> bool:
    """True when stderr is not a terminal: progress goes out as plain lines, not a bar."""
    import sys

    return not sys.stderr.isatty()


def say_progress(line: str) -> None:
    import sys

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
