"""The console every part of the trainer prints to: stderr, so stdout stays free for what a command
prints as its answer (a table, JSON, a config)."""

import sys

from rich.console import Console

# Lines are never wrapped by rich (soft_wrap): off a terminal (a log file, journald) it would cut them at 80
# columns, each piece a journal entry of its own; there tables also get the width they need rather than
# cells cut to "prom…" (COLUMNS, which a shell may export, is not the log's width).
LOG_WIDTH = 240


def log_console() -> Console:
    """A stderr console: unwrapped lines; tables as wide as the terminal, or off a terminal LOG_WIDTH."""
    return Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else LOG_WIDTH)


console = log_console()


def plain_output_off_a_terminal() -> None:
    """Where stderr is a log file or journald, no carriage-return progress bars from transformers (loading and
    saving checkpoints): each CLI calls it first. datasets' own bars are turned off where rows load (data.rows)."""
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        disable_progress_bars()  # hub downloads (a drafter given by its hub id)
