"""make bench-quality: the material readers, the looping rule, the table, and the whole pipeline on a tiny target."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from dflash_trainer.bench.quality import loops, materials, report

from tests.helpers.regenerate import chat_target


@pytest.fixture(autouse=True)
def default_signal_dispositions():
    """Each test starts from an interactive shell's signal dispositions, whatever this suite inherited: a
    suite started in the background by a script has SIGINT ignored, under nohup SIGHUP too, and the benchmark
    (and the stages it starts) keep an ignored signal ignored, so the signal tests would send theirs to no one."""
    import signal

    previous = {sig: signal.signal(sig, how) for sig, how in
                ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                 (signal.SIGHUP, signal.SIG_DFL))}
    yield
    for sig, how in previous.items():
        signal.signal(sig, how)

ROOT = Path(__file__).resolve().parents[1]


# ---- the looping rule ---------------------------------------------------------------------------

def test_an_answer_that_ends_in_a_cycle_loops():
    opening = list(range(100, 160))
    assert loops.loops(opening + [7, 8, 9] * 20)  # period 3
    assert loops.loops(opening + [5] * 48)  # period 1
    assert loops.loops(opening + list(range(20)) * 3)  # period 20, seen more than twice


def test_an_answer_without_a_cycle_does_not_loop():
    assert not loops.loops(list(range(200)))
    assert not loops.loops([1, 2] * 10)  # shorter than the window: ended on its own
    # a period longer than half the window is not seen twice in it
    assert not loops.loops(list(range(30)) * 2)
    # one token off in the tail breaks the cycle
    tail = [7, 8, 9] * 20
    tail[-10] = 99
    assert not loops.loops(list(range(50)) + tail)


# ---- ShareGPT, read object by object ------------------------------------------------------------

def _conv(text, first="human"):
    return {"id": text[:8], "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "ok"}]}


def test_a_cut_short_json_array_yields_every_whole_object_before_the_cut():
    convs = [_conv(f"question number {i} " + "x" * i) for i in range(40)]
    text = json.dumps(convs, indent=2)
    cut = text[: text.index("question number 31")]  # inside object 31
    got = list(materials._json_objects(io.StringIO(cut), chunk=64))  # objects span many chunks
    assert [g["conversations"][0]["value"] for g in got] == [c["conversations"][0]["value"] for c in convs[:31]]
    whole = list(materials._json_objects(io.StringIO(text), chunk=50))
    assert len(whole) == 40


def test_first_turns_are_distinct_human_prompts_within_the_length():
    convs = [_conv("a question"), _conv("a question"), _conv("  spaced  "), _conv("from the model", first="gpt"),
             _conv("y" * 50), {"id": "x", "conversations": []}]
    assert materials.first_turns(io.StringIO(json.dumps(convs)), max_chars=20) == ["a question", "spaced"]


def test_the_held_out_split_is_fixed_by_prompt_text_not_file_order():
    prompts = [f"prompt {i}" for i in range(50)]
    held, train = materials.split_prompts(prompts, 5, 20)
    held2, train2 = materials.split_prompts(list(reversed(prompts)), 5, 20)
    assert (held, train) == (held2, train2)
    assert len(held) == 5 and len(train) == 20 and not set(held) & set(train)
    # more training prompts never move the held-out ones
    assert materials.split_prompts(prompts, 5, None)[0] == held


def test_dense_copy_of_a_model_keeps_its_outputs(tmp_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    model = Gemma3ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 12))
    copy = materials.dense_copy(model).eval()
    assert copy is not model
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, model(ids).logits)


# ---- the table ----------------------------------------------------------------------------------

def _eval_dir(path: Path, sets: dict[str, list[tuple[list[int], list[int]]]], block: int = 4) -> Path:
    """An eval.json + requests.jsonl as dflash-eval writes them: per set, (accept lengths, output ids) per request."""
    path.mkdir(parents=True)
    report_sets, requests = {}, []
    for name, reqs in sets.items():
        lengths = [n for a, _ in reqs for n in a]
        slots = [sum(n > k for n in lengths) / len(lengths) for k in range(1, block)]
        report_sets[name] = {"tau": sum(lengths) / len(lengths),
                             "tau_per_request_mean": sum(sum(a) / len(a) for a, _ in reqs) / len(reqs),
                             "slot_acceptance": slots, "outputs_equal": len(reqs), "prompts": len(reqs)}
        requests += [{"set": name, "id": i, "accept_lengths": a, "output_ids": o} for i, (a, o) in enumerate(reqs)]
    (path / "eval.json").write_text(json.dumps({"sets": report_sets}))
    (path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def test_the_table_leaves_looping_answers_out_of_one_tau(tmp_path):
    looping = list(range(60)) + [3, 4] * 30
    plain = list(range(120))
    d = _eval_dir(tmp_path / "e", {"chat": [([4, 4, 4], looping), ([1, 2, 1], plain)], "code": [([2, 2], plain)]})
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"losses": [9.0] * 50 + [2.0] * 50 + [1.0] * 50}))
    rows = report.rows_for("ours", d, train_s=120.0, run_dir=run)
    chat = next(r for r in rows if r.prompt_set == "chat")
    assert chat.train_loss == pytest.approx(1.5)  # the last 100 steps' mean
    assert "| 1.500 |" in report.markdown(rows)
    assert report.rows_for("ours", d, train_s=None)[0].train_loss is None  # no run: no loss, the row still made
    assert chat.looping == 0.5
    assert chat.tau == pytest.approx(16 / 6)
    assert chat.tau_without_loops == pytest.approx(4 / 3)  # only the plain answer's steps
    assert chat.last_over_first == pytest.approx(chat.slot_acceptance[-1] / chat.slot_acceptance[0])
    assert chat.tau_per_gpu_minute == pytest.approx(chat.tau / 2)
    code = next(r for r in rows if r.prompt_set == "code")
    assert code.looping == 0 and code.tau_without_loops == code.tau == 2


def test_the_table_compares_each_trainers_step_cost_from_its_run_summary(tmp_path):
    """ms/step, MFU and peak GiB: read from each run's summary.json (ours and the peers' write the same fields),
    n/a where a run did not record one (a CPU has no GPU peak nor GPU memory; an older summary none of them)."""
    summaries = {
        "ours": {"losses": [1.0], "tokens_per_s": 9.0e4, "mfu": 0.41, "time_split_s": {"disk": 0.5, "drafter": 40.0},
                 "steady_step_ms": 131.44, "steady_mfu": 0.4349, "peak_memory_gib": 21.27},
        "speculators": {"peer": "speculators", "losses": [2.0], "step_s": [3.0, 0.19, 0.187, 0.188, 0.187],
                        "mfu": 0.25, "steady_step_ms": 187.46, "steady_mfu": 0.301, "peak_memory_gib": 38.24,
                        "target_memory_gib": 15.98},  # the target it held for its last hidden states
        "specforge": {"peer": "specforge", "losses": [3.0], "mfu": None, "steady_step_ms": 12.5, "steady_mfu": None,
                      "peak_memory_gib": None},
        "old": {"losses": [4.0], "tokens_per_s": 10.0, "mfu": 0.3},
    }
    rows = []
    for name, summary in summaries.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        rows += report.rows_for(name, _eval_dir(tmp_path / f"{name}-eval", {"s": [([2, 2], list(range(100)))]}), 60.0,
                                tmp_path / name)
    header, _, *lines = report.markdown(rows).splitlines()
    assert header.endswith("| train loss | ms/step | MFU | peak GiB |")
    assert lines[0].endswith("| 1.000 | 131.4 | 43.5% | 21.3 |")
    assert lines[1].endswith("| 2.000 | 187.5 | 30.1% | 38.2 (16.0 target) |")
    assert lines[2].endswith("| 3.000 | 12.5 | n/a | n/a |")
    assert lines[3].endswith("| 4.000 | n/a | n/a | n/a |")  # its whole-run mfu is another figure: not shown
    assert (rows[1].step_ms, rows[1].mfu, rows[1].peak_gib, rows[1].target_gib) == (187.46, 0.301, 38.24, 15.98)
    assert asdict(rows[0])["step_ms"] == 131.44  # quality.json's row (report.write)


def test_the_verdict_compares_with_the_best_peer_on_each_set(tmp_path):
    plain = list(range(100))
    ours = report.rows_for("ours", _eval_dir(tmp_path / "o", {"s": [([4, 4], plain)]}), None)
    a = report.rows_for("a", _eval_dir(tmp_path / "a", {"s": [([3, 3], plain)]}), None)
    b = report.rows_for("b", _eval_dir(tmp_path / "b", {"s": [([2, 2], plain)]}), None)
    said = report.verdict(ours + a + b, "ours", ["a", "b"])
    assert any("best peer a 3.00" in s and "+33.3%" in s and "meets" in s for s in said)
    said = report.verdict(ours + report.rows_for("c", _eval_dir(tmp_path / "c", {"s": [([4, 4], plain)]}), None),
                          "ours", ["c"])
    assert any("+0.0%" in s and "misses" in s for s in said)


def test_the_verdict_judges_each_variant_and_counts_prompt_by_prompt(tmp_path):
    """A variant of ours is held to the goal too, and each comparison says on how many prompts it is higher and
    lower: three prompts, the variant ahead on two, behind on one, the set's tau ahead."""
    plain = list(range(100))
    peer = report.rows_for("p", _eval_dir(tmp_path / "p", {"s": [([2], plain), ([2], plain), ([4], plain)]}), None)
    ours = report.rows_for("ours", _eval_dir(tmp_path / "o", {"s": [([2], plain), ([2], plain), ([4], plain)]}), None)
    variant = report.rows_for("ours kl", _eval_dir(tmp_path / "v", {"s": [([4], plain), ([4], plain), ([3], plain)]}),
                              None)
    said = report.verdict(peer + ours + variant, "ours", ["p"])
    line = next(s for s in said if s.startswith("s: ours kl tau"))
    assert "vs best peer p 2.67" in line and "+37.5%" in line and "meets" in line
    assert line.endswith("per prompt higher on 2, lower on 1 of 3)")
    assert next(s for s in said if s.startswith("s: ours tau")).endswith("higher on 0, lower on 0 of 3)")
    assert any(s.startswith("s: ours kl last slot") for s in said)


