"""dflash-regenerate with engine hf on CPU: answers equal the target's own greedy `generate`, seeded sampling
is reproducible, a killed run resumes to the same shards, two torchrun processes split the prompts, the
summary counts the shards from the run's one read of them, the shards train as they are, and bad input
is refused with a clear error that loses no shard."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from itertools import pairwise

import pytest
import torch
from dflash_trainer.bench import regenerate as bench
from dflash_trainer.data.prompts import (
    answer_slots,
    prompt_messages,
    render_prompt,
    row_messages,
    slot_indices,
)
from dflash_trainer.data.rows import DataError
from dflash_trainer.decoding.buckets import BUCKETS, bucket
from dflash_trainer.decoding.speculative import stop_token_ids
from dflash_trainer.infra.storage import StorageError
from dflash_trainer.regenerate import cli
from dflash_trainer.regenerate.cli import main
from dflash_trainer.regenerate.engine_hf import HFEngine
from dflash_trainer.regenerate.plan import DUPLICATE, NO_CHAT, NO_USER_TURN, check_plan, make_plan
from dflash_trainer.regenerate.sampling import Sampling, draw, nucleus, row_seed
from dflash_trainer.regenerate.shards import MANIFEST, OutputDir
from dflash_trainer.regenerate.summary import Figures, collect
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.mounts import tmpfs
from tests.helpers.regenerate import (
    chat_target as build_chat_target,
)
from tests.helpers.regenerate import (
    corpus_rows,
    greedy_alone,
    regenerate_cli,
    shard_files,
    shard_rows,
    split_row,
    write_jsonl,
)

MAX_NEW = 40


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    return build_chat_target(tmp_path_factory)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """24 corpus chats plus rows regeneration must skip: no user turn, not a chat."""
    rows = corpus_rows(24) + [{"messages": [{"role": "system", "content": "only a system turn"}]},
                              {"text": "not a chat row"}]
    return write_jsonl(tmp_path_factory.mktemp("source") / "chats.jsonl", rows)


def args(target, data, out, *extra):
    return ["--target", target, "--data", str(data), "--out", str(out), "--max-new-tokens", str(MAX_NEW), *extra]


def directory_totals(rows: list[dict]) -> dict:
    """summary.json's figures over a directory's rows, counted straight from the rows."""
    lengths = sorted(n for r in rows for n in r["regen"]["answer_tokens"])
    return {
        "prompts": len(rows),
        "answers": len(lengths),
        "answer_tokens": sum(lengths),
        "mean_answer_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
        "p99_answer_tokens": lengths[max(0, math.ceil(0.99 * len(lengths)) - 1)] if lengths else 0,
        "truncated_fraction": sum(t for r in rows for t in r["regen"]["truncated"]) / len(lengths) if lengths else 0.0,
        "roundtrip_mismatches": sum(not ok for r in rows for ok in r["regen"]["roundtrip"]),
        "prompt_mismatches": sum(not r["regen"]["prompt_matches"] for r in rows),
        "rows_with_unsupervised_earlier_turns": sum(not r["regen"]["all_turns_supervised"] for r in rows),
        "answer_ids": {source: sum(s == source for r in rows for s in r["regen"].get("answer_ids", []))
                       for source in ("generated", "retokenized")},
    }


def totals(summary: dict) -> dict:
    return {k: summary[k] for k in [*directory_totals([]), "shards"]}


@pytest.fixture(scope="module")
def greedy_run(chat_target, source, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy") / "regen"
    assert main(args(chat_target["target"], source, out, "--batch-size", "5", "--shard-size", "6")) == 0
    return out


# ---- the parts, alone ------------------------------------------------------------------------------

def test_answer_slots_last_and_all_turns():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "B"}]
    last = answer_slots(chat, "last")
    assert last[:4] == chat[:4] and last[4] == {"role": "assistant", "content": None} and len(last) == 5
    assert slot_indices(last) == [4]
    every = answer_slots(chat, "all")
    assert slot_indices(every) == [2, 4] and every[1] == chat[1] and every[3] == chat[3]
    assert answer_slots([{"role": "system", "content": "s"}], "last") is None


@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_plan_counts_skipped_rows_drops_repeats_and_keys_by_settings(chat_target):
    tok = AutoTokenizer.from_pretrained(chat_target["target"])
    chat = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}]}
    rows = [chat, {"messages": [{"role": "assistant", "content": "hi"}]}, {"text": "x"}, chat,
            {"question": "What is 2 plus 3?"}]
    plan = make_plan(rows, tok, Sampling(), {})
    assert len(plan.jobs) == 1 and plan.skipped == Counter({DUPLICATE: 2, NO_USER_TURN: 1, NO_CHAT: 1})
    assert plan.duplicates == {3: plan.jobs[0].key, 4: plan.jobs[0].key}  # a question row is the same prompt
    other = make_plan(rows, tok, Sampling(temperature=0.7, seed=1), {})
    assert other.jobs[0].key != plan.jobs[0].key  # sampling settings are part of the key
    assert make_plan(rows, tok, Sampling(), {}).jobs[0].key == plan.jobs[0].key
    with pytest.raises(DataError, match="no row of .* can be answered: 1 x no user turn"):
        check_plan(make_plan(rows[1:2], tok, Sampling(), {}), ["f.jsonl"])


def test_seeded_draws_follow_softmax_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    seeds = torch.arange(n)
    chosen = draw(logits.expand(n, -1), seeds, step=3, temperature=0.7, top_p=1.0)
    freq = torch.bincount(chosen, minlength=6).float() / n
    assert torch.allclose(freq, (logits / 0.7).softmax(-1), atol=0.015)  # sd of a frequency here <= 0.0035
    kept = nucleus(logits[None], 0.8)[0]  # softmax mass 0.61, 0.22, 0.14, ...: the nucleus is 3 tokens
    assert torch.isfinite(kept).tolist() == [True, True, True, False, False, False]
    top = draw(logits.expand(n, -1), seeds, step=3, temperature=1.0, top_p=0.8)
    assert set(top.tolist()) == {0, 1, 2}
    again = draw(logits.expand(n, -1), seeds, step=3, temperature=0.7, top_p=1.0)
    assert torch.equal(chosen, again)  # a function of (seed, step), nothing else
    assert not torch.equal(chosen, draw(logits.expand(n, -1), seeds, step=4, temperature=0.7, top_p=1.0))
    assert row_seed(1, "k", 0) == row_seed(1, "k", 0) != row_seed(1, "k", 1)


@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_batches_share_a_bucket_and_fit_the_budget(chat_target):
    tok = AutoTokenizer.from_pretrained(chat_target["target"])
    model = AutoModelForCausalLM.from_pretrained(chat_target["target"], dtype=torch.float32)
    engine = HFEngine(model, tok, Sampling(max_new_tokens=16), stop_token_ids(model, tok), batch_size=4)
    assert bucket(17) == 24 and bucket(16) == 16 and all(b <= 1.5 * a for a, b in pairwise(BUCKETS))
    prompts = [[1] * n for n in (30, 5, 17, 9, 40, 12, 3)]
    batches = list(engine.batches(prompts))
    assert [len(b) for b in batches] == [4, 3] and sorted(i for b in batches for i in b) == list(range(7))
    assert [len(prompts[i]) for i in batches[0]] == [3, 5, 9, 12]  # shortest first
    engine.kv_budget = 2 * (48 + 16) * engine.kv_per_token  # room for two rows at the 48-token bucket
    assert engine.rows_for(48) == 2 and engine.rows_for(16) == 4
    assert [len(b) for b in engine.batches(prompts)] == [4, 2, 1]


def test_figures_add_up_to_the_figures_of_all_rows():
    rng = random.Random(0)
    rows = []
    for i in range(500):
        turns = rng.randint(1, 3)
        rows.append({"regen": {"key": str(i), "answer_tokens": [rng.choice([0, 1, 7, 40, rng.randint(0, 2048)])
                                                                for _ in range(turns)],
                               "truncated": [rng.random() < 0.2 for _ in range(turns)],
                               "roundtrip": [rng.random() < 0.9 for _ in range(turns)],
                               "answer_ids": [rng.choice(["generated", "retokenized"]) for _ in range(turns)],
                               "prompt_matches": rng.random() < 0.9, "all_turns_supervised": rng.random() < 0.7}})
    parts = [Figures(), Figures(), Figures()]
    for n, row in enumerate(rows):
        parts[n % 3].add(row["regen"])
    summary = collect(sum(parts[1:], parts[0]), shards=3, engine="hf", target="t", model=None, sampling={},
                      chat_kwargs={}, plan_skipped={}, rows_read=500, runs=[], world=1)
    assert totals(summary) == {**directory_totals(rows), "shards": 3}
    for few in ([], rows[:1], rows[:2]):  # p99 of none, of one, of a few answers
        one = Figures()
        for row in few:
            one.add(row["regen"])
        assert one.p99() == directory_totals(few)["p99_answer_tokens"]


def test_a_run_reads_the_shards_there_once(tiny_target, tmp_path, monkeypatch, capsys):
    """The summary counts the rows already there from the start's read (the one that finds what is answered)
    and the new rows as they are written: shards damaged after the start change nothing in it, and its
    totals are those of an uninterrupted run, counted straight from the rows."""
    common = ["--limit", "12", "--shard-size", "3", "--batch-size", "6", "--max-new-tokens", "12"]
    whole = tmp_path / "whole"
    assert main(args(tiny_target["target"], tiny_target["train"], whole, *common)) == 0
    expected = json.loads((whole / "summary.json").read_text())
    assert totals(expected) == {**directory_totals(shard_rows(whole)), "shards": 4}
    assert expected["prompts"] == expected["this_run"]["prompts"] == 12

    out = tmp_path / "resumed"  # as a run killed after two of the four shards leaves it
    shutil.copytree(whole, out, ignore=shutil.ignore_patterns("summary.json", ".*.lock"))
    names = sorted(p.name for p in out.glob("part-*.jsonl"))
    for name in names[2:]:
        (out / name).unlink()
    kept = sum(len((out / name).read_text().splitlines()) for name in names[:2])
    real_run_chunks = cli.run_chunks

    def damage_then_run(*a, **kw):  # after the start's read, before any shard is written
        for name in names[:2]:
            (out / name).write_text("changed after the start's read\n")
        return real_run_chunks(*a, **kw)

    monkeypatch.setattr(cli, "run_chunks", damage_then_run)
    assert main(args(tiny_target["target"], tiny_target["train"], out, *common)) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert totals(resumed) == totals(expected)
    assert resumed["this_run"]["prompts"] == 12 - kept and resumed["this_run"]["shards_written"] == 2
    monkeypatch.undo()
    capsys.readouterr()
    assert main(args(tiny_target["target"], tiny_target["train"], out, *common)) == 2  # a read sees the damage
    assert f"{out / names[0]} line 1 is not JSON" in " ".join(capsys.readouterr().err.split())

    assert main(args(tiny_target["target"], tiny_target["train"], whole, *common)) == 0  # nothing left to do
    again = json.loads((whole / "summary.json").read_text())
    assert totals(again) == totals(expected) and again["this_run"]["prompts"] == 0


def test_a_run_ends_with_one_collective_that_brings_every_figure(tiny_target, tmp_path, monkeypatch):
    """What each process did and the rows it wrote come to rank 0 in one gather (they came in two, after a
    barrier): the summary's figures are still those counted straight from the rows."""
    from dflash_trainer.regenerate.driver import World

    calls = []

    def counted(name):
        real = getattr(World, name)

        def call(self, *a):
            calls.append(name)
            return real(self, *a)
        return call

    for name in ("barrier", "gather"):
        monkeypatch.setattr(World, name, counted(name))
    out = tmp_path / "regen"
    assert main(args(tiny_target["target"], tiny_target["train"], out, "--limit", "6", "--shard-size", "3",
                     "--max-new-tokens", "8")) == 0
    assert calls[calls.index("gather"):] == ["gather", "barrier"]  # the gather, then the wait for the summary
    summary = json.loads((out / "summary.json").read_text())
    assert totals(summary) == {**directory_totals(shard_rows(out)), "shards": 2}
    assert summary["this_run"]["prompts"] == 6 and summary["this_run"]["shards_written"] == 2


