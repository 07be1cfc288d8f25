"""Signals and pipes, for every command: a SIGTERM or Ctrl-C during start-up ends it in one line with exit 143 / 130
(infra/stop_signal.py), what it says of checkpoints is what the run directory holds, and a reader that stops
reading stdout (`| head -1`, `| true`) ends it quietly with exit 0 (infra/entry.py). Real processes, real signals,
sent once the process has printed a known line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dflash_run import cli as run_cli
from dflash_trainer.infra.metrics import PlainProgress
from dflash_trainer.infra.stop_signal import (
    Interrupted,
    StopSignal,
    exit_code,
    interrupt_on_signals,
    received,
)
from dflash_trainer.run import checkpoint as ckpt
from dflash_trainer.run import run_dir

from tests.helpers.training import random_drafter_dir
from tests.test_faults import sets

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
MODULES = {"dflash-train": "dflash_trainer.train", "dflash-eval": "dflash_trainer.eval",
           "dflash-regenerate": "dflash_trainer.regenerate", "dflash-run": "dflash_run"}


def into_closed_pipe(*argv: str) -> subprocess.CompletedProcess:
    """argv with its stdout into a pipe whose reader has already gone (`| true`): the pipeline's status is its own."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(list(argv), stdout=writer, stderr=subprocess.PIPE, text=True, timeout=300, env=ENV,
                              check=False)
    finally:
        os.close(writer)


# ---- a closed stdout --------------------------------------------------------------------------------------

