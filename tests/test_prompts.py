"""Prompts from chat rows and prompt/question rows, rendered with the target's chat template and the row's
tool definitions."""

import json

import pytest
from dflash_trainer.data.prompts import (
    NoPromptField,
    check_chat_template,
    prompt_messages,
    render_prompt,
    row_id,
    row_messages,
    user_turns,
)
from dflash_trainer.data.rows import BAD_TOOLS, DataError, row_tools
from transformers import AutoTokenizer


def test_chat_rows_prompt_rows_and_rows_without_either():
    chat = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                              {"from": "human", "value": "and?"}, {"from": "gpt", "value": "so"}]}
    messages = row_messages(chat)
    assert user_turns(messages) == [0, 2]
    assert prompt_messages(messages) == messages[:3]
    assert row_messages({"question": "2+2?"}) == [{"role": "user", "content": "2+2?"}]
    assert row_messages({"prompt": "Write a poem", "question": "ignored"})[0]["content"] == "Write a poem"
    assert prompt_messages([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]) is None
    with pytest.raises(DataError, match="none of 'messages', 'conversations', 'prompt', 'question'"):
        row_messages({"text": "x", "prompt": "  "})


def test_row_ids():
    assert row_id({"id": 7}, 3) == "7" and row_id({"question_id": "q1"}, 3) == "q1" and row_id({}, 3) == "3"


def test_render_matches_the_chat_template_and_a_missing_template_is_named(tiny_target, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_target["target"])
    ids = render_prompt(tok, [{"role": "user", "content": "What is 2 plus 3?"}])
    assert tok.decode(ids) == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    check_chat_template(tok, "t")
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        check_chat_template(tok, tiny_target["target"])


def test_prompt_sources_are_classified_as_data_py_does_and_errors_name_the_flag(tmp_path, monkeypatch):
    from dflash_trainer.data.prompt_sets import default_name, is_local, load_source
    from dflash_trainer.infra import hub

    monkeypatch.setattr(hub, "offline", lambda: True)
    monkeypatch.chdir(tmp_path)
    assert is_local("../gsm8k") and is_local("data/[ab].jsonl") and is_local("sets/*")
    assert not is_local("openai/gsm8k:main@test") and not is_local("openai/gsm8k@test")
    assert default_name("openai/gsm8k:main@test") == "gsm8k" and default_name("data/gsm8k.jsonl.gz") == "gsm8k"
    with pytest.raises(DataError, match=r"prompt file \.\./gsm8k does not exist: fix the path given to --prompts"):
        load_source("../gsm8k")  # a path, not a hub name: no hub is asked
    with pytest.raises(DataError, match=r"hub is switched off .*fix the path in --prompts / --name"):
        load_source("owner/missing@test")


def test_a_chat_row_without_turns_says_so_and_tool_turns_are_kept():
    with pytest.raises(DataError, match=r"^'messages' holds no turns \(an empty list\)$") as caught:
        row_messages({"messages": [], "text": "x"})
    assert not isinstance(caught.value, NoPromptField)  # a chat row, not a row of another kind
    assert row_messages({"messages": [], "question": "2+2?"}) == [{"role": "user", "content": "2+2?"}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    turns = row_messages({"messages": [{"role": "user", "content": "2+2?"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "4"}]})
    assert turns[1] == {"role": "assistant", "content": "", "tool_calls": [call]} and turns[2]["role"] == "tool"


ADD = {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {}}}


def test_a_rows_tools_in_every_form_people_give_them():
    openai = [{"type": "function", "function": ADD}]
    assert row_tools({"tools": openai}) == openai
    assert row_tools({"tools": json.dumps([ADD])}) == openai  # LLaMA-Factory: JSON text of bare function schemas
    assert row_tools({"tools": [ADD]}) == openai
    # `datasets` fills the keys other rows of the file have with None: the row's own definition is what it set
    padded = [{"type": "function", "function": {**ADD, "strict": None}, "extra": None}]
    assert row_tools({"tools": padded}) == openai
    for none in (None, "", "  ", [], "[]", "null"):
        assert row_tools({"tools": none}) is None and row_tools({}) is None
    for bad in ("add, mul", {"name": "add"}, json.dumps({"name": "add"}), ["add"], [{"description": "no name"}],
                [{"type": "function", "function": "add"}], 3):
        with pytest.raises(DataError) as caught:
            row_tools({"tools": bad})
        assert str(caught.value) == BAD_TOOLS
    assert "drop the row's tools" in BAD_TOOLS and '{"type": "function", "function": {name,' in BAD_TOOLS


def test_render_prompt_gives_the_template_the_rows_tools(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target["target"])
    plain = render_prompt(tok, [{"role": "user", "content": "What is 2 plus 3?"}])
    tok.chat_template = ("{% if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]{% endif %}"
                         + tok.chat_template)
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    assert tok.decode(render_prompt(tok, messages, row_tools({"tools": json.dumps([ADD])}))) == \
        "[tools: add]<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, messages, None) == render_prompt(tok, messages, []) == plain