# ---- engine hf end to end --------------------------------------------------------------------------

@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_answers_equal_greedy_generate_of_each_prompt_alone(chat_target, greedy_run):
    tok = AutoTokenizer.from_pretrained(chat_target["target"])
    model = AutoModelForCausalLM.from_pretrained(chat_target["target"], dtype=torch.float32).eval()
    stop = stop_token_ids(model, tok)
    rows = shard_rows(greedy_run)
    summary = json.loads((greedy_run / "summary.json").read_text())
    assert summary["prompts"] == len(rows) == len({r["regen"]["key"] for r in rows})
    assert summary["skipped_rows"][NO_USER_TURN] == 1 and summary["skipped_rows"][NO_CHAT] == 1
    assert summary["skipped_row_numbers"][NO_USER_TURN] == [25] and summary["skipped_row_numbers"][NO_CHAT] == [26]
    assert all(r["regen"]["answer_ids"] == ["generated"] for r in rows)
    assert summary["answer_ids"] == {"generated": summary["answers"], "retokenized": 0}
    assert summary["source_rows"] == 26 and summary["shards"] == len(list(greedy_run.glob("part-*.jsonl"))) >= 3
    source = corpus_rows(24)
    stopped = 0
    for row in rows:
        prompt, answer = split_row(row)
        assert answer == greedy_alone(model, prompt, MAX_NEW, stop), row["id"]
        stopped += answer[-1] in stop
        assert row["messages"][:-1] == prompt_messages(row_messages(source[int(row["id"])]))
        assert row["messages"][-1] == {"role": "assistant", "content": tok.decode(answer[:-1])}
    assert stopped >= len(rows) // 2  # the trained target ends its answers (the stop token path is exercised)
    assert summary["truncated_fraction"] == pytest.approx(1 - stopped / len(rows))
    assert summary["answer_tokens"] == sum(len(split_row(r)[1]) for r in rows)


