"""dflash-regenerate's inputs and stops: a target the trainer cannot draft for is refused before anything is
written; tool calls and tool results are the prompt's context (never rewritten, counted), a row's tool
definitions are rendered into its prompts and sent to a server, LLaMA-Factory's ShareGPT function_call and
observation turns are read as tool calls and results; every skipped row has its true reason and row
numbers; prompts too long name the --max-new-tokens that fits; SIGTERM and Ctrl-C stop cleanly (exit 0,
what is answered written, resumable); engine openai sends --stop-token and the row's tools, takes "length"
as the one sign of a cut answer, and asks the server for the generated ids when it gives them (a fake
OpenAI-compatible server here; tests/test_regenerate_serve.py runs a real one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from dflash_trainer.data.prompts import (
    ENDS_WITH_TOOL_CALL,
    EndsWithToolCall,
    answer_slots,
    render_prompt,
    row_messages,
    slot_indices,
)
from dflash_trainer.data.rows import BAD_FUNCTION_CALL, BAD_TOOLS, DataError
from dflash_trainer.regenerate.answers import GENERATED, RETOKENIZED, Request, answer_from_text
from dflash_trainer.regenerate.cli import main
from dflash_trainer.regenerate.engine_openai import EndpointError, OpenAIEngine, Refused
from dflash_trainer.regenerate.plan import (
    NO_CHAT,
    NO_USER_TURN,
    TOO_LONG,
    TOOL_CALLS_KEPT,
    Job,
    check_plan,
    make_plan,
)
from dflash_trainer.regenerate.sampling import Sampling
from transformers import AutoTokenizer

from tests.helpers.regenerate import corpus_rows, free_port, shard_files, shard_rows, write_jsonl

# A chat template that renders the tools it is given, tool calls (arguments as text or an object) and tool turns
# (tests/test_data_formats.py's, as Qwen3's does)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}({{ c.function.arguments if "
    "c.function.arguments is string else c.function.arguments | tojson }})</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
TOOL_CHAT = [{"role": "system", "content": "You can add."},
             {"role": "user", "content": "What is 2 plus 2?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "c1", "content": "4"},
             {"role": "assistant", "content": "2 plus 2 is 4."}]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
         {"role": "assistant", "content": "A cat."}]
ADD = {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": ADD}]
# LLaMA-Factory's ShareGPT: tools as JSON text of bare function schemas, the call as JSON, its result an observation
SHAREGPT_TOOLS = {"conversations": [{"from": "human", "value": "What is 2 plus 2?"},
                                    {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 2}}'},
                                    {"from": "observation", "value": "4"},
                                    {"from": "gpt", "value": "2 plus 2 is 4."}],
                  "tools": json.dumps([ADD])}


def args(target, data, out, *extra):
    return ["--target", str(target), "--data", str(data), "--out", str(out), "--max-new-tokens", "12", *extra]


def said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target["target"])


@pytest.fixture(scope="module")
def tool_target(tiny_target, tmp_path_factory):
    """The tiny target with a chat template that renders tool calls and tool turns."""
    path = tmp_path_factory.mktemp("tool-target") / "target"
    shutil.copytree(tiny_target["target"], path)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return path


# ---- 1. a target the trainer cannot draft for ------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_target(tiny_target, tmp_path_factory, tokenizer):
    """A tiny BERT (an encoder, which transformers would still load as a 'causal LM') with the chat tokenizer."""
    from transformers import BertConfig, BertLMHeadModel

    path = tmp_path_factory.mktemp("bert") / "target"
    shutil.copytree(tiny_target["target"], path, ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                                "generation_config.json"))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, is_decoder=True)
    BertLMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("engine", ["hf", "openai"])
def test_a_target_that_is_not_a_decoder_only_causal_lm_is_refused_before_anything_is_written(
        engine, bert_target, tiny_target, tmp_path, capsys):
    out = tmp_path / "out"
    extra = ["--engine", "openai", "--endpoint", f"http://127.0.0.1:{free_port()}/v1", "--retries", "0"] \
        if engine == "openai" else []  # refused before the server is asked (none listens there)
    assert main(args(bert_target, tiny_target["train"], out, *extra)) == 2
    err = said(capsys)
    assert f"--target {bert_target}: BertLMHeadModel (the bert family) has no decoder layer list" in err, err
    assert "give a decoder-only causal LM" in err
    assert not out.exists()


# ---- 2. tool calls and tool results ------------------------------------------------------------------------

def test_tool_calls_and_tool_results_are_context_and_never_slots():
    messages = row_messages({"messages": TOOL_CHAT})
    for turns in ("last", "all"):
        conversation = answer_slots(messages, turns)
        assert conversation[:4] == messages[:4] and slot_indices(conversation) == [4]  # the call and its result stay
    two = messages + [{"role": "user", "content": "And 3 plus 3?"}, {"role": "assistant", "content": "6."}]
    assert slot_indices(answer_slots(two, "all")) == [4, 6] and slot_indices(answer_slots(two, "last")) == [6]
    waiting = messages[:4]  # ends with the tool's result: the answer to it is the slot
    assert answer_slots(waiting, "last") == [*waiting, {"role": "assistant", "content": None}]
    with pytest.raises(EndsWithToolCall, match="tool calls are kept as context, never regenerated"):
        answer_slots(messages[:3], "all")  # the source's answer is the call itself


def test_rows_with_tool_calls_are_answered_after_them_and_what_is_kept_is_counted(tool_target, tmp_path):
    tok = AutoTokenizer.from_pretrained(tool_target)
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT}, {"messages": TOOL_CHAT[:3]},
                                                  *corpus_rows(2)])
    out = tmp_path / "out"
    assert main(args(tool_target, data, out, "--turns", "all")) == 0
    rows = {r["id"]: r for r in shard_rows(out)}
    assert sorted(rows) == ["0", "2", "3"]  # row 2 (id 1) ends with a call: skipped
    row = rows["0"]
    assert row["messages"][:4] == row_messages({"messages": TOOL_CHAT})[:4]
    first = row["loss_mask"].index(1)
    prompt = tok.decode(row["input_ids"][:first])
    assert prompt == tok.decode(render_prompt(tok, row["messages"][:4]))
    assert '<tool_call>add({"a": 2, "b": 2})</tool_call>' in prompt and "<|im_start|>tool\n4<|im_end|>" in prompt
    assert all(row["loss_mask"][first:])  # the answer only is trained on
    summary = json.loads((out / "summary.json").read_text())
    assert summary["not_regenerated"] == {TOOL_CALLS_KEPT: {"rows": 1, "turns": 1, "first_rows": [1]}}
    assert summary["skipped_rows"] == {ENDS_WITH_TOOL_CALL: 1}
    assert summary["skipped_row_numbers"] == {ENDS_WITH_TOOL_CALL: [2]}


def test_a_rows_tools_are_in_its_prompts_and_sharegpt_calls_stay_as_context(tool_target, tmp_path):
    tok = AutoTokenizer.from_pretrained(tool_target)
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT, "tools": TOOLS}, SHAREGPT_TOOLS,
                                                  *corpus_rows(2)])
    out = tmp_path / "out"
    assert main(args(tool_target, data, out)) == 0
    rows = {r["id"]: r for r in shard_rows(out)}
    assert sorted(rows) == ["0", "1", "2", "3"]
    for key in ("0", "1"):
        row = rows[key]
        prompt = tok.decode(row["input_ids"][: row["loss_mask"].index(1)])
        assert prompt.startswith("<|im_start|>system\nTools: add<|im_end|>\n") and row["tools"] == TOOLS
        assert prompt == tok.decode(render_prompt(tok, row["messages"][:-1], row["tools"]))
        assert '<tool_call>add({"a": 2, "b": 2})</tool_call>' in prompt and "<|im_start|>tool\n4<|im_end|>" in prompt
    assert rows["1"]["messages"][1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 2}}
    assert "tools" not in rows["2"] and "Tools:" not in tok.decode(rows["2"]["input_ids"])  # no tools: as before
    summary = json.loads((out / "summary.json").read_text())
    assert summary["not_regenerated"] == {TOOL_CALLS_KEPT: {"rows": 2, "turns": 2, "first_rows": [1, 2]}}


# ---- 3. each skipped row's reason, with its row numbers -----------------------------------------------------

def test_skipped_rows_get_their_true_reason_and_row_numbers(tiny_target, tokenizer, tmp_path, capsys):
    from dflash_trainer.data.rows import load_rows

    rows = [*corpus_rows(2), {"messages": IMAGE}, {"messages": []}, {"text": "no chat"}, {"messages": IMAGE},
            {"messages": [{"role": "system", "content": "only a system turn"}]}]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    plan = make_plan(load_rows([str(data)]), tokenizer, Sampling(max_new_tokens=12), {})
    image = "content part of type 'image_url': only text parts can be trained on (drop the row or its non-text parts)"
    empty = "'messages' holds no turns (an empty list)"
    assert dict(plan.skipped) == {image: 2, empty: 1, NO_CHAT: 1, NO_USER_TURN: 1}
    assert plan.skips.first_rows == {image: [3, 6], empty: [4], NO_CHAT: [5], NO_USER_TURN: [7]}

    out = tmp_path / "out"
    assert main(args(tiny_target["target"], data, out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_rows"] == {image: 2, empty: 1, NO_CHAT: 1, NO_USER_TURN: 1}
    assert summary["skipped_row_numbers"] == {image: [3, 6], empty: [4], NO_CHAT: [5], NO_USER_TURN: [7]}
    err = said(capsys)
    assert f"2 x {image} (rows 3, 6)" in err and f"1 x {empty} (row 4)" in err, err

    only_bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": IMAGE}] * 7)
    assert main(args(tiny_target["target"], only_bad, tmp_path / "o2")) == 2
    assert f"can be answered: 7 x {image} (rows 1, 2, 3, 4, 5, ...)" in said(capsys)
    assert not (tmp_path / "o2").exists()


def test_rows_with_bad_tools_or_a_bad_function_call_are_skipped_with_the_reason(tool_target, tmp_path):
    from dflash_trainer.data.rows import load_rows

    bad_call = {"conversations": [{"from": "human", "value": "What is 2 plus 2?"},
                                  {"from": "function_call", "value": "add(2, 2)"}, {"from": "observation", "value": "4"},
                                  {"from": "gpt", "value": "4."}]}
    good = corpus_rows(1)[0]
    rows = [good, {**good, "tools": "add"}, bad_call, {**good, "tools": {"name": "add"}}, SHAREGPT_TOOLS]
    tok = AutoTokenizer.from_pretrained(tool_target)
    plan = make_plan(load_rows([str(write_jsonl(tmp_path / "bad.jsonl", rows))]), tok, Sampling(max_new_tokens=12), {})
    assert dict(plan.skipped) == {BAD_TOOLS: 2, BAD_FUNCTION_CALL: 1}
    assert plan.skips.first_rows == {BAD_TOOLS: [2, 4], BAD_FUNCTION_CALL: [3]}
    assert [j.index for j in sorted(plan.jobs, key=lambda j: j.index)] == [0, 4]


# ---- 4. prompts too long: the --max-new-tokens that fits -----------------------------------------------------

def test_prompts_too_long_name_the_max_new_tokens_that_fits(tiny_target, tokenizer, tmp_path, capsys):
    rows = corpus_rows(3)
    lengths = [len(render_prompt(tokenizer, r["messages"][:1])) for r in rows]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    context = 512  # the tiny target's max_position_embeddings
    assert main(args(tiny_target["target"], data, tmp_path / "out", "--max-new-tokens", "510")) == 2
    err = said(capsys)
    assert "all 3 are too long" in err and "Regeneration needs chat rows" not in err, err
    assert (f"the target's context is {context} tokens (max_position_embeddings in --target {tiny_target['target']}'s "
            f"config.json), these prompts are {min(lengths)}-{max(lengths)} tokens and --max-new-tokens is 510: "
            f"lower --max-new-tokens to at most {context - max(lengths)} (every such row fits) or "
            f"{context - min(lengths)} (the shortest fits)") in err, err
    assert not (tmp_path / "out").exists()

    plan = make_plan([{"question": "x " * 600}], tokenizer, Sampling(max_new_tokens=8), {}, max_context=context)
    with pytest.raises(DataError, match="every such prompt fills the context by itself; give shorter prompts"):
        check_plan(plan, ["f.jsonl"])
    assert dict(plan.skipped) == {TOO_LONG: 1}


# ---- 5. SIGTERM / Ctrl-C: a clean stop -----------------------------------------------------------------------

@pytest.mark.slow  # two regenerations in processes of their own (~20 s on 2 cores)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_cleanly_writing_what_is_answered_and_the_same_command_resumes(
        sig, tiny_target, tmp_path):
    common = ["--limit", "40", "--shard-size", "2", "--batch-size", "2", "--max-new-tokens", "24"]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dflash_trainer.regenerate", *args(tiny_target["target"], tiny_target["train"], out),
           *common]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    deadline = time.monotonic() + 300
    while not list(out.glob("part-*.jsonl")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    err = " ".join(stderr.split())
    assert proc.returncode == 0, stderr[-3000:]
    written = shard_rows(out)
    assert 2 <= len(written), "stopped after a shard"
    assert f"stopped by {sig.name}: this run answered {len(written)} prompts and wrote" in err, err
    total = int(re.search(rf"{len(written)} of (\d+) prompts are answered in {re.escape(str(out))}\. Run the same "
                          "command to resume", err)[1])
    assert len(written) < total <= 40
    assert not list(out.glob(".*.tmp*")) and not (out / "summary.json").exists()

    assert main([*args(tiny_target["target"], tiny_target["train"], out), *common]) == 0
    reference = tmp_path / "uninterrupted"
    assert main([*args(tiny_target["target"], tiny_target["train"], reference), *common]) == 0

    def answers(d):
        return sorted((r["id"], r["input_ids"]) for r in shard_rows(d))

    assert answers(out) == answers(reference)  # every prompt once, the same answers
    assert json.loads((out / "summary.json").read_text())["prompts"] == total


# ---- 6. engine openai: stop, truncation, token ids -----------------------------------------------------------

def test_an_answer_is_cut_exactly_when_the_server_says_length(tokenizer):
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    body = tokenizer("15, 16, 17, 18.", add_special_tokens=False)["input_ids"]
    # "length" with one token more than the text: once read as a stop token, now cut, as the server says
    cut = answer_from_text(tokenizer, "15, 16, 17, 18.", "length", stop, completion_tokens=len(body) + 1)
    assert cut.truncated and cut.ids == body and not cut.roundtrip
    stopped = answer_from_text(tokenizer, "15, 16, 17, 18.", "stop", stop, completion_tokens=len(body) + 3)
    assert stopped.ids == body + stop and not stopped.truncated and stopped.ids_source == RETOKENIZED
    assert not stopped.roundtrip  # the server generated 2 tokens more than the text re-tokenizes to
    assert answer_from_text(tokenizer, "15, 16, 17, 18.", "length", stop, completion_tokens=len(body)).roundtrip
    assert answer_from_text(tokenizer, "15, 16, 17, 18.", "stop", stop).roundtrip  # no usage: nothing to compare
    kept = answer_from_text(tokenizer, "15, 16, 17, 18.", "stop", stop, server_ids=body + stop)
    assert kept.ids == body + stop and kept.ids_source == GENERATED and kept.roundtrip and not kept.truncated


class FakeServer:
    """An OpenAI-compatible server on localhost that answers every chat with `text`; `token_ids`: it returns the
    generated ids when asked (vLLM), else it refuses the field with 422 (transformers serve)."""

    def __init__(self, tokenizer, text: str, token_ids: bool):
        self.bodies: list[dict] = []
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "tiny"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                if "return_token_ids" in body and not token_ids:
                    return self._send(422, {"detail": "Unexpected fields in the request: {'return_token_ids'}"})
                choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids
                self._send(200, {"choices": [choice], "usage": {"completion_tokens": len(ids)}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_request_carries_stop_tokens(tokenizer):
    engine = OpenAIEngine("http://127.0.0.1:1/v1", "tiny", tokenizer, Sampling(max_new_tokens=8), [5], 1,
                          stop_tokens=["<|im_end|>", "<|endoftext|>"])
    request = Request(Job("k", 0, "0", []), 0, [{"role": "user", "content": "hi"}], [], 0)
    assert engine.request_body(request)["stop"] == ["<|im_end|>", "<|endoftext|>"]
    plain = OpenAIEngine("http://127.0.0.1:1/v1", "tiny", tokenizer, Sampling(max_new_tokens=8), [5], 1)
    assert "stop" not in plain.request_body(request)  # the server's own EOS tokens stop it


@pytest.mark.parametrize("token_ids", [True, False])
def test_the_server_is_asked_for_generated_ids_and_refusing_them_means_retokenized_rows(
        token_ids, tiny_target, tokenizer, tmp_path, capsys):
    server = FakeServer(tokenizer, "The red fox runs every day.", token_ids)
    try:
        data = write_jsonl(tmp_path / "chats.jsonl", corpus_rows(3))
        out = tmp_path / "out"
        assert main(args(tiny_target["target"], data, out, "--engine", "openai", "--endpoint", server.url,
                         "--stop-token", "<|im_end|>")) == 0
    finally:
        server.close()
    err = said(capsys)
    probe, *answered = server.bodies
    assert probe["return_token_ids"] is True and probe["max_tokens"] == 1 and len(answered) == 3
    assert all(b["stop"] == ["<|im_end|>"] for b in answered)
    assert all(b.get("return_token_ids") is (True if token_ids else None) for b in answered)
    rows = shard_rows(out)
    source = GENERATED if token_ids else RETOKENIZED
    assert [r["regen"]["answer_ids"] for r in rows] == [[source]] * 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["answer_ids"] == {GENERATED: 3 * token_ids, RETOKENIZED: 3 * (not token_ids)}
    warning = "does not send the generated token ids: it refuses return_token_ids (HTTP 422"
    assert (err.count(warning) == 1) is (not token_ids), err


def test_the_request_carries_the_rows_tools_and_tool_call_arguments_as_json_text(tool_target, tmp_path):
    tok = AutoTokenizer.from_pretrained(tool_target)
    server = FakeServer(tok, "The red fox runs every day.", token_ids=True)
    try:
        data = write_jsonl(tmp_path / "tools.jsonl", [SHAREGPT_TOOLS, {"messages": TOOL_CHAT, "tools": TOOLS},
                                                      *corpus_rows(1)])
        out = tmp_path / "out"
        assert main(args(tool_target, data, out, "--engine", "openai", "--endpoint", server.url)) == 0
    finally:
        server.close()
    _, *answered = server.bodies
    with_tools = [b for b in answered if "tools" in b]
    assert len(answered) == 3 and len(with_tools) == 2  # the row without tools sends none
    assert all(b["tools"] == TOOLS for b in with_tools)  # the OpenAI form: LLaMA-Factory's bare schemas wrapped
    sharegpt = next(b for b in with_tools if b["messages"][0]["role"] == "user")  # TOOL_CHAT opens with a system turn
    assert sharegpt["messages"][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]  # the API's form: text
    rows = shard_rows(out)
    assert sum(tok.decode(r["input_ids"]).startswith("<|im_start|>system\nTools: add") for r in rows) == 2


def test_a_server_that_parses_out_tool_calls_or_refuses_the_tools_is_told_the_fix(tokenizer, monkeypatch):
    engine = OpenAIEngine("http://127.0.0.1:1/v1", "tiny", tokenizer, Sampling(max_new_tokens=8), [5], 1)
    request = Request(Job("k", 0, "0", []), 0, [{"role": "user", "content": "2+2?"}], [], 0, TOOLS)
    parsed = {"choices": [{"message": {"content": None, "tool_calls": [CALL]}, "finish_reason": "tool_calls"}]}
    monkeypatch.setattr(engine, "_call", lambda *a: parsed)
    with pytest.raises(EndpointError, match=r"parsed a tool call out of an answer .*: pass --extra-body "
                                            r"'\{\"tool_choice\": \"none\"\}'"):
        engine.answer_one(request)

    def refuse(*a):
        raise Refused("http://x/v1 refused the request: HTTP 400: auto tool choice requires --enable-auto-tool-choice",
                      400, "auto tool choice requires --enable-auto-tool-choice")

    monkeypatch.setattr(engine, "_call", refuse)
    with pytest.raises(Refused, match=r"HTTP 400: auto tool choice .*\. The request carried the row's tools: pass "):
        engine.answer_one(request)

    def too_long(*a):  # a refusal about something else keeps its own message
        raise Refused("http://x/v1 refused the request: HTTP 400: the prompt is longer than the context", 400,
                      "the prompt is longer than the context")

    monkeypatch.setattr(engine, "_call", too_long)
    with pytest.raises(Refused) as refused:
        engine.answer_one(request)
    assert "longer than the context" in str(refused.value) and "carried the row's tools" not in str(refused.value)


# ---- resuming on data or a target that changed -----------------------------------------------------------

def test_a_rerun_on_edited_data_answers_the_edit_and_drops_the_stale_answers(tiny_target, tmp_path, capsys):
    rows = corpus_rows(6)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "out"
    assert main(args(tiny_target["target"], data, out, "--shard-size", "2")) == 0
    assert len(shard_rows(out)) == 6
    said(capsys)

    edited = json.loads(json.dumps(rows))
    edited[2]["messages"][0]["content"] += " Answer briefly."  # an edited prompt is a new prompt
    del edited[4]  # a removed one
    write_jsonl(data, edited)
    assert main(args(tiny_target["target"], data, out, "--shard-size", "2")) == 0
    err = said(capsys)
    assert f"dropped 2 answers in {out} to prompts no longer in --data" in err, err
    answered = shard_rows(out)
    prompts = [r["messages"][0]["content"] for r in answered]
    assert len(answered) == 5 and sorted(prompts) == sorted(r["messages"][0]["content"] for r in edited), prompts
    assert json.loads((out / "summary.json").read_text())["prompts"] == 5


def test_a_byte_identical_target_moved_elsewhere_resumes_and_another_is_refused(tiny_target, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", corpus_rows(3))
    moved, out = tmp_path / "moved" / "target", tmp_path / "out"
    shutil.copytree(tiny_target["target"], moved)
    assert main(args(tiny_target["target"], data, out)) == 0
    said(capsys)
    assert main(args(moved, data, out)) == 0
    assert "3 already answered" in said(capsys)

    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))  # another model now
    before = shard_files(out)
    assert main(args(moved, data, out)) == 2
    err = said(capsys)
    assert f"{out} holds answers made differently (target:" in err and "the target's files (config, tokenizer or weights) are not those the answers were made with" in err, err
    assert shard_files(out) == before


def test_training_on_an_unfinished_regeneration_is_said(tiny_target, tmp_path):
    from dflash_trainer.run.loading import unfinished_regenerations

    data = write_jsonl(tmp_path / "data.jsonl", corpus_rows(2))
    out = tmp_path / "out"
    assert main(args(tiny_target["target"], data, out)) == 0
    shards = [str(out / "part-*.jsonl")]
    assert unfinished_regenerations(shards) == []  # finished: its summary is newer than every shard
    summary = (out / "summary.json").read_bytes()
    (out / "summary.json").unlink()  # a run stopped before its summary
    assert unfinished_regenerations(shards) == [(
        f"note: data.train reads {out}, a regeneration that has not finished (1 shards, no summary.json): the prompts "
        "not answered yet are not trained on. Run the same dflash-regenerate command again to finish it (it "
        "resumes), then train")]
    (out / "summary.json").write_bytes(summary)
    shard = next(out.glob("part-*.jsonl"))
    os.utime(shard, (time.time() + 10, time.time() + 10))  # a later run wrote a shard, then stopped
    assert "shards newer than its summary.json" in unfinished_regenerations(shards)[0]


def test_skipped_rows_of_several_files_are_named_in_their_file(tokenizer, tmp_path):
    from dflash_trainer.data.rows import load_rows
    from dflash_trainer.regenerate.plan import describe_skips

    first = write_jsonl(tmp_path / "a.jsonl", corpus_rows(3))
    usr = {"messages": [{"role": "usr", "content": "What is 2 plus 2?"}]}
    system_only = {"messages": [{"role": "system", "content": "only a system turn"}]}
    second = write_jsonl(tmp_path / "b.jsonl", [corpus_rows(4)[3], usr, system_only])
    plan = make_plan(load_rows([str(first), str(second)]), tokenizer, Sampling(max_new_tokens=12), {})
    assert sorted(plan.skips.first_rows.values()) == [[5], [6]]  # numbered over both files
    said = describe_skips(plan)
    assert "1 x a turn's role 'usr' is not a chat role" in said and f"({second} row 2)" in said, said
    assert f"{NO_USER_TURN} ({second} row 3)" in said and "row 5" not in said, said


# ---- 7. engine openai: retries as urllib3's Retry policy makes them -------------------------------------------

class Throttling:
    """A server on localhost that answers /v1/models with `statuses` first (each with Retry-After `after` s), then
    200; it records when each request came. Stops with the test."""

    def __init__(self, statuses: list[int], after: str | None):
        self.hits: list[float] = []
        throttle = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                throttle.hits.append(time.monotonic())
                n = len(throttle.hits)
                status = statuses[n - 1] if n <= len(statuses) else 200
                data = json.dumps({"data": [{"id": "tiny"}]} if status == 200 else {"error": "busy"}).encode()
                self.send_response(status)
                if status != 200 and after is not None:
                    self.send_header("Retry-After", after)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def engine_for(url: str, retries: int, backoff: float) -> OpenAIEngine:
    return OpenAIEngine(url, None, None, Sampling(max_new_tokens=4), [], concurrency=2, retries=retries,
                        backoff=backoff)


def test_the_retry_policy_honours_retry_after_with_jitter_and_retries_posts():
    from dflash_trainer.regenerate.engine_openai import RETRY_STATUS, retry_policy

    policy = retry_policy(5, 1.0)
    assert policy.respect_retry_after_header and policy.backoff_jitter == 1.0 and policy.backoff_factor == 1.0
    assert policy.allowed_methods is None  # POST /chat/completions is retried too
    assert set(policy.status_forcelist) == RETRY_STATUS and policy.total == 5 and not policy.raise_on_status


def test_a_throttled_server_is_retried_until_it_answers():
    server = Throttling([429, 503], after="0")
    try:
        assert engine_for(server.url, retries=3, backoff=0.01).check() == "tiny"
        assert len(server.hits) == 3
    finally:
        server.close()


def test_a_server_that_stays_busy_is_named_with_its_last_answer():
    server = Throttling([503] * 10, after=None)
    try:
        with pytest.raises(EndpointError) as error:
            engine_for(server.url, retries=2, backoff=0.01).check()
        assert len(server.hits) == 3
        assert f"{server.url}/models did not answer after 3 attempts" in str(error.value)
        assert "(last: HTTP 503: {\"error\": \"busy\"})" in str(error.value), str(error.value)
    finally:
        server.close()


@pytest.mark.slow  # waits the second the server asks for
def test_retry_after_is_waited_as_the_server_says():
    server = Throttling([429], after="1")
    try:
        assert engine_for(server.url, retries=2, backoff=0.0).check() == "tiny"
        assert len(server.hits) == 2 and server.hits[1] - server.hits[0] >= 0.95, server.hits
    finally:
        server.close()
