"""The data people have: JSON arrays, JSON lines, parquet, Arrow and CSV files; OpenAI content parts, tool
calls and tool turns, a row's tool definitions, LLaMA-Factory's ShareGPT function_call and observation turns,
reasoning fields; refused rows counted with their row numbers; unreadable files named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import datasets
import pytest
from dflash_trainer.data.prompt_sets import load_prompt_set
from dflash_trainer.data.rows import (
    BAD_FUNCTION_CALL,
    BAD_TOOLS,
    DataError,
    load_rows,
    normalise_messages,
    pretokenized,
    tokenize_dataset,
)
from dflash_trainer.train import main
from transformers import AutoTokenizer

CHATS = [[{"role": "user", "content": f"What is {n} plus {n}?"},
          {"role": "assistant", "content": f"{n} plus {n} is {2 * n}, as adding {n} twice gives {2 * n}."}]
         for n in range(1, 9)]
# A chat template that renders the tools it is given, tool calls (arguments as text or an object, as Qwen3's),
# tool turns and reasoning (as Qwen3's and DeepSeek-R1's do).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}({{ c.function.arguments if "
    "c.function.arguments is string else c.function.arguments | tojson }})</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADD = {"name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
MUL = {"name": "mul", "description": "Multiply two numbers", "parameters": {"type": "object", "properties": {}}}
# LLaMA-Factory's ShareGPT with tools: the definitions as JSON text of bare function schemas, the call as JSON
SHAREGPT_TOOLS = {"conversations": [{"from": "human", "value": "What is 2 plus 2?"},
                                    {"from": "function_call", "value": json.dumps({"name": "add",
                                                                                   "arguments": {"a": 2, "b": 2}})},
                                    {"from": "observation", "value": "4"},
                                    {"from": "gpt", "value": "2 plus 2 is 4."}],
                  "tools": json.dumps([ADD, MUL])}


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target["target"])


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def write(path: Path, rows: list[dict]) -> str:
    """rows in the format path's suffix names, written by that format's own writer."""
    suffix = "".join(path.suffixes)
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif suffix == ".csv":  # a CSV column holds the turns as JSON text
        datasets.Dataset.from_list([{"messages": json.dumps(r["messages"])} for r in rows]).to_csv(path, index=False)
    elif suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(path)
    elif suffix == ".arrow":
        saved = path.with_suffix(".saved")
        datasets.Dataset.from_list(rows).save_to_disk(saved)
        next(saved.glob("*.arrow")).rename(path)
    return str(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".arrow", ".csv"])
def test_every_format_trains_on_the_same_tokens(suffix, tokenizer, tmp_path):
    rows = [{"messages": c} for c in CHATS]
    reference = tokenize_dataset(load_rows([write(tmp_path / "ref.jsonl", rows)]), tokenizer, 128)
    loaded = load_rows([write(tmp_path / f"chats{suffix}", rows)])
    assert len(loaded) == len(CHATS)
    ds = tokenize_dataset(loaded, tokenizer, 128)
    assert ds["input_ids"] == reference["input_ids"] and ds["loss_mask"] == reference["loss_mask"]


def test_a_file_named_like_a_glob_is_that_file_and_a_glob_still_expands(tokenizer, tmp_path):
    rows = [{"messages": c} for c in CHATS]
    literal = write(tmp_path / "mt[bench].jsonl", rows[:3])
    assert len(load_rows([literal])) == 3
    assert len(load_prompt_set("mt", literal, tokenizer, "tiny", None, 400, len(tokenizer)).prompts) == 3
    for i in range(2):
        write(tmp_path / f"part-{i}.jsonl", rows[4 * i:4 * i + 4])
    assert len(load_rows([str(tmp_path / "part-*.jsonl")])) == 8


def test_a_prompt_set_names_the_rows_it_skips(tokenizer, tmp_path, capsys):
    rows = [{"messages": c} for c in CHATS[:3]]
    rows.insert(1, {"messages": [{"role": "assistant", "content": "an answer with no question"}]})
    found = load_prompt_set("p", write(tmp_path / "p.jsonl", rows), tokenizer, "tiny", None, 400, len(tokenizer))
    assert len(found.prompts) == 3 and found.skipped == {"no user turn": [2]}
    said = capsys.readouterr().err
    assert "prompt set 'p'" in said and "1 row(s) skipped: 1 x no user turn (row 2)" in said


def test_prompt_sets_read_parquet_and_csv_too(tokenizer, tmp_path):
    for suffix in (".parquet", ".csv"):
        found = load_prompt_set("p", write(tmp_path / f"p{suffix}", [{"messages": c} for c in CHATS]), tokenizer,
                                "tiny", None, 400, len(tokenizer))
        assert len(found.prompts) == len(CHATS)


@pytest.mark.parametrize("name, content", [("bad.parquet", b"PAR1 not really a parquet file"),
                                           ("bad.jsonl", bytes(range(128, 256)) * 4),
                                           ("bad.arrow", b"\x00\x01 not arrow")])
def test_a_file_that_cannot_be_read_is_named_with_the_fix(name, content, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"data file {path} cannot be read as .*give it the suffix of its format"):
        load_rows([str(path)])


def test_dflash_train_exits_2_naming_an_unreadable_parquet(tiny_target, tmp_path, capsys):
    bad = tmp_path / "chats.parquet"
    bad.write_bytes(b"PAR1" + bytes(range(256)))
    code = main(["--config", "embedded", "--output-dir", str(tmp_path / "out"), "--set",
                 f"target.path={tiny_target['target']}", "--set", f"data.train={json.dumps([str(bad)])}"])
    assert code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"data file {bad} cannot be read as a parquet file" in said and "UnicodeDecodeError" not in said


def test_openai_content_parts_are_joined_and_other_parts_refused_by_row(tokenizer, tmp_path, capfd):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2 plus 2?"},
                                          {"type": "text", "text": "Answer briefly."}]},
             {"role": "assistant", "content": [{"type": "text", "text": "2 plus 2 is 4, as adding 2 twice."}]}]
    assert normalise_messages({"messages": parts})[0]["content"] == "What is 2 plus 2?\nAnswer briefly."
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
    rows = [{"messages": c} for c in CHATS[:3]] + [{"messages": parts}, {"messages": image},
                                                    {"messages": CHATS[3]}, {"messages": image}]
    ds = tokenize_dataset(load_rows([write(tmp_path / "parts.jsonl", rows)]), tokenizer, 128)
    assert len(ds) == 5
    said = capfd.readouterr().err
    assert "5 of 7 rows used, 2 refused: 2 x content part of type 'image_url'" in said
    assert "(rows 5, 7)" in said


def test_tool_calls_and_tool_turns_are_rendered_by_the_chat_template(tool_tokenizer, tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    chat = [{"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"},
            {"role": "assistant", "content": "2 plus 2 is 4."}]
    ds = tokenize_dataset(load_rows([write(tmp_path / "tools.jsonl", [{"messages": chat}] * 2)]), tool_tokenizer, 256)
    ids, mask = ds[0]["input_ids"], ds[0]["loss_mask"]
    text = tool_tokenizer.decode(ids)
    assert '<tool_call>add({"a": 2, "b": 2})</tool_call>' in text and "<|im_start|>tool\n4<|im_end|>" in text
    trained = tool_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "add(" in trained and "2 plus 2 is 4." in trained and "tool\n4" not in trained  # the tool's reply is input


@pytest.mark.parametrize("setting", ["keep", "drop"])
def test_reasoning_is_kept_or_dropped_as_set(setting, tool_tokenizer, tmp_path):
    chat = [{"role": "user", "content": "What is 3 plus 3?"},
            {"role": "assistant", "reasoning_content": "three and three make six", "content": "It is 6."}]
    ds = tokenize_dataset(load_rows([write(tmp_path / "think.jsonl", [{"messages": chat}])]), tool_tokenizer, 256,
                          reasoning=setting)
    text = tool_tokenizer.decode(ds[0]["input_ids"])
    assert ("<think>three and three make six</think>" in text) == (setting == "keep")
    assert "It is 6." in text


def test_a_source_of_refused_rows_only_names_the_reasons(tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}] * 3
    with pytest.raises(DataError, match=r"all 3 refused: 3 x content part of type 'input_audio'.*\(rows 1, 2, 3\)"):
        tokenize_dataset(load_rows([write(tmp_path / "audio.jsonl", rows)]), tokenizer, 128)


def trained_text(tokenizer, row: dict) -> str:
    return tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])


def test_a_rows_tools_go_to_every_rendering_and_rows_without_render_as_before(tool_tokenizer, tmp_path):
    chat = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "2 plus 2 is 4."},
            {"role": "user", "content": "And 3 times 3?"}, {"role": "assistant", "content": "3 times 3 is 9."}]
    tools = [{"type": "function", "function": ADD}, {"type": "function", "function": MUL}]
    rows = [{"messages": chat, "tools": tools}, {"messages": chat, "tools": []}, {"messages": chat}]
    ds = tokenize_dataset(load_rows([write(tmp_path / "tools.jsonl", rows)]), tool_tokenizer, 256)
    with_tools, empty, without = (tool_tokenizer.decode(r["input_ids"]) for r in ds)
    assert with_tools == "<|im_start|>system\nTools: add mul<|im_end|>\n" + without
    assert empty == without and "Tools:" not in without
    for row in ds:  # every rendering has the tools, so both answers (and only they) are found and trained on
        assert trained_text(tool_tokenizer, row) == "2 plus 2 is 4.<|im_end|>\n3 times 3 is 9.<|im_end|>\n"


def test_llama_factory_function_call_and_observation_turns_and_tools_as_json_text(tool_tokenizer, tmp_path):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    assert normalise_messages(SHAREGPT_TOOLS) == [
        {"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": "2 plus 2 is 4."}]
    parallel = json.dumps([{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "mul", "arguments": {}}])
    turn = normalise_messages({"conversations": [{"from": "function_call", "value": parallel}]})[0]
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["add", "mul"] and turn["role"] == "assistant"

    ds = tokenize_dataset(load_rows([write(tmp_path / "sharegpt.jsonl", [SHAREGPT_TOOLS] * 2)]), tool_tokenizer, 256)
    assert tool_tokenizer.decode(ds[0]["input_ids"]) == (
        "<|im_start|>system\nTools: add mul<|im_end|>\n<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>add({"a": 2, "b": 2})</tool_call><|im_end|>\n'
        "<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n2 plus 2 is 4.<|im_end|>\n")
    assert trained_text(tool_tokenizer, ds[0]) == \
        '<tool_call>add({"a": 2, "b": 2})</tool_call><|im_end|>\n2 plus 2 is 4.<|im_end|>\n'  # the tool's reply is input


def test_bad_tools_and_bad_function_calls_are_refused_by_row_with_the_fix(tool_tokenizer, tmp_path, capfd):
    good = {"messages": CHATS[0]}
    bad_call = {"conversations": [{"from": "human", "value": "What is 2 plus 2?"},
                                  {"from": "function_call", "value": "add(2, 2)"}, {"from": "gpt", "value": "4."}]}
    rows = [good, {**good, "tools": {"name": "add"}}, {**good, "tools": "add, mul"}, good, bad_call,
            {**good, "tools": ["add"]}, {**good, "tools": [{"description": "a tool without a name"}]}]
    ds = tokenize_dataset(load_rows([write(tmp_path / "bad.jsonl", rows)]), tool_tokenizer, 256)
    assert len(ds) == 2
    said = capfd.readouterr().err
    assert f"2 of 7 rows used, 5 refused: 4 x {BAD_TOOLS} (rows 2, 3, 6, 7); 1 x {BAD_FUNCTION_CALL} (row 5)" in said


def test_prompt_sets_render_a_rows_tools(tool_tokenizer, tmp_path):
    rows = [SHAREGPT_TOOLS, {"messages": CHATS[0], "tools": [{"type": "function", "function": MUL}]},
            {"messages": CHATS[1], "tools": "not JSON"}, {"messages": CHATS[2]}]
    found = load_prompt_set("tools", write(tmp_path / "p.jsonl", rows), tool_tokenizer, "tiny", None, 400,
                            len(tool_tokenizer))
    first, second, plain = (tool_tokenizer.decode(p) for p in found.prompts)
    assert first == ("<|im_start|>system\nTools: add mul<|im_end|>\n<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n"
                     "<|im_start|>assistant\n")
    assert second.startswith("<|im_start|>system\nTools: mul<|im_end|>\n<|im_start|>user\nWhat is 1 plus 1?")
    assert plain.startswith("<|im_start|>user\nWhat is 3 plus 3?")
    assert found.skipped == {BAD_TOOLS: [3]}


def test_a_llama_factory_rows_system_field_is_the_first_turn(tool_tokenizer, tmp_path):
    """LLaMA-Factory's ShareGPT rows keep the system prompt in a `system` field beside the turns; a row whose
    conversation opens with its own system turn keeps that one; an empty one adds nothing; a non-string is refused."""
    turns = [{"from": "human", "value": "What is 2 plus 2?"}, {"from": "gpt", "value": "4."}]
    assert normalise_messages({"conversations": turns, "system": "Answer briefly."})[0] == \
        {"role": "system", "content": "Answer briefly."}
    own = [{"from": "system", "value": "Its own."}, *turns]
    assert [m["content"] for m in normalise_messages({"conversations": own, "system": "Other."})][:1] == ["Its own."]
    assert normalise_messages({"conversations": turns, "system": ""})[0]["role"] == "user"
    rows = [{"conversations": turns, "system": "Answer briefly."}, {"conversations": turns, "system": ""},
            {"conversations": turns, "system": ["not", "text"]}]
    ds = tokenize_dataset(load_rows([write(tmp_path / "system.jsonl", rows)]), tool_tokenizer, 256)
    assert len(ds) == 2
    assert tool_tokenizer.decode(ds[0]["input_ids"]).startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                                               "<|im_start|>user\nWhat is 2 plus 2?")
    assert trained_text(tool_tokenizer, ds[0]) == "4.<|im_end|>\n"


def _sharegpt(chat: list[dict]) -> dict:
    return {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                              for m in chat]}


def _parts(chat: list[dict]) -> dict:
    return {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in chat]}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_files_whose_rows_differ_in_shape_train_together_on_each_files_tokens(suffix, tokenizer, tmp_path):
    # OpenAI rows with text content, ShareGPT rows, OpenAI rows with content parts: one file each. datasets reads
    # a list of files with the first one's columns and types; each file's rows must still train as on their own.
    plain = write(tmp_path / f"plain{suffix}", [{"messages": c} for c in CHATS[:3]])
    share = write(tmp_path / f"share{suffix}", [_sharegpt(c) for c in CHATS[3:6]])
    parts = write(tmp_path / f"parts{suffix}", [_parts(c) for c in CHATS[6:]])
    alone = [list(tokenize_dataset(load_rows([f]), tokenizer, 128)["input_ids"]) for f in (plain, share, parts)]
    together = tokenize_dataset(load_rows([plain, share, parts]), tokenizer, 128)
    assert list(together["input_ids"]) == alone[0] + alone[1] + alone[2]
    reference = tokenize_dataset(load_rows([write(tmp_path / "ref.jsonl", [{"messages": c} for c in CHATS])]),
                                 tokenizer, 128)
    assert together["input_ids"] == reference["input_ids"] and together["loss_mask"] == reference["loss_mask"]


def test_regenerated_shards_and_chat_rows_train_together(tokenizer, tmp_path, capfd):
    chats = write(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS[:4]])
    answered = tokenize_dataset(load_rows([write(tmp_path / "more.jsonl", [{"messages": c} for c in CHATS[4:]])]),
                                tokenizer, 128)
    # as dflash-regenerate writes its shards: the messages kept beside the token ids
    shard = write(tmp_path / "part-00000.jsonl", [{"messages": c, "input_ids": i, "loss_mask": m}
                                                  for c, i, m in zip(CHATS[4:], answered["input_ids"],
                                                                     answered["loss_mask"], strict=True)])
    assert pretokenized(load_rows([shard]))  # shards alone need no chat template ...
    assert not pretokenized(load_rows([shard, chats]))  # ... beside chat rows they do
    for files in ([shard, chats], [chats, shard]):
        ds = tokenize_dataset(load_rows(files), tokenizer, 128)
        assert len(ds) == len(CHATS) and "refused" not in capfd.readouterr().err
        assert sorted(ds["input_ids"]) == sorted(
            tokenize_dataset(load_rows([write(tmp_path / "all.jsonl", [{"messages": c} for c in CHATS])]),
                             tokenizer, 128)["input_ids"])


def test_a_chat_file_with_an_input_ids_column_and_no_loss_mask_is_read_as_chats(tokenizer, tmp_path):
    # a tokenized SFT export keeps input_ids / labels beside the messages: the messages are what is trained on
    rows = [{"messages": c, "input_ids": [1, 2, 3], "labels": [1, 2, 3]} for c in CHATS]
    ds = tokenize_dataset(load_rows([write(tmp_path / "sft.jsonl", rows)]), tokenizer, 128)
    reference = tokenize_dataset(load_rows([write(tmp_path / "ref.jsonl", [{"messages": c} for c in CHATS])]),
                                 tokenizer, 128)
    assert ds["input_ids"] == reference["input_ids"]


def test_a_column_of_another_type_in_each_file_is_held_as_json_values(tmp_path):
    a = write(tmp_path / "a.parquet", [{"messages": c} for c in CHATS[:2]])
    b = tmp_path / "b.parquet"
    datasets.Dataset.from_list([{"messages": 7}, {"messages": 8}]).to_parquet(b)
    rows = load_rows([a, str(b)])  # a column of other types in each: held as JSON values, each row as it was
    assert rows[0]["messages"] == CHATS[0] and rows[2]["messages"] == 7


def test_rows_cut_at_max_length_are_counted_with_the_fix(tokenizer, tmp_path, capfd):
    long = [[{"role": "user", "content": "Count to forty."},
             {"role": "assistant", "content": " ".join(str(n) for n in range(1, 41))}]]
    rows = load_rows([write(tmp_path / "mixed.jsonl", [{"messages": c} for c in CHATS[:3] + long * 2])])
    lengths = [len(r) for r in tokenize_dataset(rows, tokenizer, 4096)["input_ids"]]
    limit = max(lengths[:3])  # the short rows fit, the two long ones do not
    assert min(lengths[3:]) > limit
    capfd.readouterr()
    ds = tokenize_dataset(rows, tokenizer, limit)
    assert len(ds) == 5 and max(len(r) for r in ds["input_ids"]) == limit
    said = " ".join(capfd.readouterr().err.split())
    assert (f"2 of the 5 rows used are longer than data.max_length = {limit} tokens (the longest {max(lengths)}) and "
            "are cut to it") in said and "raise data.max_length" in said
    tokenize_dataset(rows, tokenizer, 4096)
    assert "cut" not in capfd.readouterr().err
