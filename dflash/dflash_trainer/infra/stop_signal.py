"""SIGTERM and SIGINT as a request to stop cleanly, within a `with` block (main thread only: elsewhere the
handlers cannot be installed and the block only holds the state). A second signal raises KeyboardInterrupt at
once. Training stops after the step's checkpoint (run/stop.py), regeneration after the answers in flight."""

from __future__ import annotations

import signal
import threading
from typing import Self


class StopSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

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
            raise KeyboardInterrupt(f"second {name}")
        self.signal_name = name
        self.on_first(name)

    def on_first(self, name: str) -> None:
        """What the first signal does besides being recorded (subclasses)."""
