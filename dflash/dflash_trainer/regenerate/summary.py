"""summary.json and the table printed at the end: over every shard in the directory, and this run apart.

The directory's figures are counted as rows pass by: the rows there when the run starts in the one read
that also finds what is answered (OutputDir.done_keys), the rows each process writes as it writes them
(OutputDir.write_shard), added up over the processes at the end. No shard is read twice.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from rich.table import Table

from ..data.rows import rows_named
from ..infra.console import console


@dataclass
class Figures:
    """What summary.json counts over answer rows; two add up to the figures of both sets of rows."""

    rows: int = 0
    lengths: Counter = field(default_factory=Counter)  # answer length in tokens -> answers that long
    truncated: int = 0
    roundtrip_mismatches: int = 0
    prompt_mismatches: int = 0
    partly_supervised: int = 0
    ids: Counter = field(default_factory=Counter)  # "generated" / "retokenized" -> answers (regen.answer_ids)

    def add(self, regen: dict) -> None:
        """One row's `regen`; KeyError or TypeError (nothing counted) when it lacks the statistics."""
        lengths = Counter(regen["answer_tokens"])
        truncated, roundtrip = sum(regen["truncated"]), sum(not ok for ok in regen["roundtrip"])
        mismatch, partly = not regen["prompt_matches"], not regen["all_turns_supervised"]
        ids = Counter(regen.get("answer_ids") or [])  # rows written before it was recorded have none
        self.rows += 1
        self.lengths += lengths
        self.truncated += truncated
        self.roundtrip_mismatches += roundtrip
        self.prompt_mismatches += mismatch
        self.partly_supervised += partly
        self.ids += ids

    def __add__(self, other: Figures) -> Figures:
        return Figures(self.rows + other.rows, self.lengths + other.lengths, self.truncated + other.truncated,
                       self.roundtrip_mismatches + other.roundtrip_mismatches,
                       self.prompt_mismatches + other.prompt_mismatches,
                       self.partly_supervised + other.partly_supervised, self.ids + other.ids)

    @property
    def answers(self) -> int:
        return sum(self.lengths.values())

    @property
    def answer_tokens(self) -> int:
        return sum(length * n for length, n in self.lengths.items())

    def p99(self) -> int:
        """The answer length at rank ceil(0.99 n) of the n answers in order (0 without answers)."""
        rank = max(0, math.ceil(0.99 * self.answers) - 1)
        for length in sorted(self.lengths):
            rank -= self.lengths[length]
            if rank < 0:
                return length
        return 0


def collect(figures: Figures, *, shards: int, engine: str, target: str, model: str | None, sampling: dict,
            chat_kwargs: dict, plan_skipped: dict, rows_read: int, runs: list, world: int,
            skipped_rows: dict | None = None, not_regenerated: dict | None = None) -> dict:
    """The directory's totals (`figures` of all its rows, earlier runs' included; `shards` there) and what
    this run did (`runs`: one per rank). From the plan of the source rows: `plan_skipped` (reason -> rows),
    `skipped_rows` (reason -> their first row numbers), `not_regenerated` (reason -> {rows, turns,
    first_rows}: turns of answered rows kept as they were, such as assistant tool calls)."""
    answers = figures.answers
    tokens = sum(r.answer_tokens for r in runs)
    seconds = max((r.seconds for r in runs), default=0.0)
    return {
        "prompts": figures.rows,
        "answers": answers,
        "answer_tokens": figures.answer_tokens,
        "mean_answer_tokens": figures.answer_tokens / answers if answers else 0.0,
        "p99_answer_tokens": figures.p99(),
        "truncated_fraction": figures.truncated / answers if answers else 0.0,
        "roundtrip_mismatches": figures.roundtrip_mismatches,
        "prompt_mismatches": figures.prompt_mismatches,
        "rows_with_unsupervised_earlier_turns": figures.partly_supervised,
        "answer_ids": {"generated": figures.ids["generated"], "retokenized": figures.ids["retokenized"]},
        "shards": shards,
        "engine": engine,
        "target": target,
        "model": model,
        "sampling": sampling,
        "chat_template_kwargs": chat_kwargs,
        "source_rows": rows_read,
        "skipped_rows": dict(plan_skipped),
        "skipped_row_numbers": dict(skipped_rows or {}),
        "not_regenerated": dict(not_regenerated or {}),
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
    table.add_column(overflow="fold")  # long paths fold rather than end in "..." in an 80-column log
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
    if summary["answer_ids"]["retokenized"]:
        table.add_row("answers whose ids are their text re-tokenized",
                      f"{summary['answer_ids']['retokenized']:,} of {summary['answers']:,}")
    if run["cut_short"]:
        table.add_row("conversations cut short (context or template)", f"{run['cut_short']:,}")
    for reason, n in summary["skipped_rows"].items():
        table.add_row("skipped rows", f"{n:,}: {reason}{rows_named(n, summary['skipped_row_numbers'].get(reason))}")
    for reason, kept in summary["not_regenerated"].items():
        table.add_row("not regenerated", f"{kept['turns']:,} {reason} in {kept['rows']:,} rows"
                      f"{rows_named(kept['rows'], kept['first_rows'])}")
    table.add_row("shards", f"{summary['shards']} ({run['shards_written']} written now)")
    console.print(table)
    # A plain line, never wrapped or cut, so it can be copied into the training config as it stands.
    console.print(f'train on them with: data.train = ["{where}/part-*.jsonl"]', soft_wrap=True, markup=False,
                  highlight=False)


