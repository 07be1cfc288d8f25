"""The quality benchmark's table and figure, from each drafter's dflash-eval output (eval.json, requests.jsonl)
and each trainer's wall time and run summary (summary.json: its loss and step cost): one row per drafter and
prompt set."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...infra import storage
from .loops import loops

# the goal, reported beside the table (a figure of this benchmark, never a test's assertion)
GOAL_MARGIN = 1.10  # tau at least 10% above the best peer's on every prompt set
GOAL_LAST_SLOT = 0.6  # the last slot's acceptance at least 0.6 of the first slot's
LAST_STEPS = 100  # the training loss reported: the mean of the last 100 steps' losses


@dataclass
class Row:
    drafter: str  # the trainer (and variant) that made it
    prompt_set: str
    tau: float
    tau_per_request: float
    tau_without_loops: float | None  # None: every answer loops
    looping: float  # share of requests whose answer loops
    last_over_first: float | None  # slot B-1's acceptance / slot 1's
    outputs_equal: str  # "n/m" equal to target-only greedy
    train_s: float | None  # wall time of the training process (start-up and compile step included)
    slot_acceptance: list[float]
    # the trainer's own loss, per step, over its last LAST_STEPS steps: trainers given the same micro-batches and
    # the same objective fit them this well (how well each fits, apart from how well it decodes)
    train_loss: float | None = None
    trained_at_once: int = 1  # drafters the benchmark trained side by side on the GPU (--jobs): train_s overlaps
    # the step's cost, from the run's summary.json (ours and the peers' write the same fields; None: not there):
    # the median ms per optimizer step after the first steps, MFU over those steps (our trainer's FLOP count for
    # the same micro-batches), the peak GPU memory allocated, and of it the target a peer held (speculators)
    step_ms: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    target_gib: float | None = None
    # each request's own tau by its id: two drafters compared prompt by prompt (the verdict's paired count)
    request_tau: dict[str, float] = field(default_factory=dict)

    @property
    def tau_per_gpu_minute(self) -> float | None:
        return self.tau / (self.train_s / 60) if self.train_s else None


def read_eval(eval_dir: Path) -> tuple[dict, list[dict]]:
    report = json.loads((eval_dir / "eval.json").read_text())
    requests = [json.loads(line) for line in (eval_dir / "requests.jsonl").read_text().splitlines() if line.strip()]
    return report, requests


def run_summary(run_dir: Path | None) -> dict:
    """The run's summary.json ({} where there is no run, or no readable summary)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (TypeError, OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def final_loss(summary: dict) -> float | None:
    """The mean of the last LAST_STEPS per-step losses in a run's summary (ours and the peers' write them)."""
    losses = summary.get("losses")
    last = [x for x in losses[-LAST_STEPS:] if isinstance(x, int | float)] if isinstance(losses, list) else []
    return sum(last) / len(last) if last else None


def figure(summary: dict, key: str) -> float | None:
    value = summary.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def rows_for(drafter: str, eval_dir: Path, train_s: float | None, run_dir: Path | None = None,
             trained_at_once: int = 1) -> list[Row]:
    """One row per prompt set and temperature (a set named "NAME T=t" when the evaluation sampled or had several);
    run_dir: the training run, for its loss and step cost."""
    report, requests = read_eval(eval_dir)
    summary = run_summary(run_dir)
    cost = {"train_loss": final_loss(summary), "step_ms": figure(summary, "steady_step_ms"),
            "mfu": figure(summary, "steady_mfu"), "peak_gib": figure(summary, "peak_memory_gib"),
            "target_gib": figure(summary, "target_memory_gib")}
    views = report.get("by_temperature") or {f"{report.get('temperature', 0):g}": report}
    labelled = len(views) > 1 or any(float(t) > 0 for t in views)
    out = []
    for temperature, view in views.items():
        for name, s in view["sets"].items():
            mine = [r for r in requests
                    if r["set"] == name and float(r.get("temperature", 0)) == float(temperature)]
            looping = [r for r in mine if loops(r["output_ids"])]
            kept = [n for r in mine if r not in looping for n in r["accept_lengths"]]
            slots = s["slot_acceptance"]
            equal = s.get("outputs_equal")
            out.append(Row(
                drafter=drafter, prompt_set=f"{name} T={temperature}" if labelled else name, tau=s["tau"],
                tau_per_request=s["tau_per_request_mean"],
                tau_without_loops=sum(kept) / len(kept) if kept else None,
                looping=len(looping) / max(1, len(mine)),
                last_over_first=slots[-1] / slots[0] if slots and slots[0] else None,
                outputs_equal="sampled" if equal is None else f"{equal}/{s['prompts']}", train_s=train_s,
                slot_acceptance=slots, trained_at_once=trained_at_once,
                request_tau={str(r["id"]): sum(r["accept_lengths"]) / len(r["accept_lengths"])
                             for r in mine if r.get("id") is not None and r["accept_lengths"]}, **cost))
    return out


