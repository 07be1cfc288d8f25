"""Prompts from the sources users train on and serve: what regeneration answers and evaluation decodes.

A source row is a chat (`messages` / `conversations`, as data.train takes them) or a single prompt (a
`prompt` or `question` field, as benchmark sets such as GSM8K or MT-Bench exports carry). The prompt of
a chat is the conversation up to its last user turn; `user_turns` lists every user turn, for
regenerating multi-turn data turn by turn. Prompts are rendered with the target tokenizer's own chat
template, the row's `tools` and a generation prompt, exactly as a serving engine renders them.
`answer_slots` marks the assistant turns regeneration writes: the final answer, or with turns="all" every
assistant answer in order; assistant tool calls and tool results stay in the conversation as context
(never rewritten).
"""

from __future__ import annotations

from .rows import DataError, normalise_messages

PROMPT_FIELDS = ("prompt", "question")
CHAT_FIELDS = ("messages", "conversations")


class NoPromptField(DataError):
    """A row with none of the fields a prompt comes from."""


def row_messages(row: dict) -> list[dict]:
    """A source row as [{role, content, ...}]: its chat (data/rows.py's normalise_messages: the trainer's
    rules and refusals), or its prompt field as one user turn."""
    if row.get("messages") or row.get("conversations"):
        return normalise_messages(row)
    for name in PROMPT_FIELDS:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return [{"role": "user", "content": value}]
    empty = [name for name in CHAT_FIELDS if row.get(name) is not None]
    if empty:  # `"messages": []`: a chat row without turns, not a row of another kind
        raise DataError(f"'{empty[0]}' holds no turns (an empty list)")
    raise NoPromptField(f"row has none of 'messages', 'conversations', {', '.join(map(repr, PROMPT_FIELDS))}: "
                        f"keys {sorted(row)}")


def user_turns(messages: list[dict]) -> list[int]:
    """Indices of the user turns, in order."""
    return [i for i, m in enumerate(messages) if m["role"] == "user"]


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """The conversation up to and including its last user turn; None when it has no user turn."""
    turns = user_turns(messages)
    return messages[: turns[-1] + 1] if turns else None


def is_tool_call(message: dict) -> bool:
    """An assistant turn that calls tools (OpenAI `tool_calls`; its content may be empty)."""
    return message["role"] == "assistant" and bool(message.get("tool_calls"))


def is_answer(message: dict) -> bool:
    """An assistant turn of text only: what regeneration rewrites."""
    return message["role"] == "assistant" and not message.get("tool_calls")


ENDS_WITH_TOOL_CALL = ("an assistant tool call after the last user or tool turn, with no tool result to answer: tool "
                       "calls are kept as context, never regenerated")


class EndsWithToolCall(DataError):
    """The conversation's last answer is a tool call: no slot for the target's answer."""


def answer_slots(messages: list[dict], turns: str = "last") -> list[dict] | None:
    """The conversation the target answers, with the turns to write as assistant turns whose content is None.

    It runs up to its last user or tool turn (everything before it, assistant tool calls and tool results
    included, is the prompt), then one slot for the answer: the turns after it were the source's own
    answer. With turns="all" every assistant answer (text, not a tool call) between the first user turn and
    there is a slot too; they are answered in order, each prompt holding the target's own earlier answers.
    Assistant tool-call turns are context, never slots. None when there is no user turn; EndsWithToolCall
    when a tool call follows the last user or tool turn (the source's answer is a call, not text).
    """
    if turns not in ("last", "all"):
        raise ValueError(f"turns={turns!r}: use 'last' or 'all'")
    users = user_turns(messages)
    if not users:
        return None
    end = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool")) + 1
    if any(is_tool_call(m) for m in messages[end:]):
        raise EndsWithToolCall(ENDS_WITH_TOOL_CALL)
    head = [dict(m) for m in messages[:end]]
    if turns == "all":
        for i in range(users[0] + 1, len(head)):
            if is_answer(head[i]):
                head[i]["content"] = None
    return head + [{"role": "assistant", "content": None}]


def tool_call_turns(conversation: list[dict]) -> int:
    """Assistant tool-call turns in a conversation: context the target does not rewrite."""
    return sum(is_tool_call(m) for m in conversation)


def slot_indices(conversation: list[dict]) -> list[int]:
    """Positions of the assistant turns still to be written (content None), in order."""
    return [i for i, m in enumerate(conversation) if m["role"] == "assistant" and m["content"] is None]


def row_id(row: dict, index: int) -> str:
    """The source row's own id when it has one, else its position in the source."""
    for name in ("id", "question_id", "uid"):
        if row.get(name) not in (None, ""):
            return str(row[name])
    return str(index)


def check_chat_template(tokenizer, target: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"the tokenizer of {target} has no chat template: prompts cannot be rendered the way a "
                        "serving engine renders them. Use the target's chat (instruct) checkpoint, or add a "
                        "chat_template to its tokenizer_config.json")


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
    """Token ids of the conversation with the assistant's generation prompt appended; `tools`: the row's tool
    definitions (data/rows.py's row_tools), which the template renders as a server renders a request's."""
    if tools:
        template_kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