# ---- the whole pipeline on the embedded default's tiny target -------------------------------------

@pytest.mark.slow
def test_bench_quality_end_to_end_on_a_tiny_target(tmp_path, tmp_path_factory):
    target = chat_target(tmp_path_factory)["target"]
    corpus = [json.loads(line) for line in (ROOT / "dflash/dflash_trainer/assets/tiny_chat.jsonl").read_text().splitlines()]
    prompts = [{"messages": c["messages"][:1]} for c in corpus]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in prompts[40:120]))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts[:4]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts[6:10]))
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "dflash_trainer.bench.quality", "--out", str(out), "--target", str(target),
           "--train-prompts", str(train), "--train-count", "48", "--answer-tokens", "24",
           "--eval-prompts", f"chat={tmp_path / 'a.jsonl'}", f"more={tmp_path / 'b.jsonl'}",
           "--trainers", "dflash-trainer", "--data-fraction", "0.5", "--eval-tokens", "16",
           "--variant", "tv=train.loss_ce=0.1;train.loss_tv=0.9",
           "--config", "embedded", "--set", "train.steps=8", "--set", "train.micro_batch=8",
           "--eval-args", "--device cpu --temperature 0 1", "--jobs", "2"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "quality.json").read_text())
    got = {(r["drafter"], r["prompt_set"]) for r in result["rows"]}
    assert got == {(d, f"{s} T={t}") for d in ("dflash-trainer", "dflash-trainer tv", "dflash-trainer 0.5 data")
                   for s in ("chat", "more") for t in ("0", "1")}
    for r in result["rows"]:
        assert 1.0 <= r["tau"] <= 8 and len(r["slot_acceptance"]) == 7 and r["train_s"] > 0
        assert r["outputs_equal"] == ("sampled" if r["prompt_set"].endswith("T=1") else "4/4")
        assert r["trained_at_once"] == 2  # --jobs 2: the three drafters trained two at a time
        assert r["step_ms"] > 0 and r["mfu"] is None and r["peak_gib"] is None  # a CPU: no GPU peak, no GPU memory
    # the variant trained against the target's distribution: the one dump carries it
    assert "train.loss_tv" in (out / "runs" / "dflash-trainer-tv" / "bench_wall.json").read_text()
    assert (out / "quality.png").stat().st_size > 0
    assert "| dflash-trainer | chat T=0 |" in (out / "quality.md").read_text()
    assert " (2 at once) |" in (out / "quality.md").read_text()  # overlapping wall times are marked
    assert "evaluate dflash-trainer tv: done in" in done.stderr  # side by side: a line per stage, logs apart
    # the half-data run read half the micro-batches, by links to the same files
    meta = json.loads((out / "features" / "meta.json").read_text())
    half = json.loads((out / "features-0.5" / "meta.json").read_text())
    assert half["micro_batches"] == max(1, int(meta["micro_batches"] * 0.5))
    # a second run reuses every stage: nothing is trained or evaluated again
    again = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:]
    said = again.stdout + again.stderr  # the stage lines go to stderr (the log console)
    assert "train dflash-trainer" in done.stderr and "train dflash-trainer" not in said
    assert "evaluate dflash-trainer" not in said
    assert json.loads((out / "quality.json").read_text())["rows"] == result["rows"]


