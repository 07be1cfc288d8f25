"""SIGTERM and SIGINT: how every command of the trainer ends on them.

A command stops cleanly on a signal within a `StopSignal` block (main thread only: elsewhere the handlers cannot
be installed and the block only holds the state): training after the step's checkpoint (run/stop.py),
regeneration after the answers in flight; it exits 0, its work kept. Outside such a block (start-up: imports,
loading, compiling) and at a second signal, the signal raises `Interrupted` where the program is, SIGTERM as
Ctrl-C does (`interrupt_on_signals`, which every console script installs first): the command unwinds (a refused
start removes what it made), says in one line what it leaves on disk, and exits 128 + the signal's number, as a
shell reports a process the signal killed: 130 for Ctrl-C (SIGINT), 143 for SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
from typing import Self

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signal_name: str) -> int:
    """128 + the signal's number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signal.Signals[signal_name].value


class Interrupted(KeyboardInterrupt):
    """A signal ended the command where it was: during start-up, or a second signal (`second`)."""

    def __init__(self, signal_name: str, second: bool = False):
        super().__init__(f"second {signal_name}" if second else signal_name)
        self.signal_name = signal_name
        self.second = second


def signal_name_of(exc: KeyboardInterrupt) -> str:
    """The signal a KeyboardInterrupt stands for: Interrupted's, else SIGINT (Python's own Ctrl-C)."""
    return getattr(exc, "signal_name", "SIGINT")


_received: list[str] = []  # the signals _interrupt raised Interrupted for, in order


def received() -> str | None:
    """The first signal _interrupt turned into Interrupted in this process, if any: an error that ends a command
    after it (a library whose import the exception cut short, and which fails at its next use) is that stop."""
    return _received[0] if _received else None


def _interrupt(signum, _frame) -> None:
    name = signal.Signals(signum).name
    _received.append(name)
    raise Interrupted(name)


def _install(handler) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)


def interrupt_on_signals() -> None:
    """SIGTERM and SIGINT raise Interrupted where the program is (SIGTERM's default would end the process without
    a word, and skip every cleanup). A signal the parent set to be ignored (nohup, a job started with &) stays
    ignored. Main thread only, as Python's signal handlers are. A command's start: no signal received yet."""
    _received.clear()
    _install(_interrupt)


def exit_on_signals(prog: str) -> None:
    """While a command imports its libraries (nothing written yet, nothing to clean up): a signal ends the process
    at once, in one line. An exception raised into an import half-way (numpy's, transformers') can leave the module
    broken, and the next use fails with another error than the signal."""
    def handler(signum, _frame) -> None:
        name = signal.Signals(signum).name
        os.write(2, f"{prog}: stopped by {name} while starting (exit {exit_code(name)})\n".encode())
        os._exit(exit_code(name))

    _install(handler)


class StopSignal:
    SIGNALS = SIGNALS

    def __init__(self) -> None:
        self.signal_name: str | None = None  # the first signal's name, once one came
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:  # a second signal: stop now
            raise Interrupted(name, second=True)
        self.signal_name = name
        self.on_first(name)

    def on_first(self, name: str) -> None:
        """What the first signal does besides being recorded (subclasses)."""
