"""Graceful stop: SIGTERM / SIGINT finish the step in progress, write a checkpoint, exit cleanly.

`make train-stop` and `systemctl stop` send SIGTERM (to torchrun, which forwards it to every worker).
Drafter ranks agree on the step to stop at (one tiny all-reduce per step), the lead writes the
checkpoint, and `--resume` continues from exactly there. A second signal stops at once.
"""

from __future__ import annotations

import torch

from ..distributed import parallel
from ..infra.console import console
from ..infra.stop_signal import StopSignal


class StopRequest(StopSignal):
    def on_first(self, name: str) -> None:
        console.print(f"{name}: stopping after this step's checkpoint (send it again to stop at once)")

    def agreed(self, ctx: parallel.Context, device) -> bool:
        """Every drafter rank calls it after each step: True on all of them when any one was signalled."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        return bool(parallel.all_reduce_sum(ctx, flag).item() > 0)