BAD_FLAGS = [
    (["--eval-prompts", "foo"], "give NAME=FILE"),
    (["--variant", "bad"], "write LABEL=KEY=VALUE"),
    (["--target", "/nonexistent-target"], "no config.json there"),
    (["--data-fraction", "1.5"], "a fraction in (0, 1]"),
    (["--train-count", "0"], "give 1 or more"),
    (["--jobs", "0"], "give 1 or more"),
    (["--config", "/nonexistent-run.toml"], "--config: config '/nonexistent-run.toml' not found"),
]


@pytest.mark.parametrize("flags, said", BAD_FLAGS)
def test_bad_flags_end_in_one_line_and_write_nothing(tmp_path, capsys, flags, said):
    """In this process (a Python that imports torch per flag is seconds each): argparse's exit 2 and its line;
    any other exception would leave main() as itself, not as SystemExit."""
    from dflash_trainer.bench.quality.__main__ import main

    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(out), *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and said in err, err
    assert not out.exists()


def test_a_bad_flag_ends_the_command_in_one_line_without_a_traceback(tmp_path):
    """The same through `python -m`, as a user runs it: the exit status and stderr of the process itself."""
    flags, said = BAD_FLAGS[0]
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "dflash_trainer.bench.quality", "--out", str(out), *flags],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not out.exists()


