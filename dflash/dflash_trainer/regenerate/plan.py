"""What to answer: source rows -> jobs (a conversation with answer slots, its first prompt, its resume key).

A job's key is a hash of its first prompt's token ids, the rest of its conversation and the sampling
settings: running the same command again finds the answered jobs by key and skips them. Jobs are
sorted by prompt length (similar lengths batch without padding) and cut into chunks; chunk i goes to
rank i mod world and becomes one shard, so the shards do not depend on the number of processes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice

from jinja2 import TemplateError
from tqdm import tqdm

from ..data.prompts import (
    NoPromptField,
    answer_slots,
    render_prompt,
    row_id,
    row_messages,
    slot_indices,
    tool_call_turns,
)
from ..data.rows import SHOWN_ROWS, DataError, files_read, row_tools, rows_named
from .sampling import Sampling

# Why a row is skipped. A row that is not a chat row the trainer would take is skipped with the trainer's
# own refusal (data/rows.py: "content part of type 'image_url': ...", ...).
NO_USER_TURN = "no user turn"
NO_CHAT = "neither messages/conversations nor a prompt/question field"
TEMPLATE_REFUSED = "the chat template refused the conversation"
TOO_LONG = "prompt + --max-new-tokens longer than the target's context"
DUPLICATE = "same prompt as an earlier row"
# What answered rows keep without regenerating it
TOOL_CALLS_KEPT = "assistant tool-call turns kept as context (not regenerated)"
# What rendering raises when a template refuses a conversation (its raise_exception(), bad roles, ...)
TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError)


@dataclass
class Job:
    key: str
    index: int  # the row's position in the source: its conversation is read again when its chunk runs
    source_id: str
    first_prompt: array  # token ids of the first answer's prompt (int32: 800 K prompts fit in memory)


@dataclass
class Tally:
    """Rows by reason: how many, and the first SHOWN_ROWS row numbers (1-based, as the trainer names rows)."""

    rows: Counter = field(default_factory=Counter)  # reason -> rows
    first_rows: dict = field(default_factory=dict)  # reason -> their first row numbers
    turns: Counter = field(default_factory=Counter)  # reason -> turns (where a row holds several)

    def add(self, reason: str, number: int, turns: int = 1) -> None:
        self.rows[reason] += 1
        self.turns[reason] += turns
        shown = self.first_rows.setdefault(reason, [])
        if len(shown) < SHOWN_ROWS:
            shown.append(number)

    def rows_named(self, reason: str, files: list[tuple[str, int]] | None = None) -> str:
        """'rows 2, 5, 9, ...' (the first few of the reason's rows; with `files`, each in its file)."""
        return rows_named(self.rows[reason], self.first_rows[reason], files).strip(" ()")

    def as_dict(self, with_turns: bool = False) -> dict:
        """summary.json's form: reason -> {rows, first_rows[, turns]}."""
        return {reason: {"rows": n, **({"turns": self.turns[reason]} if with_turns else {}),
                         "first_rows": self.first_rows[reason]} for reason, n in self.rows.items()}


@dataclass
class Plan:
    jobs: list[Job]  # sorted by first-prompt length, then key
    rows_read: int
    skips: Tally = field(default_factory=Tally)  # rows not answered, by reason
    first_error: dict = field(default_factory=dict)  # reason -> the first such row's detail
    duplicates: dict = field(default_factory=dict)  # source index -> key of the earlier row with that prompt
    kept: Tally = field(default_factory=Tally)  # answered rows' turns not regenerated (tool calls), by reason
    too_long: list = field(default_factory=list)  # [shortest, longest] prompt of the TOO_LONG rows, in tokens
    max_new_tokens: int = 0
    max_context: int | None = None
    files: list | None = None  # the source files and their rows, where several are read and rows are skipped

    @property
    def skipped(self) -> Counter:
        """reason -> rows skipped for it."""
        return self.skips.rows


def conversation_of(row: dict, turns: str) -> list[dict] | None:
    """The source row as a conversation with answer slots (None: no user turn); DataError: not a chat row."""
    return answer_slots(row_messages(row), turns)


def job_key(first_prompt, conversation: list[dict], sampling: Sampling, chat_kwargs: dict) -> str:
    """Hash of the first prompt's tokens, what follows it (later user turns) and the sampling settings."""
    first = slot_indices(conversation)[0]
    payload = json.dumps({"prompt": list(first_prompt), "after": conversation[first:], "sampling": sampling.as_dict(),
                          "chat_template_kwargs": chat_kwargs}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


class _Skip(Exception):
    def __init__(self, reason: str, detail: str | None = None, prompt_tokens: int = 0):
        super().__init__(reason)
        self.reason, self.detail, self.prompt_tokens = reason, detail, prompt_tokens


def _first_prompt(row: dict, tokenizer, sampling: Sampling, chat_kwargs: dict,
                  max_context: int | None) -> tuple[list[dict], list[int]]:
    """The row's conversation with its slots and its first prompt's ids; _Skip says why there are none."""
    try:
        conversation = conversation_of(row, sampling.turns)
        tools = row_tools(row)
    except NoPromptField as exc:
        raise _Skip(NO_CHAT, str(exc).removeprefix("row has ")) from None
    except DataError as exc:  # the trainer's refusal of the row (a non-text content part, ...), as it words it
        raise _Skip(str(exc)) from None
    if conversation is None:
        raise _Skip(NO_USER_TURN)
    first = slot_indices(conversation)[0]
    try:
        prompt = render_prompt(tokenizer, conversation[:first], tools, **chat_kwargs)
    except TEMPLATE_ERRORS as exc:
        raise _Skip(TEMPLATE_REFUSED, f"{exc.__class__.__name__}: {exc}") from None
    if max_context is not None and len(prompt) + sampling.max_new_tokens > max_context:
        raise _Skip(TOO_LONG, prompt_tokens=len(prompt))
    return conversation, prompt


def make_plan(rows, tokenizer, sampling: Sampling, chat_kwargs: dict, limit: int | None = None,
              max_context: int | None = None) -> Plan:
    total = len(rows) if limit is None else min(limit, len(rows))
    plan = Plan(jobs=[], rows_read=total, max_new_tokens=sampling.max_new_tokens, max_context=max_context)
    seen: set[str] = set()

    def skip(reason: str, number: int, detail: str | None = None) -> None:
        plan.skips.add(reason, number)
        if detail:
            plan.first_error.setdefault(reason, detail)

    source = islice(iter(rows), total)  # a datasets.Dataset reads batches when iterated, not row by row
    for index, row in enumerate(tqdm(source, total=total, desc="reading prompts", unit="row",
                                     disable=not sys.stderr.isatty(), leave=False)):
        number = index + 1  # rows are named from 1, as the trainer's data errors name them
        try:
            conversation, prompt = _first_prompt(row, tokenizer, sampling, chat_kwargs, max_context)
        except _Skip as why:
            skip(why.reason, number, why.detail)
            if why.reason == TOO_LONG:
                n = why.prompt_tokens
                plan.too_long = [min(plan.too_long[0], n), max(plan.too_long[1], n)] if plan.too_long else [n, n]
            continue
        key = job_key(prompt, conversation, sampling, chat_kwargs)
        if key in seen:
            skip(DUPLICATE, number)
            plan.duplicates[index] = key
            continue
        seen.add(key)
        if calls := tool_call_turns(conversation):
            plan.kept.add(TOOL_CALLS_KEPT, number, calls)
        plan.jobs.append(Job(key, index, row_id(row, index), array("i", prompt)))
    plan.jobs.sort(key=lambda j: (len(j.first_prompt), j.key))
    plan.files = files_read(rows) if plan.skipped and hasattr(rows, "info") else None
    return plan


def describe_skips(plan: Plan) -> str:
    """'2 x REASON (rows 3, 7; first: DETAIL); ...', most frequent first."""
    parts = []
    for reason, n in plan.skipped.most_common():
        detail = plan.first_error.get(reason)
        parts.append(f"{n} x {reason} ({plan.skips.rows_named(reason, plan.files)}{f'; first: {detail}' if detail else ''})")
    return "; ".join(parts)


def too_long_fix(plan: Plan, target: str) -> str:
    """What lets the TOO_LONG rows be answered, with the numbers: the --max-new-tokens that fits."""
    context, new = plan.max_context, plan.max_new_tokens
    shortest, longest = plan.too_long
    limit = (f"the target's context is {context} tokens (max_position_embeddings in {target}'s config.json), "
             f"these prompts are {shortest}-{longest} tokens and --max-new-tokens is {new}")
    if shortest >= context:
        return f"{limit}: every such prompt fills the context by itself; give shorter prompts or a target with a " \
               "longer context"
    if longest >= context:
        return (f"{limit}: lower --max-new-tokens to at most {context - shortest} for the shortest of them (the "
                "longest fill the context by itself), or give shorter prompts or a target with a longer context")
    return (f"{limit}: lower --max-new-tokens to at most {context - longest} (every such row fits) or "
            f"{context - shortest} (the shortest fits), or give a target with a longer context")


def check_plan(plan: Plan, sources, target: str = "--target") -> None:
    """Skipped rows are counted, not fatal, unless none is left."""
    if plan.jobs:
        return
    if plan.rows_read == 0:
        raise DataError(f"{sources} holds no rows")
    if set(plan.skipped) == {TOO_LONG}:
        raise DataError(f"no row of {sources} can be answered: all {plan.rows_read} are too long: "
                        f"{too_long_fix(plan, target)}")
    fixes = ["Regeneration needs chat rows (messages / conversations) or prompt/question rows with a user turn"]
    if TOO_LONG in plan.skipped:
        fixes.append(f"for the rows too long: {too_long_fix(plan, target)}")
    raise DataError(f"no row of {sources} can be answered: {describe_skips(plan)}. {'; '.join(fixes)}")


def chunks(jobs: list[Job], size: int) -> list[list[Job]]:
    return [jobs[i : i + size] for i in range(0, len(jobs), size)]