@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_multi_turn_rows_feed_the_targets_own_answers_back(chat_target, tmp_path):
    tok = AutoTokenizer.from_pretrained(chat_target["target"])
    model = AutoModelForCausalLM.from_pretrained(chat_target["target"], dtype=torch.float32).eval()
    stop = stop_token_ids(model, tok)
    chat = {"id": "mt", "messages": [
        {"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "someone else's"},
        {"role": "user", "content": "Count from 15 to 18."}, {"role": "assistant", "content": "old"}]}
    out = tmp_path / "mt"
    assert main(args(chat_target["target"], write_jsonl(tmp_path / "mt.jsonl", [chat]), out, "--turns", "all")) == 0
    (row,) = shard_rows(out)
    first = greedy_alone(model, render_prompt(tok, chat["messages"][:1]), MAX_NEW, stop)
    assert row["messages"][1]["content"] == tok.decode(first[:-1]) != "someone else's"
    second_prompt = render_prompt(tok, row["messages"][:3])
    second = greedy_alone(model, second_prompt, MAX_NEW, stop)
    assert row["input_ids"] == second_prompt + second and row["regen"]["all_turns_supervised"]
    supervised = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert supervised == first + second  # both answers, exactly the generated tokens
    assert row["regen"]["answer_tokens"] == [len(first), len(second)]


@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_seeded_sampling_is_reproducible(chat_target, source, greedy_run, tmp_path):
    runs = {}
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        out = tmp_path / name
        assert main(args(chat_target["target"], source, out, "--limit", "10", "--temperature", "0.7",
                         "--seed", seed, "--batch-size", "4")) == 0
        runs[name] = shard_files(out)
    assert runs["a"] == runs["b"]  # same seed: the same shards, byte for byte
    by_id = {name: {r["id"]: r["input_ids"] for r in shard_rows(tmp_path / name)} for name in "ac"}
    assert by_id["a"].keys() == by_id["c"].keys() and by_id["a"] != by_id["c"]  # another seed, other answers
    greedy = {r["id"]: r["input_ids"] for r in shard_rows(greedy_run)}
    sampled = {r["id"]: r["input_ids"] for r in shard_rows(tmp_path / "a")}
    assert any(sampled[i] != greedy[i] for i in sampled)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_shards(chat_target, source, greedy_run, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dflash_trainer.regenerate",
           *args(chat_target["target"], source, out, "--batch-size", "5", "--shard-size", "2")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 300
    while len(list(out.glob("part-*.jsonl"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    before = shard_files(out)
    total = len(shard_rows(greedy_run))
    assert 2 <= sum(len(b.splitlines()) for b in before.values()) < total, "killed after some shards, before the end"
    assert all(json.loads(line) for b in before.values() for line in b.splitlines())  # whole shards only
    assert main(args(chat_target["target"], source, out, "--batch-size", "5", "--shard-size", "2")) == 0
    after = shard_files(out)
    assert all(after[name] == data for name, data in before.items())  # finished shards untouched
    reference = tmp_path / "uninterrupted"
    assert main(args(chat_target["target"], source, reference, "--batch-size", "5", "--shard-size", "2")) == 0
    assert after == shard_files(reference)  # same names, same bytes
    assert not list(out.glob(".*.tmp*"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompts"] == total and summary["this_run"]["prompts"] == total - sum(
        len(b.splitlines()) for b in before.values())
    assert main(args(chat_target["target"], source, out, "--batch-size", "5", "--shard-size", "2")) == 0
    assert shard_files(out) == after  # a finished directory: nothing to do
    assert json.loads((out / "summary.json").read_text())["this_run"]["prompts"] == 0


@pytest.mark.slow
def test_two_torchrun_processes_split_the_prompts_into_the_same_shards(chat_target, source, tmp_path):
    common = ["--batch-size", "5", "--shard-size", "4"]
    one = regenerate_cli(args(chat_target["target"], source, tmp_path / "one", *common))
    assert one.returncode == 0, one.stderr[-3000:]
    two = regenerate_cli(args(chat_target["target"], source, tmp_path / "two", *common), torchrun=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "over 2 processes" in two.stderr
    # the setting to train on them is one line a log keeps whole, however long the path (pytest's tmp paths are)
    assert f'data.train = ["{tmp_path / "two"}/part-*.jsonl"]' in two.stderr.splitlines()[-1]
    assert shard_files(tmp_path / "two") == shard_files(tmp_path / "one")
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["this_run"]["processes"] == 2 and summary["prompts"] == len(shard_rows(tmp_path / "one"))
    # rank 0 writes the summary without reading rank 1's shards: their figures come with the gather
    assert totals(summary) == totals(json.loads((tmp_path / "one" / "summary.json").read_text()))
    assert totals(summary) == {**directory_totals(shard_rows(tmp_path / "two")), "shards": summary["shards"]}


@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_make_train_takes_the_shards_as_they_are(chat_target, greedy_run, tmp_path):
    from dflash_trainer.train import main as train_main

    out = tmp_path / "train"
    assert train_main(["--config", "embedded", "--output-dir", str(out),
                       "--set", f"target.path={chat_target['target']}",
                       "--set", f"data.train={json.dumps([str(greedy_run / 'part-*.jsonl')])}",
                       "--set", "train.steps=4", "--set", "train.micro_batch=4", "--set", "train.num_anchors=8",
                       "--set", "train.log_every=1", "--set", "eval.prompts=2", "--set", "eval.max_new_tokens=8"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 4 and 1.0 <= summary["tau_before"] and 1.0 <= summary["tau_after"] <= 8


# ---- bad input: a clear error, nothing lost ---------------------------------------------------------

@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_bad_input_is_refused_clearly_and_loses_no_shard(chat_target, source, greedy_run, tmp_path, capsys):
    def fails(argv, match):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert match in " ".join(err.split()), err

    fails(args(chat_target["target"], tmp_path / "nope.jsonl", tmp_path / "o1"), "data files not found")
    assert not (tmp_path / "o1").exists()
    only_system = write_jsonl(tmp_path / "sys.jsonl", [{"messages": [{"role": "system", "content": "s"}]}])
    fails(args(chat_target["target"], only_system, tmp_path / "o2"), "can be answered: 1 x no user turn")
    no_template = tmp_path / "no-template"
    shutil.copytree(chat_target["target"], no_template)
    (no_template / "chat_template.jinja").unlink()
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    fails(args(str(no_template), source, tmp_path / "o3"), "has no chat template")
    fails(args(str(tmp_path / "missing-target"), source, tmp_path / "o4"), "no such directory")
    fails(args(chat_target["target"], source, tmp_path / "o5", "--temperature", "-1", "--top-p", "0"),
          "argument --temperature: -1: must be >= 0")
    fails(args(chat_target["target"], source, tmp_path / "o6", "--engine", "openai"), "needs --endpoint")
    before = shard_files(greedy_run)
    changed = ["--target", chat_target["target"], "--data", str(source), "--out", str(greedy_run),
               "--max-new-tokens", "8"]
    fails(changed, "holds answers made differently (sampling:")
    assert shard_files(greedy_run) == before


def test_an_out_that_is_a_file_or_read_only_is_refused_before_the_weights_load(tiny_target, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    assert main(args(tiny_target["target"], tiny_target["train"], taken)) == 2
    assert f"--out {taken} exists and is not a directory" in capsys.readouterr().err
    assert taken.read_text() == "a file\n"
    assert main(args(tiny_target["target"], tiny_target["train"], taken / "sub")) == 2
    assert f"--out {taken / 'sub'}: {taken} is a file" in " ".join(capsys.readouterr().err.split())
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mnt:
        assert main(args(tiny_target["target"], tiny_target["train"], mnt / "out")) == 1  # a storage fault, as in train
        err = " ".join(capsys.readouterr().err.split())
        assert f"cannot write to --out {mnt / 'out'} (in {mnt}): read-only file system" in err, err
        assert "Give a writable --out" in err and not (mnt / "out").exists()


def test_a_missing_relative_target_is_refused_without_waiting_on_the_hub(tiny_target, tmp_path, monkeypatch, capsys):
    from dflash_trainer.infra import hub

    monkeypatch.setattr(hub, "offline", lambda: True)
    monkeypatch.chdir(tmp_path)
    assert main(args("models/Qwen3-8B", tiny_target["train"], tmp_path / "out")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--target 'models/Qwen3-8B': no such directory ({tmp_path / 'models/Qwen3-8B'})" in err, err
    assert not (tmp_path / "out").exists()


def test_a_target_without_weights_is_a_clear_error(tiny_target, tmp_path, capsys):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_target["target"], no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    assert main(args(str(no_weights), tiny_target["train"], tmp_path / "out")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--target {no_weights}: cannot load the model" in err, err
    assert not (tmp_path / "out").exists()  # nothing made for a run that could not start


def test_an_unknown_stop_token_is_a_data_error(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target["target"])
    with pytest.raises(DataError, match="--stop-token '<nope>' is not a token of the target's tokenizer"):
        stop_token_ids(None, tok, ["<nope>"])
    assert stop_token_ids(None, tok) == [tok.eos_token_id]  # no generation config: the tokenizer's EOS


def test_a_damaged_output_directory_names_the_file_and_the_fix(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.check_or_create({"target": "t"})
    (out.path / MANIFEST).write_text('{"target": "t", ')  # cut off mid-write
    with pytest.raises(DataError, match=r"out/regenerate.json is damaged \(.*\).* Move .*out aside"):
        out.check_or_create({"target": "t"})
    (out.path / MANIFEST).write_text('{"target": "t"}\n')
    write_jsonl(out.path / "part-000000-foreign0.jsonl", [{"input_ids": [1, 2], "loss_mask": [0, 1]}])
    with pytest.raises(DataError, match=r"not a regeneration row .*Move it out of .*out and run again"):
        out.done_keys()
    write_jsonl(out.path / "part-000000-foreign0.jsonl", [{"regen": {"key": "k", "truncated": [False]}}])
    with pytest.raises(DataError, match=r"part-000000-foreign0.jsonl line 1 has no regen.answer_tokens: not a "
                                        r"regeneration row .*Move it out of .*out and run again"):
        out.done_keys()


def test_a_full_disk_fails_a_shard_in_words_and_leaves_no_temporary(tmp_path):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        out = OutputDir(mnt / "out")
        out.lock()
        out.check_or_create({"target": "t"})
        rows = [{"regen": {"key": "k"}, "text": "x" * 2**21}]  # 2 MiB into 1 MiB
        with pytest.raises(StorageError, match=r"writing .*part-000000-\w+\.jsonl: disk full \(no space left on "
                                               r"device\), [\d.,]+ MiB free there\. Free space"):
            out.write_shard(0, rows)
        assert sorted(p.name for p in out.path.iterdir() if not p.name.endswith(".lock")) == [MANIFEST]


def test_clean_partial_removes_the_temporaries_a_killed_run_left(tmp_path):
    out = OutputDir(tmp_path)
    for name in (".part-000001-abcd1234.jsonl.tmp-x1y2", ".part-000002-abcd1234.4242.tmp", "part-000000-ab.jsonl"):
        (tmp_path / name).write_text("{}\n")
    assert out.clean_partial() == 2
    assert [p.name for p in tmp_path.iterdir()] == ["part-000000-ab.jsonl"]


# ---- the benchmark, as a CPU smoke run ------------------------------------------------------------------

@pytest.mark.slow  # generate_batch's warm-up alone takes ~30 s on a CPU
def test_bench_runs_every_contender_on_the_tiny_preset(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "tiny", "--prompts", "6", "--prompt-tokens", "12", "--new-tokens", "5",
                       "--batch-size", "4", "--baseline-batch", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    got = {r["contender"]: r for r in report["results"]}
    assert set(got) == {"hf", "baseline", "generate_batch"}
    for r in got.values():
        assert r["generated_tokens"] == 6 * 5 and r["all_answers_full_length"] and r["tokens_per_s"] > 0
    assert got["baseline"]["speedup_vs_baseline"] == 1.0 and got["hf"]["rows_per_batch"] == 4
    assert got["hf"]["answers_equal_to_baseline"] == 1.0  # fp32 on the CPU: the same greedy answers


def test_bench_needs_a_gpu_for_the_8b_shape(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--preset", "qwen3-8b"]) == 2
    assert "needs a CUDA GPU; use --preset tiny" in capsys.readouterr().err


# ---- GPU: the compiled decode (static cache, CUDA graphs) gives the same answers ----------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.slow  # builds the embedded target (~25 s on 2 cores)
def test_compiled_hf_engine_on_gpu_equals_greedy_generate(chat_target, source, tmp_path):
    out = tmp_path / "gpu"
    assert main(args(chat_target["target"], source, out, "--dtype", "float32", "--batch-size", "8")) == 0
    tok = AutoTokenizer.from_pretrained(chat_target["target"])
    model = AutoModelForCausalLM.from_pretrained(chat_target["target"], dtype=torch.float32).cuda().eval()
    stop = stop_token_ids(model, tok)
    rows = shard_rows(out)
    same = 0
    for row in rows:
        prompt, answer = split_row(row)
        same += answer == greedy_alone(model, prompt, MAX_NEW, stop)
    assert same == len(rows), f"{same}/{len(rows)} equal"


def test_a_target_with_remote_code_loads_only_with_trust_remote_code(tiny_target, tmp_path, monkeypatch, capsys):
    """A target whose config.json names modelling code it ships (auto_map): refused in words without the flag,
    answered with it; --set target.trust_remote_code=true is the same key."""
    import transformers.dynamic_module_utils as dynamic

    cache = tmp_path / "hf-modules"
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(cache))  # not the user's cache
    # Another test may have run remote code already (a published drafter's modelling file through AutoModel):
    # transformers_modules is then imported from another cache, which this test sets aside while it runs.
    for name in [m for m in sys.modules if m.split(".")[0] == "transformers_modules"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not os.path.isdir(os.path.join(p, "transformers_modules"))])
    remote = tmp_path / "remote"
    shutil.copytree(tiny_target["target"], remote)
    (remote / "configuration_remote.py").write_text(
        "from transformers import Qwen3Config\n\n\nclass RemoteConfig(Qwen3Config):\n    model_type = 'remote_qwen3'\n")
    (remote / "modeling_remote.py").write_text(
        "from transformers import Qwen3ForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n\n\n"
        "class RemoteForCausalLM(Qwen3ForCausalLM):\n    config_class = RemoteConfig\n")
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="remote_qwen3", auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                                                       "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (remote / "config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "chats.jsonl", corpus_rows(2))
    with pytest.raises(DataError, match="--trust-remote-code"):
        cli.max_context(str(remote))  # its context limit is read through its own config class
    assert cli.max_context(str(remote), True) == config["max_position_embeddings"]
    assert main(args(str(remote), data, tmp_path / "refused")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--trust-remote-code" in err and not (tmp_path / "refused").exists(), err
    assert main(args(str(remote), data, tmp_path / "out", "--trust-remote-code")) == 0
    assert main(args(str(remote), data, tmp_path / "out2", "--set", "target.trust_remote_code=true")) == 0
    assert len(shard_rows(tmp_path / "out")) == len(shard_rows(tmp_path / "out2")) == 2