def test_a_whole_regeneration_is_reused_and_a_stopped_one_resumed(tmp_path):
    from dflash_trainer.bench.quality.__main__ import regeneration_done

    assert not regeneration_done(tmp_path, 10)  # none yet
    (tmp_path / "summary.json").write_text('{"prompts": 10, ')  # cut off mid-write
    assert not regeneration_done(tmp_path, 10)
    (tmp_path / "summary.json").write_text(json.dumps({"prompts": 10, "answers": 6}))  # stopped
    assert not regeneration_done(tmp_path, 10)
    (tmp_path / "summary.json").write_text(json.dumps({"prompts": 10, "answers": 10}))
    assert regeneration_done(tmp_path, 10)
    (tmp_path / "summary.json").write_text(json.dumps({"prompts": 8, "answers": 8}))  # fewer prompts than asked
    assert regeneration_done(tmp_path, 10)


def test_side_by_side_counts_only_the_drafters_left_to_train(tmp_path):
    """--jobs 4 over three drafters, one finished before: two train at once, and their wall times say 2, not 4."""
    from dflash_trainer.bench.quality.__main__ import Drafter, side_by_side, wall_file

    drafters = [Drafter(name, "dflash-trainer", tmp_path / name) for name in ("a", "b", "c")]
    (drafters[0].run / "drafter").mkdir(parents=True)
    (drafters[0].run / "drafter" / "config.json").write_text("{}")
    (drafters[0].run / "summary.json").write_text("{}")
    wall_file(drafters[0].run).write_text("{}")
    assert side_by_side(4, drafters) == 2
    assert side_by_side(1, drafters) == 1
    assert side_by_side(4, drafters[:1]) == 1  # nothing left to train: no overlap to mark