def test_run_status_and_logs_into_a_closed_pipe_end_quietly(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text("".join(f"line {i}\n" for i in range(100)))
    for cmd in ("status", "logs"):
        proc = into_closed_pipe(sys.executable, "-m", MODULES["dflash-run"], cmd, "--run-dir", str(tmp_path))
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


@pytest.mark.parametrize("command", ["dflash-train", pytest.param("dflash-eval", marks=pytest.mark.slow),
                                     pytest.param("dflash-regenerate", marks=pytest.mark.slow)])
def test_print_config_into_a_closed_pipe_ends_quietly(command):
    proc = into_closed_pipe(sys.executable, "-m", MODULES[command], "--print-config")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


def test_a_broken_pipe_that_is_not_stdout_is_not_taken_for_one(monkeypatch):
    """Only a closed stdout ends a command quietly: a server's closed socket is still an error."""
    import types

    from dflash_trainer.infra import entry

    def main():
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(sys.modules, "a_command", types.SimpleNamespace(main=main))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(BrokenPipeError):
            entry.run_command("dflash-x", "a_command")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_run_dir_that_is_a_file_is_refused_by_name(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    for cmd in ("status", "logs"):
        with pytest.raises(SystemExit) as exited:
            run_cli.main([cmd, "--run-dir", str(file)])
        err = " ".join(capsys.readouterr().err.split())
        assert exited.value.code == 2 and f"{file} is a file, not a job's directory" in err, err
        assert "no such directory" not in err


# ---- signals: the exit codes, and what is said -------------------------------------------------------------

def test_signals_exit_128_plus_their_number():
    assert (exit_code("SIGINT"), exit_code("SIGTERM")) == (130, 143)


def test_a_signal_outside_a_stop_scope_raises_interrupted_and_a_second_inside_one_says_so():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        interrupt_on_signals()
        with pytest.raises(Interrupted) as first:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert (first.value.signal_name, first.value.second) == ("SIGTERM", False)
        with StopSignal() as stop, pytest.raises(Interrupted) as second:
            os.kill(os.getpid(), signal.SIGINT)  # recorded: a clean stop
            for _ in range(100):
                if stop.requested:
                    break
                time.sleep(0.01)
            assert stop.requested
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert (second.value.signal_name, second.value.second) == ("SIGINT", True)
        assert received() == "SIGTERM"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        interrupt_on_signals()  # a command's start forgets what came before
        assert received() is None
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_signal_ignored_by_the_parent_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        interrupt_on_signals()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_what_an_interrupted_run_says_of_checkpoints_is_what_it_holds(tiny_target, tmp_path):
    none = run_dir.interrupted_note(tmp_path, "SIGINT", second=True)
    assert none.startswith("stopped at once by a second SIGINT") and "holds no checkpoint" in none
    assert "--resume" not in none and "intact" not in none
    step = ckpt.save_checkpoint(tmp_path / "checkpoints", 3, lambda d: random_drafter_dir(tiny_target["target"], d),
                                {"step": 3}, keep_last=2)
    some = run_dir.interrupted_note(tmp_path, "SIGTERM", second=False)
    assert some.startswith("stopped by SIGTERM before training started")
    assert f"{step.name} in {tmp_path / 'checkpoints'}, is intact; --resume continues from it" in some


def test_an_eta_is_given_once_the_first_batch_is_done():
    said = PlainProgress(304, enabled=True, in_flight=128)
    assert said.timing(1).endswith("ETA after 128 done")  # one of 128 in flight says nothing of the pace
    assert "ETA after" not in said.timing(128) and "ETA " in said.timing(128)
    assert "ETA after" not in PlainProgress(5, enabled=True, in_flight=128).timing(5)  # fewer items than a batch
    assert "ETA after" not in PlainProgress(10, enabled=True).timing(1)  # one at a time: from the first


# ---- signals in real processes -----------------------------------------------------------------------------

def start(argv: list[str], cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=cwd)


def wait_for_line(proc: subprocess.Popen, text: str, seen: list[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return
    proc.kill()
    raise AssertionError(f"no line with {text!r}:\n" + "".join(seen)[-3000:])


def catches(pid: int, sig: signal.Signals) -> bool:
    """The process has a handler of its own for sig (Linux: the SigCgt mask in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig.value - 1) & 1)


@pytest.mark.parametrize(("command", "sig"), [("dflash-train", signal.SIGINT), ("dflash-train", signal.SIGTERM),
                                              ("dflash-eval", signal.SIGTERM), ("dflash-regenerate", signal.SIGTERM),
                                              ("dflash-export", signal.SIGTERM)])
def test_a_signal_while_a_command_imports_its_libraries_ends_it_in_one_line(command, sig):
    """Ctrl-C or SIGTERM during the seconds torch and transformers take to import: one line, no traceback."""
    module = MODULES.get(command, "dflash_trainer.export")
    proc = start([module, "--help"])
    deadline = time.monotonic() + 60
    while not catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # until the command's own handlers are in (infra/entry.py, before the imports)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig.value, err[-3000:]
    assert err == f"{command}: stopped by {sig.name} while starting (exit {128 + sig.value})\n" and not out


@pytest.mark.slow  # a trainer process per signal, each through its imports (~10 s on 2 cores)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_trainers_start_up_ends_it_in_one_line(sig, tiny_target, tmp_path):
    out = tmp_path / "run"
    proc = start(["dflash_trainer.train", "--config", "embedded", "--output-dir", str(out), *sets(tiny_target)])
    seen: list[str] = []
    wait_for_line(proc, "note: the base config is the bundled demo's", seen)  # printed once the config is read
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=120)
    err = " ".join(("".join(seen) + rest).split())
    assert proc.returncode == 128 + sig.value, err[-3000:]
    assert "Traceback" not in err and f"stopped by {sig.name} before training started" in err, err[-3000:]
    assert "holds no checkpoint, so there is nothing to resume" in err and "intact" not in err
    assert not ckpt.list_checkpoints(out / "checkpoints")


@pytest.mark.slow  # a trainer process into its loop
def test_two_sigints_before_any_checkpoint_say_there_is_none(tiny_target, tmp_path):
    out = tmp_path / "run"
    proc = start(["dflash_trainer.train", "--config", "embedded", "--output-dir", str(out),
                  *sets(tiny_target, "train.steps=100000", "train.checkpoint_every=100000")])
    seen: list[str] = []
    wait_for_line(proc, "train: step ", seen)  # the loop runs (a log's plain progress line)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=240)
    err = " ".join(("".join(seen) + rest).split())
    assert "Traceback" not in err, err[-3000:]
    written = ckpt.list_checkpoints(out / "checkpoints")
    if proc.returncode == 0:  # the step's checkpoint was written before the second signal came: a clean stop
        assert written and "stopped at step" in err, err[-3000:]
        return
    assert proc.returncode == 130 and "stopped at once by a second SIGINT" in err, err[-3000:]
    if written:
        assert f"the last checkpoint, {written[-1][1].name} " in err and "--resume continues from it" in err
    else:
        assert "holds no checkpoint, so there is nothing to resume" in err and "intact" not in err, err[-3000:]


@pytest.mark.slow  # an evaluation in a process of its own
def test_sigterm_during_an_evaluation_says_nothing_was_written(tiny_target, tmp_path):
    from dflash_trainer.train import main as train

    run = tmp_path / "run"
    assert train(["--config", "embedded", "--output-dir", str(run), *sets(tiny_target, "train.steps=2")]) == 0
    out = tmp_path / "eval"
    first = tmp_path / "first.jsonl"  # one prompt: its set's line says the evaluation runs; the second set follows
    first.write_text(Path(tiny_target["eval"]).read_text().splitlines(keepends=True)[0])
    proc = start(["dflash_trainer.eval", "--run", str(run), "--out", str(out), "--prompts", str(first),
                  tiny_target["eval"], "--max-new-tokens", "64", "--batch-size", "1"])
    seen: list[str] = []
    wait_for_line(proc, "eval: first 1/1 prompts", seen)
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    err = " ".join(("".join(seen) + rest).split())
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM before the evaluation finished: nothing was written" in err, err[-3000:]
    assert not out.exists()
