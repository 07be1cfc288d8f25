"""The prompt sets dflash-eval decodes: one set per source, each a list of token-id prompts.

A source is a JSONL file (or glob) or a hub dataset (`owner/name`, `owner/name:config`, either with
`@split`, default `test`). Its rows may be chats (`messages` / `conversations`: the conversation up
to its last user turn), single prompts (`prompt` / `question`), both rendered with the target's chat
template and the row's `tools` (data/prompts.py), or token ids already rendered for this target:
`prompt_ids` (what a training run records in OUTPUT/eval_prompts.jsonl), or `input_ids` + `loss_mask`
rows (training data: the tokens before the first supervised one). Rows without a prompt are skipped and
counted; a source with no usable prompt is an error.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .prompts import NoPromptField, check_chat_template, prompt_messages, render_prompt, row_id, row_messages
from .rows import DATA_SUFFIXES, DataError, describe_refusals, is_local_source, load_rows, row_tools

FLAGS = "--prompts / --name"


@dataclass
class PromptSet:
    name: str
    source: str
    ids: list[str] = field(default_factory=list)  # the source rows' ids (row_id)
    prompts: list[list[int]] = field(default_factory=list)
    skipped: dict[str, list[int]] = field(default_factory=dict)  # why rows were left out -> their row numbers


def is_local(source: str) -> bool:
    """data/rows.py's rule, on the dataset name without its `:config` and `@split`."""
    return Path(source).exists() or source.endswith(DATA_SUFFIXES) or is_local_source(re.split(r"[:@]", source)[0])


def default_name(source: str) -> str:
    """gsm8k.jsonl -> gsm8k; openai/gsm8k:main@test -> gsm8k."""
    if is_local(source):
        name = Path(source).name
        for suffix in sorted(DATA_SUFFIXES, key=len, reverse=True):
            name = name.removesuffix(suffix)
        return name
    return re.split(r"[:@]", source.rsplit("/", 1)[-1])[0]


def name_sources(prompts: list[str], names: list[str]) -> list[tuple[str, str]]:
    """[(set name, source)] from --prompts SOURCE... and --name NAME=SOURCE (which also adds SOURCE)."""
    named: dict[str, str] = {}
    for item in names:
        name, sep, source = item.partition("=")
        if not sep or not name.strip() or not source.strip():
            raise DataError(f"--name {item!r}: expected NAME=SOURCE, e.g. --name gsm8k=data/gsm8k_test.jsonl")
        named[source.strip()] = name.strip()
    sources = list(dict.fromkeys(list(prompts) + [s for s in named if s not in prompts]))
    if not sources:
        raise DataError("no prompts to evaluate on: give --prompts FILE_OR_DATASET (or --name NAME=SOURCE), "
                        "or --run OUTPUT for a training run's held-out prompts")
    pairs = [(named.get(s) or default_name(s), s) for s in sources]
    counts = Counter(n for n, _ in pairs)
    if clash := sorted(n for n, c in counts.items() if c > 1):
        raise DataError(f"several prompt sets would be named {clash}: name them apart with --name NAME=SOURCE")
    return pairs


def load_source(source: str):
    """The source's rows as a `datasets.Dataset`."""
    if is_local(source):
        if not any(ch in source for ch in "*?[") and not Path(source).is_file():
            raise DataError(f"prompt file {source} does not exist: fix the path given to {FLAGS}")
        return load_rows(source, flags=FLAGS)
    name, _, split = source.partition("@")
    name, _, config = name.partition(":")
    if not config:
        return load_rows(name, split=split or "test", flags=FLAGS)
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split or "test")
    except Exception as exc:  # offline hub, unknown name or config: say both
        raise DataError(f"could not load dataset {source!r} ({exc.__class__.__name__}: {exc}); it is neither a "
                        "local file nor a reachable hub dataset") from exc


def row_prompt(row: dict, tokenizer, target: str) -> tuple[list[int] | None, str | None]:
    """(token ids, None) for a usable row, (None, why) otherwise."""
    if row.get("prompt_ids"):
        return list(row["prompt_ids"]), None
    if row.get("input_ids") and row.get("loss_mask") is not None:
        mask = list(row["loss_mask"])
        return (list(row["input_ids"])[: mask.index(1)], None) if 1 in mask else (None, "no supervised token")
    try:
        messages = prompt_messages(row_messages(row))
        tools = row_tools(row)
    except NoPromptField:
        return None, "no prompt field"
    except DataError as exc:  # a turn that is not a chat turn, a content part that is not text: counted by reason
        return None, str(exc)
    if messages is None:
        return None, "no user turn"
    check_chat_template(tokenizer, target)
    return render_prompt(tokenizer, messages, tools), None


def load_prompt_set(name: str, source: str, tokenizer, target: str, limit: int | None,
                    max_prompt_tokens: int, vocab_size: int) -> PromptSet:
    """The first `limit` usable prompts of the source that leave room for the answer in the target's context."""
    rows = load_source(source)
    found = PromptSet(name, source)
    for index, row in enumerate(rows):
        if limit is not None and len(found.prompts) >= limit:
            break
        prompt, why = row_prompt(row, tokenizer, target)
        if prompt is not None and len(prompt) > max_prompt_tokens:
            why = "too long for the target's context"
        elif prompt is not None and not all(0 <= t < vocab_size for t in prompt):  # rendered for another tokenizer
            why = "token ids outside the target's vocabulary"
        if why:
            found.skipped.setdefault(why, []).append(index + 1)  # 1-based row numbers, as the data errors name them
        else:
            found.ids.append(row_id(row, index))
            found.prompts.append(prompt)
    if not found.prompts:
        detail = describe_refusals(found.skipped) or "it has no rows"
        fix = (f"lower --max-new-tokens or give shorter prompts (the target's context leaves {max_prompt_tokens} "
               "tokens for a prompt)" if set(found.skipped) == {"too long for the target's context"}
               else "rows need `messages` / `conversations` with a user turn, a `prompt` or `question` field, "
                    "or `prompt_ids`")
        raise DataError(f"prompt set {name!r} ({source}) holds no usable prompt ({detail}): {fix}")
    if found.skipped:
        print(f"prompt set {name!r} ({source}): {sum(map(len, found.skipped.values()))} row(s) skipped: "
              f"{describe_refusals(found.skipped)}", file=sys.stderr, flush=True)
    return found