# ---- a drafter that fails or stops, and the benchmark stopped: stages faked by a script ------------------------

FAKE_STAGE = r"""
import json, os, signal, sys, time
from pathlib import Path

module, args = sys.argv[1], sys.argv[2:]
out = Path(args[args.index("--output-dir" if "--output-dir" in args else "--out") + 1])
calls = Path(os.environ["FAKE_CALLS"])
with calls.open("a") as f:
    f.write(json.dumps({"module": module, "out": out.name, "args": args}) + "\n")
if module == "dflash_trainer.bench.peers":
    print("error: specforge is not installed: pip install --no-deps specforge==0.2.0")
    sys.exit(2)
if module == "dflash_trainer.eval":
    out.mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps({"sets": {"chat": {
        "tau": 3.0, "tau_per_request_mean": 3.0, "slot_acceptance": [0.8, 0.5], "outputs_equal": 1, "prompts": 1}}}))
    (out / "requests.jsonl").write_text(json.dumps({"set": "chat", "id": 0, "accept_lengths": [3, 3],
                                                    "output_ids": list(range(100))}) + "\n")
    sys.exit(0)
# dflash_trainer.train: stops at step 3 where FAKE_STOPS names its run (a checkpoint, exit 0, as ours stops on a
# signal); where FAKE_WAIT names it, it waits for the signal first; FAKE_REFUSE_RESUME: refuses --resume (exit 2)
if "--resume" in args and os.environ.get("FAKE_REFUSE_RESUME"):
    print("error: --resume: this config builds another drafter than the checkpoint holds")
    sys.exit(2)
out.mkdir(parents=True, exist_ok=True)
stops = os.environ.get("FAKE_STOPS", "").split(",")
if out.name in os.environ.get("FAKE_WAIT", "").split(","):
    got = []
    signal.signal(signal.SIGINT, lambda n, _: got.append(signal.Signals(n).name))
    (out.parent / f"{out.name}.ready").touch()
    for _ in range(400):
        if got:
            break
        time.sleep(0.05)
    with calls.open("a") as f:
        f.write(json.dumps({"module": "signal", "out": out.name, "got": got}) + "\n")
    stops.append(out.name)
if out.name in stops and "--resume" not in args:
    (out / "checkpoints" / "step-00000003").mkdir(parents=True)
    print("stopped at step 3: checkpoint; continue with --resume")
    sys.exit(0)
(out / "drafter").mkdir(exist_ok=True)
(out / "drafter" / "config.json").write_text("{}")
(out / "summary.json").write_text(json.dumps({"steps": 8, "losses": [1.0]}))
"""


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """main() in this process with every stage's command a script that acts its part (the regeneration and the
    features already there): returns (run(flags) -> exit code, out, the calls the stages got)."""
    from dflash_trainer.bench.quality import __main__ as bench
    from dflash_trainer.data.features import META

    script = tmp_path / "fake_stage.py"
    script.write_text(FAKE_STAGE)
    monkeypatch.setattr(bench, "py", lambda module, *args: [sys.executable, str(script), module, *args])
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = tmp_path / "bench"
    (out / "regen").mkdir(parents=True)
    (out / "regen" / "summary.json").write_text(json.dumps({"prompts": 4, "answers": 4}))
    (out / "features").mkdir()
    (out / "features" / META).write_text(json.dumps({"micro_batches": 4}))

    def run(*flags: str) -> int:
        return bench.main(["--out", str(out), "--target", str(target), "--train-prompts", str(tmp_path / "prompts.jsonl"),
                           "--eval-prompts", f"chat={tmp_path / 'prompts.jsonl'}", "--train-count", "4", *flags])

    def called() -> list[dict]:
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

    return run, out, called


