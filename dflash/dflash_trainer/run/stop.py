"""Graceful stop: SIGTERM / SIGINT finish the step in progress, write a checkpoint, exit cleanly.

`make train-stop` and `systemctl stop` send SIGTERM (to torchrun, which forwards it to every worker).
Drafter ranks agree on the step to stop at (one tiny all-reduce per step), the lead writes the
checkpoint, and `--resume` continues from exactly there. A second signal stops at once.
"""

from __future__ import annotations

import signal
import threading
from typing import Self

import torch

from ..distributed import parallel
from ..infra.console import console


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        if self.requested:  # a second signal: stop now, without the checkpoint
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.requested = True
        console.print(f"{signal.Signals(signum).name}: stopping after this step's checkpoint "
                      "(send it again to stop at once)")

    def agreed(self, ctx: parallel.Context, device) -> bool:
        """Every drafter rank calls it after each step: True on all of them when any one was signalled."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        return bool(parallel.all_reduce_sum(ctx, flag).item() > 0)