def _f(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


HEADER = ("drafter", "prompt set", "tau", "tau/request", "tau w/o loops", "looping", "last/first slot",
          "= target-only", "train s", "tau per GPU-min", "train loss", "ms/step", "MFU", "peak GiB")


def train_seconds(r: Row) -> str:
    """The training wall time; one of several trained at once shared the GPU, and says so."""
    text = _f(r.train_s, ".0f")
    return f"{text} ({r.trained_at_once} at once)" if r.train_s is not None and r.trained_at_once > 1 else text


def peak_memory(r: Row) -> str:
    """The peak GPU memory; where a peer held the target too (our trainer reads features from disk), its share."""
    text = _f(r.peak_gib, ".1f")
    return f"{text} ({r.target_gib:.1f} target)" if r.peak_gib is not None and r.target_gib else text


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = (r.drafter, r.prompt_set, _f(r.tau, ".2f"), _f(r.tau_per_request, ".2f"),
                 _f(r.tau_without_loops, ".2f"), _f(r.looping, ".0%"), _f(r.last_over_first, ".2f"),
                 r.outputs_equal, train_seconds(r), _f(r.tau_per_gpu_minute, ".2f"), _f(r.train_loss, ".3f"),
                 _f(r.step_ms, ".1f"), _f(r.mfu, ".1%"), peak_memory(r))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(mine: Row, theirs: Row) -> str:
    """Prompt by prompt: on how many of the prompts both judged mine's tau is higher, lower (a set's tau alone
    hides whether a gap is a few prompts or all of them)."""
    both = [k for k in mine.request_tau if k in theirs.request_tau]
    if not both:
        return ""
    higher = sum(mine.request_tau[k] > theirs.request_tau[k] for k in both)
    lower = sum(mine.request_tau[k] < theirs.request_tau[k] for k in both)
    return f"; per prompt higher on {higher}, lower on {lower} of {len(both)}"


def verdict(rows: list[Row], ours: str, peers: list[str]) -> list[str]:
    """Against the goal: per prompt set, each of our drafters' (ours and its variants') tau against the best
    peer's, prompt by prompt too, and the last slot against the first."""
    said = []
    for name in dict.fromkeys(r.prompt_set for r in rows):
        mine_rows = [r for r in rows if r.prompt_set == name and (r.drafter == ours or r.drafter.startswith(ours + " "))]
        theirs = [r for r in rows if r.drafter in peers and r.prompt_set == name]
        for mine in mine_rows:
            if theirs:
                best = max(theirs, key=lambda r: r.tau)
                ratio = mine.tau / best.tau if best.tau else float("inf")
                mark = "meets" if ratio >= GOAL_MARGIN else "misses"
                said.append(f"{name}: {mine.drafter} tau {mine.tau:.2f} vs best peer {best.drafter} {best.tau:.2f} "
                            f"({ratio - 1:+.1%}; goal +{GOAL_MARGIN - 1:.0%}: {mark}{paired(mine, best)})")
            if mine.last_over_first is not None:
                mark = "meets" if mine.last_over_first >= GOAL_LAST_SLOT else "misses"
                said.append(f"{name}: {mine.drafter} last slot / first slot {mine.last_over_first:.2f} "
                            f"(goal {GOAL_LAST_SLOT}: {mark})")
    return said


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r.prompt_set for r in rows))
    columns = min(2, len(sets))  # two panels a row: a page's width
    lines = -(-len(sets) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(6 * columns, 4.2 * lines), squeeze=False)
    for ax in axes.flat[len(sets):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, sets, strict=False):
        for r in (r for r in rows if r.prompt_set == name):
            ax.plot(range(1, len(r.slot_acceptance) + 1), r.slot_acceptance, marker="o", markersize=3,
                    label=f"{r.drafter} (tau {r.tau:.2f})")
        ax.set(title=f"{name}: acceptance by block position", xlabel="draft slot k (tokens after the anchor)",
               ylabel="P(slot k accepted)", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.publish_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def not_in_table(missing: list[dict]) -> str:
    """The drafters the table lacks, a line each: its exit code, "stopped" (a training that stopped before its
    last step) or "not run" (a signal came first), and its log."""
    if not missing:
        return ""
    lines = ["Not in the table:"]
    for m in missing:
        ended = f"exit {m['exit']}" if isinstance(m["exit"], int) else m["exit"]
        lines.append(f"- {m['drafter']}: {ended}" + (f" (log: {m['log']})" if m.get("log") else ""))
    return "\n".join(lines) + "\n"


def write(rows: list[Row], out: Path, meta: dict, said: list[str], missing: list[dict] = ()) -> None:
    """quality.json, quality.md and quality.png; missing: the drafters that failed or were not run, each
    {"drafter", "exit" (its exit code, "stopped" or "not run"), "log"}: listed in both files, so that a reader of
    either alone sees which rows the table lacks."""
    missing = list(missing)
    storage.write_text_atomic(out / "quality.json", json.dumps(
        {**meta, "rows": [asdict(r) | {"tau_per_gpu_minute": r.tau_per_gpu_minute} for r in rows], "goal": said,
         "not_in_table": missing}, indent=2) + "\n")
    storage.write_text_atomic(out / "quality.md", markdown(rows) + "\n\n" + "\n".join(f"- {s}" for s in said) + "\n"
                              + (f"\n{not_in_table(missing)}" if missing else ""))
    plot(rows, out / "quality.png")
