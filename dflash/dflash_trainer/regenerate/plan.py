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

from ..data.prompts import answer_slots, render_prompt, row_id, row_messages, slot_indices
from ..data.rows import DataError
from .sampling import Sampling

NO_USER_TURN = "no user turn"
NO_CHAT = "neither messages/conversations nor a prompt/question field"
TEMPLATE_REFUSED = "the chat template refused the conversation"
TOO_LONG = "prompt + --max-new-tokens longer than the target's context"
DUPLICATE = "same prompt as an earlier row"
# What rendering raises when a template refuses a conversation (its raise_exception(), bad roles, ...)
TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError)


@dataclass
class Job:
    key: str
    index: int  # the row's position in the source: its conversation is read again when its chunk runs
    source_id: str
    first_prompt: array  # token ids of the first answer's prompt (int32: 800 K prompts fit in memory)


@dataclass
class Plan:
    jobs: list[Job]  # sorted by first-prompt length, then key
    rows_read: int
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    first_error: dict = field(default_factory=dict)  # reason -> the first such row's message
    duplicates: dict = field(default_factory=dict)  # source index -> key of the earlier row with that prompt


def conversation_of(row: dict, turns: str) -> list[dict] | None:
    """The source row as a conversation with answer slots (None: no user turn); DataError: not a chat row."""
    return answer_slots(row_messages(row), turns)


def job_key(first_prompt, conversation: list[dict], sampling: Sampling, chat_kwargs: dict) -> str:
    """Hash of the first prompt's tokens, what follows it (later user turns) and the sampling settings."""
    first = slot_indices(conversation)[0]
    payload = json.dumps({"prompt": list(first_prompt), "after": conversation[first:], "sampling": sampling.as_dict(),
                          "chat_template_kwargs": chat_kwargs}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def make_plan(rows, tokenizer, sampling: Sampling, chat_kwargs: dict, limit: int | None = None,
              max_context: int | None = None) -> Plan:
    total = len(rows) if limit is None else min(limit, len(rows))
    plan = Plan(jobs=[], rows_read=total)
    seen: set[str] = set()

    def skip(reason: str, detail: str) -> None:
        plan.skipped[reason] += 1
        plan.first_error.setdefault(reason, detail)

    source = islice(iter(rows), total)  # a datasets.Dataset reads batches when iterated, not row by row
    for index, row in enumerate(tqdm(source, total=total, desc="reading prompts", unit="row",
                                     disable=not sys.stderr.isatty(), leave=False)):
        try:
            conversation = conversation_of(row, sampling.turns)
        except DataError as exc:
            skip(NO_CHAT, f"row {index}: {exc}")
            continue
        if conversation is None:
            skip(NO_USER_TURN, f"row {index} ({row_id(row, index)})")
            continue
        first = slot_indices(conversation)[0]
        try:
            prompt = render_prompt(tokenizer, conversation[:first], **chat_kwargs)
        except TEMPLATE_ERRORS as exc:
            skip(TEMPLATE_REFUSED, f"row {index}: {exc.__class__.__name__}: {exc}")
            continue
        if max_context is not None and len(prompt) + sampling.max_new_tokens > max_context:
            skip(TOO_LONG, f"row {index}: {len(prompt)} prompt tokens + {sampling.max_new_tokens} > {max_context}")
            continue
        key = job_key(prompt, conversation, sampling, chat_kwargs)
        if key in seen:
            skip(DUPLICATE, f"row {index}")
            plan.duplicates[index] = key
            continue
        seen.add(key)
        plan.jobs.append(Job(key, index, row_id(row, index), array("i", prompt)))
    plan.jobs.sort(key=lambda j: (len(j.first_prompt), j.key))
    return plan


def check_plan(plan: Plan, sources) -> None:
    """Skipped rows are counted, not fatal, unless none is left."""
    if plan.jobs:
        return
    if plan.rows_read == 0:
        raise DataError(f"{sources} holds no rows")
    reasons = "; ".join(f"{n} x {reason} (first: {plan.first_error[reason]})" for reason, n in plan.skipped.items())
    raise DataError(f"no row of {sources} can be answered: {reasons}. Regeneration needs chat rows "
                    "(messages / conversations) or prompt/question rows with a user turn")


def chunks(jobs: list[Job], size: int) -> list[list[Job]]:
    return [jobs[i : i + size] for i in range(0, len(jobs), size)]
