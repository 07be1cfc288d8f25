"""One answer (token ids, text, how it ended) and the training row a job's answers make.

A row is exactly what data.train takes: `input_ids` (prompt rendered by the chat template + the answer
tokens the target produced, its stop token included), `loss_mask` (1 on the answer tokens), plus the
conversation with the new answers (`messages`, and `tools` where the source row has them), the source
row's `id`, and `regen` (resume key and per-answer statistics for the summary: length, truncated,
roundtrip, and `answer_ids`: "generated" when the ids are the tokens the target generated, "retokenized"
when a server sent text only).
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import Job


@dataclass
class Request:
    job: Job
    turn: int  # which answer of the job (0: the first slot)
    messages: list[dict]  # the conversation up to this answer (what an OpenAI server renders)
    prompt: list[int]  # the same rendered locally with the target's chat template
    seed: int
    tools: list[dict] | None = None  # the row's tool definitions, rendered into `prompt` (an OpenAI server: sent)


GENERATED = "generated"  # the answer's ids are the tokens the target generated
RETOKENIZED = "retokenized"  # the server sent text only: its ids are the text re-tokenized (+ the stop token)


@dataclass
class Answer:
    ids: list[int]  # the answer's token ids, its stop token included when it stopped
    text: str  # the answer as text (the assistant turn's content)
    truncated: bool  # ended at --max-new-tokens without a stop token
    roundtrip: bool  # the ids agree with the text (see answer_from_ids / answer_from_text)
    prompt_matches: bool = True  # False: the server says it rendered other prompt tokens than ours
    ids_source: str = GENERATED  # GENERATED or RETOKENIZED


def answer_from_ids(tokenizer, ids: list[int], stop_ids: list[int]) -> Answer:
    """An answer generated in-process: the ids are the truth, the text is their decoding; roundtrip: the
    tokenizer turns the text back into the same ids (stop token aside)."""
    stopped = bool(ids) and ids[-1] in stop_ids
    body = ids[:-1] if stopped else ids
    text = tokenizer.decode(body, skip_special_tokens=False)
    roundtrip = tokenizer(text, add_special_tokens=False)["input_ids"] == body
    return Answer(list(ids), text, truncated=not stopped, roundtrip=roundtrip)


def answer_from_text(tokenizer, text: str, finish_reason: str | None, stop_ids: list[int],
                     server_ids: list[int] | None = None, prompt_matches: bool = True,
                     completion_tokens: int | None = None, stop_reason=None) -> Answer:
    """An answer a server returned: its token ids when it sent them, else the text re-tokenized (+ the stop token).

    Truncated exactly when the server says so (finish_reason "length"); the text's length in tokens decides
    nothing. The stop token appended to a stopped answer is the one the server names as its stop_reason
    (vLLM) when that is one of `stop_ids`, else the first of them. Re-tokenized ids round-trip when they are
    as many as the server generated (its usage.completion_tokens, the stop token included), or when it does
    not say.
    """
    stopped = finish_reason != "length"
    stop = next((t for t in stop_ids if stop_reason in (t, tokenizer.convert_ids_to_tokens(t))), None) \
        if stop_reason is not None else None
    stop = stop if stop is not None else (stop_ids[0] if stop_ids else None)
    if server_ids is not None:
        ids = list(server_ids)
        if stopped and stop is not None and (not ids or ids[-1] not in stop_ids):
            ids.append(stop)
        body = ids[:-1] if stopped and ids and ids[-1] in stop_ids else ids
        roundtrip = tokenizer.decode(body, skip_special_tokens=False) == text
        return Answer(ids, text, truncated=not stopped, roundtrip=roundtrip, prompt_matches=prompt_matches)
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = body + ([stop] if stopped and stop is not None else [])
    roundtrip = completion_tokens is None or completion_tokens == len(ids)
    return Answer(ids, text, truncated=not stopped, roundtrip=roundtrip, prompt_matches=prompt_matches,
                  ids_source=RETOKENIZED)


def assemble_row(job: Job, conversation: list[dict], slots: list[int], prompts: list[list[int]],
                 answers: list[Answer], tools: list[dict] | None = None) -> dict:
    """The training row of a job whose first len(answers) slots are answered; the row's `tools` are kept
    beside its messages (the prompts were rendered with them).

    Earlier answers stay supervised when each later prompt starts with the tokens so far (the template
    renders earlier turns as they were generated); otherwise the row restarts at that prompt, and the
    earlier answers are context only (counted as all_turns_supervised = False).
    """
    ids: list[int] = []
    mask: list[int] = []
    all_supervised = True
    for prompt, answer in zip(prompts, answers):
        if ids and prompt[: len(ids)] == ids:
            mask += [0] * (len(prompt) - len(ids))
        else:
            all_supervised = all_supervised and not ids
            mask = [0] * len(prompt)
        ids = list(prompt) + answer.ids
        mask += [1] * len(answer.ids)
    messages = [dict(m) for m in conversation[: slots[len(answers) - 1] + 1]]
    for slot, answer in zip(slots, answers):
        messages[slot] = {"role": "assistant", "content": answer.text}
    return {
        "id": job.source_id,
        "messages": messages,
        **({"tools": tools} if tools else {}),
        "input_ids": ids,
        "loss_mask": mask,
        "regen": {
            "key": job.key,
            "answer_tokens": [len(a.ids) for a in answers],
            "truncated": [a.truncated for a in answers],
            "roundtrip": [a.roundtrip for a in answers],
            "answer_ids": [a.ids_source for a in answers],
            "prompt_matches": all(a.prompt_matches for a in answers),
            "all_turns_supervised": all_supervised,
        },
    }