def test_a_training_that_exits_0_without_its_drafter_is_reported_stopped_and_the_others_keep_their_rows(
        fake_bench, monkeypatch, capsys):
    run, out, called = fake_bench
    monkeypatch.setenv("FAKE_STOPS", "dflash-trainer-b")
    code = run("--trainers", "dflash-trainer", "--variant", "b=train.lr=1e-4", "--jobs", "2")
    err = capsys.readouterr().err
    assert code == 1, err
    assert "train dflash-trainer b stopped at step 3 before its last" in err
    assert "run the same command again to resume it" in err
    table, not_in_table = (out / "quality.md").read_text().split("Not in the table:\n")
    assert "| dflash-trainer | chat |" in table and "dflash-trainer b" not in table
    log = out / "logs" / "train-dflash-trainer-b.log"
    assert not_in_table == f"- dflash-trainer b: stopped (log: {log})\n"  # quality.md alone says what it lacks
    assert json.loads((out / "quality.json").read_text())["not_in_table"] == [
        {"drafter": "dflash-trainer b", "exit": "stopped", "log": str(log)}]
    assert "1 of 2 drafters failed" in err
    # the stopped one was not judged: no evaluation of a drafter that is not there
    assert [c["out"] for c in called() if c["module"] == "dflash_trainer.eval"] == ["dflash-trainer"]


def test_a_failing_peer_leaves_the_table_of_the_rest_and_is_listed(fake_bench, capsys):
    run, out, _ = fake_bench
    code = run("--trainers", "dflash-trainer", "specforge")
    captured = capsys.readouterr()
    assert code == 1
    assert "| dflash-trainer | chat |" in (out / "quality.md").read_text()
    assert [r["drafter"] for r in json.loads((out / "quality.json").read_text())["rows"]] == ["dflash-trainer"]
    assert "| dflash-trainer | chat |" in captured.err  # printed as on success (the console is stderr)
    failure = next(line for line in captured.err.splitlines() if line.startswith("  - specforge:"))
    assert "exit 2" in failure and str(out / "logs" / "train-specforge.log") in failure
    assert f"- specforge: exit 2 (log: {out / 'logs' / 'train-specforge.log'})" in (out / "quality.md").read_text()


def test_a_stopped_training_resumes_on_the_next_call_and_starts_over_when_its_settings_changed(
        fake_bench, monkeypatch):
    run, out, called = fake_bench
    monkeypatch.setenv("FAKE_STOPS", "dflash-trainer")
    assert run("--trainers", "dflash-trainer") == 1
    monkeypatch.delenv("FAKE_STOPS")
    assert run("--trainers", "dflash-trainer") == 0
    trains = [c["args"] for c in called() if c["module"] == "dflash_trainer.train"]
    assert "--overwrite" in trains[0] and "--resume" not in trains[0]
    assert "--resume" in trains[1] and "--overwrite" not in trains[1]
    wall = json.loads((out / "runs" / "dflash-trainer" / "bench_wall.json").read_text())
    assert "--resume" in wall["command"] and wall["seconds"] > 0
    assert not (out / "runs" / "dflash-trainer" / "bench_partial.json").exists()
    # stopped again, then another setting: the run starts over
    (out / "runs" / "dflash-trainer" / "bench_wall.json").unlink()
    (out / "runs" / "dflash-trainer" / "drafter" / "config.json").unlink()
    monkeypatch.setenv("FAKE_STOPS", "dflash-trainer")
    assert run("--trainers", "dflash-trainer") == 1
    monkeypatch.delenv("FAKE_STOPS")
    assert run("--trainers", "dflash-trainer", "--set", "train.lr=1e-4") == 0
    last = [c["args"] for c in called() if c["module"] == "dflash_trainer.train"][-1]
    assert "--overwrite" in last and "--resume" not in last


