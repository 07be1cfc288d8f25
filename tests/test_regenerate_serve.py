"""Engine openai against a real OpenAI-compatible server: `transformers serve`, started here on localhost
serving the embedded tiny target from its directory, offline. Greedy answers through the server equal the
hf engine's; a model the server does not serve, a refused endpoint and a server that dies mid-run give
errors that name the problem, and every finished shard stays."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from dflash_trainer.regenerate.cli import main

from tests.helpers.regenerate import chat_target as build_chat_target
from tests.helpers.regenerate import corpus_rows, free_port, shard_files, shard_rows, write_jsonl

pytestmark = pytest.mark.slow
MAX_NEW = 40
SERVE = Path(sys.executable).with_name("transformers")


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    return build_chat_target(tmp_path_factory)


class Server:
    """`transformers serve TARGET` on a free localhost port, with the hub switched off."""

    def __init__(self, target: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
        with open(log, "w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [str(SERVE), "serve", target, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                 "--dtype", "float32"], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise AssertionError(f"transformers serve did not come up: {log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def server(chat_target, tmp_path_factory):
    s = Server(chat_target["target"], tmp_path_factory.mktemp("serve") / "serve.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("source") / "chats.jsonl", corpus_rows(16))


def args(target, data, out, *extra):
    return ["--target", target, "--data", str(data), "--out", str(out), "--max-new-tokens", str(MAX_NEW),
            "--shard-size", "4", *extra]


def test_greedy_answers_through_the_server_equal_the_hf_engine(chat_target, server, source, tmp_path, capsys):
    stop = ["--stop-token", "<|im_end|>"]  # sent as the request's `stop` (transformers serve: stop_strings)
    assert main(args(chat_target["target"], source, tmp_path / "hf", "--batch-size", "8", *stop)) == 0
    capsys.readouterr()
    assert main(args(chat_target["target"], source, tmp_path / "openai", "--engine", "openai",
                     "--endpoint", server.url, "--concurrency", "4", *stop)) == 0
    said = " ".join(capsys.readouterr().err.split())
    # transformers serve answers 422 to fields it does not know: the answers' text is re-tokenized, said once
    assert said.count("does not send the generated token ids: it refuses return_token_ids (HTTP 422") == 1, said
    hf, served = shard_rows(tmp_path / "hf"), shard_rows(tmp_path / "openai")
    assert len(served) == len(hf) >= 10
    assert shard_files(tmp_path / "openai").keys() == shard_files(tmp_path / "hf").keys()
    assert [a["id"] for a in hf] == [b["id"] for b in served]
    assert all(a["regen"]["answer_ids"] == ["generated"] for a in hf)
    assert all(b["regen"]["answer_ids"] == ["retokenized"] for b in served)
    # The same answer text always. The server's "length" alone marks an answer cut: transformers serve says
    # "length" also when the stop token is the last one allowed, where engine hf keeps the stop token.
    at_limit = {a["id"] for a in hf if a["regen"]["answer_tokens"] == [MAX_NEW] and a["regen"]["truncated"] == [False]}
    for a, b in zip(hf, served):
        assert b["messages"] == a["messages"]
        assert b["regen"]["truncated"] == ([True] if a["id"] in at_limit else a["regen"]["truncated"])
    # The same ids exactly where engine hf found that its generated ids are how the tokenizer spells their text
    # (roundtrip), the stop token kept: the re-tokenized text gives them back.
    differ = {a["id"] for a, b in zip(hf, served) if (a["input_ids"], a["loss_mask"]) != (b["input_ids"], b["loss_mask"])}
    spelled_otherwise = {a["id"] for a in hf if a["regen"]["roundtrip"] != [True]}
    assert differ == spelled_otherwise | at_limit
    # Engine openai flags an answer whose re-tokenized ids are not as many as the server generated: never one whose
    # ids are those engine hf generated, and every one whose stop token the server's "length" dropped.
    flagged = {b["id"] for b in served if b["regen"]["roundtrip"] != [True]}
    assert at_limit <= flagged <= differ
    summary = json.loads((tmp_path / "openai" / "summary.json").read_text())
    assert summary["engine"] == "openai" and summary["model"] == chat_target["target"]
    assert summary["roundtrip_mismatches"] == len(flagged)
    assert summary["answer_ids"] == {"generated": 0, "retokenized": len(served)}
    assert json.loads((tmp_path / "hf" / "summary.json").read_text())["roundtrip_mismatches"] == len(spelled_otherwise)


def test_a_model_the_server_does_not_serve_and_a_refused_endpoint(chat_target, server, source, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(args(chat_target["target"], source, out, "--engine", "openai", "--endpoint", server.url,
                     "--model", "no-such-model")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"does not serve --model 'no-such-model'; it serves ['{chat_target['target']}']" in err
    closed = f"http://127.0.0.1:{free_port()}/v1"
    assert main(args(chat_target["target"], source, out, "--engine", "openai", "--endpoint", closed,
                     "--retries", "2", "--retry-backoff", "0.05")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{closed}/models did not answer after 3 attempts" in err and "ConnectionRefusedError" in err
    assert not out.exists()  # refused before anything was written


def test_a_server_that_dies_mid_run_keeps_the_finished_shards(chat_target, server, source, tmp_path):
    assert main(args(chat_target["target"], source, tmp_path / "ref", "--batch-size", "8")) == 0
    total = len(shard_rows(tmp_path / "ref"))
    dying = Server(chat_target["target"], tmp_path / "dying.log")
    out = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "dflash_trainer.regenerate", *args(
        chat_target["target"], source, out, "--engine", "openai", "--endpoint", dying.url, "--concurrency", "1",
        "--retries", "1", "--retry-backoff", "0.1")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(out.glob("part-*.jsonl")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    dying.stop()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-3000:]
    assert f"{dying.url}/chat/completions did not answer" in " ".join(stderr.split())
    kept = shard_files(out)
    assert 4 <= sum(len(b.splitlines()) for b in kept.values()) < total
    # The same command against a live server finishes the rest; what was written stays as it was.
    assert main(args(chat_target["target"], source, out, "--engine", "openai", "--endpoint", server.url,
                     "--concurrency", "4")) == 0
    after = shard_files(out)
    assert all(after[name] == data for name, data in kept.items())

    def answers(d):
        return sorted((r["id"], r["messages"]) for r in shard_rows(d))

    assert answers(out) == answers(tmp_path / "ref")  # every row once, the same answers as engine hf
