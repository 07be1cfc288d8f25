"""A regeneration run: this rank's chunks through the engine, turn by turn, into shards.

Every rank plans the same sorted jobs, skips the chunks already answered (by key, from the shards on
disk) and answers chunk i when i mod world == rank. A chunk's answers become its shard once every job
in it is done; on an error or a stop the answered jobs of the chunk in progress are written first, so
only work still in flight is lost.

SIGTERM and SIGINT (Ctrl-C) stop cleanly (`StopSignal`): before the answering starts, at once (nothing is
written yet); while it runs, the engine hands back what is done (engine hf drops the batch it is decoding,
engine openai sends no new request and finishes those in flight), the answered jobs of the chunk in progress
are written as a shard, and the run ends with `Stopped`; running the same command again resumes. A second
signal stops at once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from tqdm import tqdm

from ..data.prompts import render_prompt, slot_indices
from ..data.rows import row_tools
from ..infra import stop_signal as infra_stop_signal
from ..infra.metrics import PlainProgress, plain_progress, say_progress
from .answers import Request, assemble_row
from .plan import TEMPLATE_ERRORS, Job, Plan, chunks, conversation_of
from .sampling import Sampling, row_seed
from .shards import OutputDir


@dataclass
class World:
    """This process's place under torchrun (one process per GPU), or a world of one."""

    size: int = 1
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        return cls(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
                   int(os.environ.get("LOCAL_RANK", "0")))

    def start(self) -> torch.device:
        """The device this rank generates on, and (world > 1) a gloo group for barriers and the summary."""
        if self.size > 1:
            from ..compile.guard import isolate_local_gpu

            isolate_local_gpu(self.local_rank)  # each rank sees its GPU as cuda:0: one compile cache for all
            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=timedelta(hours=12))  # ranks finish chunks at their pace
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, value) -> list:
        if self.size == 1:
            return [value]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def stop(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


@dataclass
class RunStats:
    """What this rank did in this run."""

    rows: int = 0
    answers: int = 0
    answer_tokens: int = 0
    cut_short: int = 0  # multi-turn rows ended early: a later prompt too long or refused by the template
    shards: int = 0
    seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class Progress:
    """Prompts answered and answer tokens/s (rank 0 shows them; every rank counts): a bar on a terminal, in a
    log a plain line at the first prompt, every 30 s and at the last."""

    def __init__(self, total_rows: int, show: bool, label: str, in_flight: int = 1):
        self.bar = tqdm(total=total_rows, desc=label, unit="prompt", disable=not show or plain_progress(),
                        dynamic_ncols=True, mininterval=0.5, smoothing=0.05)
        # An ETA once the prompts answered at once (a batch, requests in flight) are done: infra/metrics.py
        self.said = PlainProgress(total_rows, enabled=show and plain_progress(), in_flight=in_flight)
        self.label = label
        self.started = time.perf_counter()
        self.tokens = 0
        self.rows = 0

    def answered(self, tokens: int) -> None:
        self.tokens += tokens

    def row_done(self) -> None:
        self.rows += 1
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        self.bar.update(1)
        if self.said.due(self.rows):
            rank = self.label.removeprefix("regenerating").strip()
            say_progress(f"regenerate: {self.rows}/{self.said.total} prompts{' ' + rank if rank else ''} | "
                         f"{rate:,.0f} tok/s | {self.tokens:,} answer tokens | {self.said.timing(self.rows)}",
                         done=self.rows, total=self.said.total, tokens_per_s=rate, tokens=self.tokens)

    def close(self) -> None:
        self.bar.close()


@dataclass
class _JobState:
    job: Job
    conversation: list[dict]
    slots: list[int]
    prompts: list[list[int]]
    tools: list[dict] | None  # the row's tool definitions: every prompt renders them, engine openai sends them
    answers: list = field(default_factory=list)


def answer_chunk(engine, rows, tokenizer, jobs: list[Job], sampling: Sampling, chat_kwargs: dict,
                 max_context: int | None, progress: Progress | None, stats: RunStats, finished: list[dict],
                 should_stop: Callable[[], bool] | None = None) -> None:
    """Answer every slot of every job, turn by turn; appends each job's row to `finished` once complete.
    When `should_stop()` turns true the engine hands back what it has and the jobs not complete are left
    out (a later run answers them)."""
    states = []
    for job in jobs:
        row = rows[job.index]
        conversation = conversation_of(row, sampling.turns)
        states.append(_JobState(job, conversation, slot_indices(conversation), [list(job.first_prompt)],
                                row_tools(row)))
    active, turn = states, 0
    while active:
        requests = []
        for st in active:
            messages = _filled(st, st.slots[turn])
            if turn > 0 and not _next_prompt(st, messages, tokenizer, sampling, chat_kwargs, max_context):
                stats.cut_short += 1
                _finish(st, finished, progress, stats)
                continue
            seed = row_seed(sampling.seed, st.job.key, turn)
            requests.append(Request(st.job, turn, messages, st.prompts[turn], seed, st.tools))
        by_key = {st.job.key: st for st in active}
        still = []
        for request, answer in engine.answer(requests, should_stop):
            st = by_key[request.job.key]
            st.answers.append(answer)
            stats.answers += 1
            stats.answer_tokens += len(answer.ids)
            if progress:
                progress.answered(len(answer.ids))
            if len(st.answers) == len(st.slots):
                _finish(st, finished, progress, stats)
            else:
                still.append(st)
        if should_stop is not None and should_stop():
            return
        active, turn = still, turn + 1


def _next_prompt(st: _JobState, messages: list[dict], tokenizer, sampling: Sampling, chat_kwargs: dict,
                 max_context: int | None) -> bool:
    """A later turn's prompt appended to st.prompts; False when the template refuses it or it does not fit."""
    try:
        prompt = render_prompt(tokenizer, messages, st.tools, **chat_kwargs)
    except TEMPLATE_ERRORS:  # the template refuses this turn: keep the answers so far
        return False
    if max_context and len(prompt) + sampling.max_new_tokens > max_context:
        return False
    st.prompts.append(prompt)
    return True


def _filled(st: _JobState, upto: int) -> list[dict]:
    """The conversation before position `upto`, with the answers so far in their slots."""
    messages = [dict(m) for m in st.conversation[:upto]]
    for slot, answer in zip(st.slots, st.answers):
        if slot < upto:
            messages[slot] = {"role": "assistant", "content": answer.text}
    return messages


def _finish(st: _JobState, finished: list[dict], progress: Progress | None, stats: RunStats) -> None:
    finished.append(assemble_row(st.job, st.conversation, st.slots, st.prompts, st.answers, st.tools))
    stats.rows += 1
    if progress:
        progress.row_done()


class Stopped(KeyboardInterrupt):
    """A clean stop on SIGTERM / SIGINT: what is answered is written; `stats` is what this process did (None:
    stopped before answering), `note` what the command line says about it."""

    def __init__(self, signal_name: str, stats: RunStats | None = None):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.stats = stats
        self.note = ""


class StopSignal(infra_stop_signal.StopSignal):
    """While `interruptible` (before the answering starts) the first signal raises Stopped where the program is;
    while answering (run_chunks) it is only recorded, and the engines poll it, so that shards are never cut."""

    def __init__(self) -> None:
        super().__init__()
        self.interruptible = True

    def __call__(self) -> bool:
        """A stop was asked for (the engines' `should_stop`)."""
        return self.requested

    def on_first(self, name: str) -> None:
        if self.interruptible:
            raise Stopped(name)
        # Nothing printed here: a handler writing to stderr while the program does raises "reentrant call"


def run_chunks(engine, rows, tokenizer, plan: Plan, out: OutputDir, world: World, sampling: Sampling,
               chat_kwargs: dict, max_context: int | None, shard_size: int, done: set[str], log,
               stop: StopSignal | None = None) -> RunStats:
    """This rank's share of the plan; returns what it did, or raises Stopped (carrying it) once a stop signal's
    answered jobs are written."""
    stats = RunStats()
    stop = stop if stop is not None else StopSignal()
    mine = [(i, [j for j in chunk if j.key not in done]) for i, chunk in enumerate(chunks(plan.jobs, shard_size))
            if i % world.size == world.rank]
    mine = [(i, jobs) for i, jobs in mine if jobs]
    label = "regenerating" if world.size == 1 else f"regenerating (rank 0 of {world.size})"
    # prompts answered at once: the engine's batch or requests in flight, within one shard's chunk
    in_flight = min(shard_size, getattr(engine, "batch_size", None) or getattr(engine, "concurrency", None) or 1)
    progress = Progress(sum(len(jobs) for _, jobs in mine), show=world.rank == 0, label=label, in_flight=in_flight)
    interruptible, stop.interruptible = stop.interruptible, False  # from here a signal waits for the shard
    try:
        for index, jobs in mine:
            if stop():
                break
            finished: list[dict] = []
            try:
                answer_chunk(engine, rows, tokenizer, jobs, sampling, chat_kwargs, max_context, progress, stats,
                             finished, stop)
            except BaseException:
                if finished:  # keep what is answered: the next run skips it
                    out.write_shard(index, _in_order(finished, jobs))
                    stats.shards += 1
                    log(f"wrote the {len(finished)} answered rows of the interrupted chunk {index}")
                raise
            if finished:  # all of the chunk, or what a stop left of it
                out.write_shard(index, _in_order(finished, jobs))
                stats.shards += 1
    finally:
        progress.close()
        stats.seconds = time.perf_counter() - stats.started
        stop.interruptible = interruptible
    if stop():
        raise Stopped(stop.signal_name, stats)
    return stats


def _in_order(finished: list[dict], jobs: list[Job]) -> list[dict]:
    """Rows in the chunk's job order, whatever order the engine answered in (shards are reproducible)."""
    position = {j.key: n for n, j in enumerate(jobs)}
    return sorted(finished, key=lambda r: position[r["regen"]["key"]])


def regenerate_rows(engine, rows, tokenizer, sampling: Sampling, chat_kwargs: dict | None = None) -> list[dict]:
    """Answer source rows in memory (no output directory): one training row per source row, in source
    order; a repeated prompt is answered once and its row repeated; rows without a user turn are left out."""
    from .plan import make_plan

    chat_kwargs = chat_kwargs or {}
    plan = make_plan(rows, tokenizer, sampling, chat_kwargs)
    finished: list[dict] = []
    answer_chunk(engine, rows, tokenizer, plan.jobs, sampling, chat_kwargs, None, None, RunStats(), finished)
    by_key = {r["regen"]["key"]: r for r in finished}
    order = sorted([(j.index, j.key) for j in plan.jobs] + list(plan.duplicates.items()))
    return [by_key[key] for _, key in order]