def test_after_a_signal_no_stage_starts_and_the_running_ones_get_it_once(fake_bench, monkeypatch, capsys):
    """--jobs 2 over three drafters: the first two train (in process groups of their own: the signal reaches them
    only as the benchmark passes it on), the benchmark gets SIGINT; they stop, nothing else starts, exit 130."""
    import os
    import signal
    import threading
    import time

    run, out, called = fake_bench
    monkeypatch.setenv("FAKE_WAIT", "dflash-trainer,dflash-trainer-b")
    runs = out / "runs"
    (runs / "dflash-trainer-c").mkdir(parents=True)  # a stopped run of the drafter the signal leaves unstarted
    (runs / "dflash-trainer-c" / "kept").touch()

    def interrupt_when_both_train() -> None:
        for _ in range(400):
            if all((runs / f"{name}.ready").exists() for name in ("dflash-trainer", "dflash-trainer-b")):
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt_when_both_train)
    thread.start()
    code = run("--trainers", "dflash-trainer", "specforge", "--variant", "b=train.lr=1e-4",
               "--variant", "c=train.lr=2e-4", "--jobs", "2")
    thread.join()
    err = capsys.readouterr().err
    assert code == 130, err
    got = {c["out"]: c["got"] for c in called() if c["module"] == "signal"}
    assert got == {"dflash-trainer": ["SIGINT"], "dflash-trainer-b": ["SIGINT"]}  # once each, from the benchmark
    started = [(c["module"], c["out"]) for c in called() if c["module"] != "signal"]
    assert sorted(started) == [("dflash_trainer.bench.peers", "specforge"), ("dflash_trainer.train", "dflash-trainer"),
                               ("dflash_trainer.train", "dflash-trainer-b")]
    assert "SIGINT: no stage starts now" in err  # said once, as the signal came
    # the peer failed on its own (exit 2), before the signal: said as a failure, with its log; the signal's line
    # names only the trainings it ended
    failure = next(line for line in err.splitlines() if line.startswith("  - specforge:"))
    assert "exit 2" in failure and str(out / "logs" / "train-specforge.log") in failure
    assert ("stopped by SIGINT: no drafter trained and judged yet; cut short: dflash-trainer, dflash-trainer b; run"
            in err)
    assert (runs / "dflash-trainer-c" / "kept").exists()  # the unstarted one's run is left for the next call
    assert "train dflash-trainer: stopped before its end (exit 0)" in err and ": done in" not in err
    assert "run the same command again" in err
    assert not (out / "quality.md").exists()


def test_a_stopped_training_starts_over_when_its_config_file_or_features_changed_and_after_a_refused_resume(
        fake_bench, monkeypatch, tmp_path, capsys):
    """The same command line is not the same training: the --config file's contents and the features dump are
    recorded beside it (bench_partial.json); a resume the trainer refuses (exit 2) drops the record."""
    import hashlib

    run, out, called = fake_bench
    config = tmp_path / "run.toml"
    config.write_text("[train]\nsteps = 8\n")
    flags = ("--trainers", "dflash-trainer", "--config", str(config))
    partial = out / "runs" / "dflash-trainer" / "bench_partial.json"

    def last_train() -> list[str]:
        return [c["args"] for c in called() if c["module"] == "dflash_trainer.train"][-1]

    monkeypatch.setenv("FAKE_STOPS", "dflash-trainer")
    assert run(*flags) == 1
    record = json.loads(partial.read_text())
    assert record["config_sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()
    assert record["features_sha256"] == hashlib.sha256((out / "features" / "meta.json").read_bytes()).hexdigest()
    config.write_text("[train]\nsteps = 16\n")  # the same command, the file edited
    assert run(*flags) == 1
    assert "--overwrite" in last_train() and "--resume" not in last_train()
    (out / "features" / "meta.json").write_text(json.dumps({"micro_batches": 5}))  # features dumped anew
    assert run(*flags) == 1
    assert "--overwrite" in last_train() and "--resume" not in last_train()
    # nothing changed since: it resumes, and the trainer refuses; the record is dropped, not written again
    monkeypatch.setenv("FAKE_REFUSE_RESUME", "1")
    capsys.readouterr()
    assert run(*flags) == 1
    assert "--resume" in last_train()
    failure = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("  - dflash-trainer:"))
    assert "refused to resume" in failure and "exit 2" in failure and "the next run starts it over" in failure
    assert not partial.exists()
    assert run(*flags) == 1  # the next call starts over (and stops again: FAKE_STOPS)
    assert "--overwrite" in last_train() and "--resume" not in last_train()


