"""The console every part of the trainer prints to: stderr, so stdout stays free for what a command
prints as its answer (a table, JSON, a config)."""

import sys

from rich.console import Console

console = Console(stderr=True)


def plain_output_off_a_terminal() -> None:
    """Where stderr is a log file or journald, no carriage-return progress bars from transformers (loading and
    saving checkpoints): each CLI calls it first. datasets' own bars are turned off where rows load (data.rows)."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
