"""The run's summary: summary.json (written atomically) and the table printed at the end."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from .loading import console


def write_summary(out: Path, summary: dict) -> None:
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "summary.json")


def print_summary(summary: dict) -> None:
    table = Table(title="DFlash training summary", show_header=False)
    fmt = lambda v, f: "n/a" if v is None else format(v, f)
    table.add_row("steps", f"{summary['steps']} ({len(summary['losses'])} in this run)")
    table.add_row("loss", f"{fmt(summary['first_loss'], '.3f')} -> {fmt(summary['final_loss'], '.3f')}")
    table.add_row("tokens/s", fmt(summary["tokens_per_s"], ",.0f"))
    table.add_row("MFU", fmt(summary["mfu"], ".1%") if summary["mfu"] else "n/a (no known GPU peak)")
    table.add_row("time split", ", ".join(f"{k} {v:.1f}s" for k, v in summary["time_split_s"].items()))
    if "tau_before" in summary:
        table.add_row("tau (acceptance length)", f"{summary['tau_before']:.2f} -> {summary['tau_after']:.2f}")
    else:
        table.add_row("tau (acceptance length)", "n/a: no target in this run (offline)")
    table.add_row("drafter (HF dir)", summary["drafter_dir"])
    table.add_row("checkpoints", summary["checkpoints"])
    console.print(table)