def test_after_a_signal_a_stage_keeps_its_log_and_a_training_its_run(tmp_path):
    """A stage that will not start touches nothing: its last log is not emptied, a stopped run not removed."""
    from dflash_trainer.bench.quality import __main__ as bench

    log = tmp_path / "logs" / "train-ours.log"
    log.parent.mkdir()
    log.write_text("stopped at step 3: checkpoint\n")
    d = bench.Drafter("ours", bench.OURS, tmp_path / "runs" / "ours", features=tmp_path / "features")
    (d.run / "checkpoints" / "step-00000003").mkdir(parents=True)
    bench.stopping.clear()
    try:
        bench.stopping.request("SIGTERM")
        with pytest.raises(bench.Stopped):
            bench.run_stage("train ours", [sys.executable, "-c", "pass"], log)
        with pytest.raises(bench.Stopped):
            bench.train(bench.parser().parse_args([]), d, tmp_path / "target", [], log.parent)
    finally:
        bench.stopping.clear()
    assert log.read_text() == "stopped at step 3: checkpoint\n"
    assert (d.run / "checkpoints" / "step-00000003").is_dir()


def test_signals_ignored_on_entry_stay_ignored_and_sighup_is_handled(tmp_path, monkeypatch):
    """A benchmark started with & by a script (SIGINT ignored) keeps ignoring it; SIGTERM and SIGHUP (a closed
    terminal) are the benchmark's, and every handler is put back at its end."""
    import signal

    from dflash_trainer.bench.quality import __main__ as bench

    seen = {}

    def record(_args) -> int:
        seen.update({sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)})
        return 0

    monkeypatch.setattr(bench, "bench", record)
    # the dispositions on entry set here: a test run under nohup (SIGHUP ignored) must not decide the outcome
    previous = {sig: signal.signal(sig, how) for sig, how in
                ((signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_DFL))}
    try:
        assert bench.main(["--out", str(tmp_path / "bench")]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        for sig, how in previous.items():
            signal.signal(sig, how)
    assert seen[signal.SIGINT] is signal.SIG_IGN
    assert seen[signal.SIGTERM] == bench.stopping.handle and seen[signal.SIGHUP] == bench.stopping.handle


def test_a_second_signal_while_no_stage_runs_ends_the_benchmark_at_once(tmp_path, monkeypatch, capsys):
    """The first signal is said in a line and waits for the running stages; with none running (the benchmark's own
    work, e.g. assembling the target), a second one ends it: exit 128 + its number."""
    import os
    import signal
    import time

    from dflash_trainer.bench.quality import __main__ as bench

    def own_work(_args) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert bench.stopping.signal_name == "SIGTERM"  # the first one: recorded, the work goes on
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        return 0

    monkeypatch.setattr(bench, "bench", own_work)
    assert bench.main(["--out", str(tmp_path / "bench")]) == 130
    err = capsys.readouterr().err
    assert "SIGTERM: no stage starts now; the benchmark stops once the running stages have stopped" in err
    assert "stopped by a second SIGINT while no stage ran" in err


def test_a_sighup_reaches_the_running_stages_as_sigterm(tmp_path):
    """A closed terminal's SIGHUP: the stages (in process groups of their own, which the terminal's hangup does not
    reach) get SIGTERM, which they stop cleanly on; the benchmark then exits 129."""
    import time

    from dflash_trainer.bench.quality import __main__ as bench
    from dflash_trainer.infra.stop_signal import exit_code

    ready = tmp_path / "ready"
    stage = ("import signal, sys, time\n"
             "got = []\n"
             "signal.signal(signal.SIGTERM, lambda n, _: got.append(signal.Signals(n).name))\n"
             f"open({str(ready)!r}, 'w').close()\n"
             "for _ in range(400):\n"
             "    if got:\n"
             "        break\n"
             "    time.sleep(0.05)\n"
             "print(got)\n")
    bench.stopping.clear()
    proc = bench.stopping.start("stage", [sys.executable, "-c", stage])
    try:
        for _ in range(400):
            if ready.exists():
                break
            time.sleep(0.05)
        bench.stopping.request("SIGHUP")
        said, _ = proc.communicate(timeout=30)
    finally:
        bench.stopping.ended(proc)
        name = bench.stopping.signal_name
        bench.stopping.clear()
    assert said.strip() == "['SIGTERM']" and proc.returncode == 0
    assert name == "SIGHUP" and exit_code(name) == 129
