"""summary.json and the table printed at the end: over every shard in the directory, and this run apart."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from .shards import OutputDir


def _p99(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0


def collect(out: OutputDir, *, engine: str, target: str, model: str | None, sampling: dict, chat_kwargs: dict,
            plan_skipped: dict, rows_read: int, runs: list, world: int) -> dict:
    """The directory's totals (all shards, earlier runs included) and what this run did (`runs`: one per rank)."""
    lengths, truncated, roundtrip_bad, prompt_mismatch, partly_supervised, rows = [], 0, 0, 0, 0, 0
    for row in out.rows():
        regen = row["regen"]
        rows += 1
        lengths += regen["answer_tokens"]
        truncated += sum(regen["truncated"])
        roundtrip_bad += sum(not ok for ok in regen["roundtrip"])
        prompt_mismatch += not regen["prompt_matches"]
        partly_supervised += not regen["all_turns_supervised"]
    tokens = sum(r.answer_tokens for r in runs)
    seconds = max((r.seconds for r in runs), default=0.0)
    return {
        "prompts": rows,
        "answers": len(lengths),
        "answer_tokens": sum(lengths),
        "mean_answer_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
        "p99_answer_tokens": _p99(lengths),
        "truncated_fraction": truncated / len(lengths) if lengths else 0.0,
        "roundtrip_mismatches": roundtrip_bad,
        "prompt_mismatches": prompt_mismatch,
        "rows_with_unsupervised_earlier_turns": partly_supervised,
        "shards": len(out.shards()),
        "engine": engine,
        "target": target,
        "model": model,
        "sampling": sampling,
        "chat_template_kwargs": chat_kwargs,
        "source_rows": rows_read,
        "skipped_rows": dict(plan_skipped),
        "this_run": {
            "prompts": sum(r.rows for r in runs),
            "answers": sum(r.answers for r in runs),
            "answer_tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "cut_short": sum(r.cut_short for r in runs),
            "shards_written": sum(r.shards for r in runs),
            "processes": world,
        },
    }


def print_table(summary: dict, where: str) -> None:
    run = summary["this_run"]
    table = Table(title=f"regenerated answers in {where}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("prompts answered", f"{summary['prompts']:,} ({run['prompts']:,} in this run)")
    table.add_row("answer tokens", f"{summary['answer_tokens']:,} ({run['answer_tokens']:,} in this run)")
    table.add_row("tokens/s (this run)", f"{run['tokens_per_s']:,.0f} over {run['seconds']:.1f} s, "
                  f"{run['processes']} process(es), engine {summary['engine']}")
    table.add_row("answer length", f"mean {summary['mean_answer_tokens']:.1f}, p99 {summary['p99_answer_tokens']}")
    table.add_row("cut at --max-new-tokens", f"{summary['truncated_fraction']:.1%}")
    s = summary["sampling"]
    table.add_row("sampling", "greedy" if s["temperature"] == 0 else
                  f"temperature {s['temperature']}, top-p {s['top_p']}, seed {s['seed']}")
    for label, key in (("text that does not re-tokenize to its ids", "roundtrip_mismatches"),
                       ("prompts the server rendered differently", "prompt_mismatches"),
                       ("rows with earlier turns as context only", "rows_with_unsupervised_earlier_turns")):
        if summary[key]:
            table.add_row(label, f"{summary[key]:,}")
    if run["cut_short"]:
        table.add_row("conversations cut short (context or template)", f"{run['cut_short']:,}")
    for reason, n in summary["skipped_rows"].items():
        table.add_row("skipped rows", f"{n:,}: {reason}")
    table.add_row("shards", f"{summary['shards']} ({run['shards_written']} written now): data.train = "
                  f"[\"{where}/part-*.jsonl\"]")
    Console(stderr=True).print(table)
