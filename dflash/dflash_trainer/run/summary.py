"""The run's summary: summary.json (written atomically), the table printed at the end, and where the
seconds before step 1 went (Startup)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from rich.table import Table

from ..infra import storage
from ..infra.console import console

# Steps left out of the steady figures: compiles, autotuning and the allocator's warm-up land in the first ones.
STEADY_AFTER = 3


def steady_steps(count: int) -> slice:
    """The steps the steady figures read: those after the first STEADY_AFTER, or the last one of a shorter run."""
    return slice(min(STEADY_AFTER, max(0, count - 1)), count)


def steady_step_ms(step_s: list[float]) -> float | None:
    """The median milliseconds per optimizer step over the steady steps (None: no step)."""
    kept = step_s[steady_steps(len(step_s))]
    return statistics.median(kept) * 1e3 if kept else None


def steady_mfu(step_s: list[float], step_flops: list[float], peak: float | None) -> float | None:
    """Model FLOPs over seconds of the steady steps, against the GPU's peak (None: no known peak, or no step)."""
    kept = steady_steps(len(step_s))
    seconds = sum(step_s[kept])
    return sum(step_flops[kept]) / seconds / peak if peak and seconds > 0 else None


def steady_span(count: int) -> str:
    """Which of a run's `count` steps the steady figures read, in words."""
    kept = steady_steps(count)
    first = kept.start + 1
    return f"this run's step {count}" if first >= count else f"median of this run's steps {first}-{count}"


def write_summary(out: Path, summary: dict) -> None:
    storage.write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))


def print_summary(summary: dict) -> None:
    table = Table(title="DFlash training summary", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")  # a path longer than a log's 80 columns wraps whole, never cut with "…"
    fmt = lambda v, f: "n/a" if v is None else format(v, f)
    table.add_row("steps", f"{summary['steps']} ({len(summary['losses'])} in this run)")
    table.add_row("loss", f"{fmt(summary['first_loss'], '.3f')} -> {fmt(summary['final_loss'], '.3f')}")
    table.add_row("tokens/s", fmt(summary["tokens_per_s"], ",.0f"))
    table.add_row("MFU", fmt(summary["mfu"], ".1%") if summary["mfu"] else "n/a (no known GPU peak)")
    # after the compiles and warm-up: the figures `make bench` measures, comparable with it
    step_ms, mfu = summary.get("steady_step_ms"), summary.get("steady_mfu")
    table.add_row("step time (steady)", "n/a (no step in this run)" if step_ms is None else
                  f"{step_ms:,.1f} ms/step ({steady_span(len(summary['losses']))})")
    table.add_row("MFU (steady)", fmt(mfu, ".1%") if mfu else "n/a" if step_ms is None else "n/a (no known GPU peak)")
    table.add_row("time split", ", ".join(f"{k} {v:.1f}s" for k, v in summary["time_split_s"].items()))
    if "tau_before" in summary:
        method = summary.get("tau_before_method", "speculative decoding")
        before = "" if method == "speculative decoding" else f" (before: {method})"
        table.add_row("tau (acceptance length)", f"{summary['tau_before']:.2f} -> {summary['tau_after']:.2f}{before}")
    else:
        table.add_row("tau (acceptance length)", "n/a: no target in this run (offline)")
    table.add_row("drafter (HF dir)", summary["drafter_dir"])
    table.add_row("checkpoints", summary["checkpoints"] or "none written (train.checkpoint_every sets how often): the drafter "
                  "above is the run's output")
    if console.json_lines:  # the table's figures as fields, for a log collector
        console.json_line("DFlash training summary", step=summary["steps"], loss=summary["final_loss"],
                       first_loss=summary["first_loss"], tokens_per_s=summary["tokens_per_s"], mfu=summary["mfu"],
                       steady_step_ms=step_ms, steady_mfu=mfu,
                       tau_before=summary.get("tau_before"), tau_after=summary.get("tau_after"),
                       drafter_dir=summary["drafter_dir"])
        return
    console.print(table)


def process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports included); Linux /proc,
    else 0 (the time since this module was imported)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


PROCESS_START = time.perf_counter() - process_age_s()


class Startup:
    """Where the seconds from process start to the end of step 1 go: one mark per phase."""

    def __init__(self, start: float = PROCESS_START):
        self.start = start
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def phases(self) -> dict[str, float]:
        out, previous = {}, self.start
        for name, at in self.marks:
            out[name] = out.get(name, 0.0) + at - previous
            previous = at
        return out

    def total(self) -> float:
        return (self.marks[-1][1] if self.marks else time.perf_counter()) - self.start

    def line(self) -> str:
        return f"time to first step {self.total():.1f}s: " + ", ".join(
            f"{name} {seconds:.1f}s" for name, seconds in self.phases().items())
