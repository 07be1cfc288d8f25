"""The console every part of the trainer prints to: stderr, so stdout stays free for what a command
prints as its answer (a table, JSON, a config).

Two formats (--log-format, cli_args.use_log_format): text, as a terminal or a log shows it, and json, one
JSON object a line for log collectors: every line printed becomes {"time", "stage", "message"}, and a
progress line (metrics.say_progress) adds its figures as fields (step, loss, tokens_per_s, tau, ...)."""

import io
import json
import sys
from datetime import UTC, datetime

from rich.console import Console

# Lines are never wrapped by rich (soft_wrap): off a terminal (a log file, journald) it would cut them at 80
# columns, each piece a journal entry of its own; there tables also get the width they need rather than
# cells cut to "prom…" (COLUMNS, which a shell may export, is not the log's width).
LOG_WIDTH = 240
LOG_FORMATS = ("text", "json")


class LogConsole(Console):
    """rich's console, with a JSON mode: what print() renders goes out as the `message` of one JSON object (plain
    text, no colours, a table's lines joined by newlines)."""

    def __init__(self, **kwargs):
        """kwargs: rich's Console arguments, over the trainer's (stderr, unwrapped, LOG_WIDTH off a terminal)."""
        kwargs = {"stderr": True, "soft_wrap": True, "width": None if sys.stderr.isatty() else LOG_WIDTH, **kwargs}
        super().__init__(**kwargs)
        self.log_format = "text"
        self.stage = ""

    def use(self, log_format: str, stage: str) -> None:
        """log_format: one of LOG_FORMATS; stage: the command's name in each JSON line (train, regenerate, eval)."""
        self.log_format, self.stage = log_format, stage

    @property
    def json_lines(self) -> bool:
        return self.log_format == "json"

    def print(self, *objects, **kwargs) -> None:
        if not self.json_lines:
            return super().print(*objects, **kwargs)
        if self.quiet:
            return None
        plain = Console(file=io.StringIO(), width=LOG_WIDTH, soft_wrap=True, color_system=None, highlight=False)
        plain.print(*objects, **kwargs)
        self.json_line(plain.file.getvalue().rstrip("\n"))
        return None

    def json_line(self, message: str, **fields) -> None:
        """One JSON line: the time (UTC), the stage, the message and the fields given (None ones left out)."""
        if self.quiet:
            return
        line = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), "stage": self.stage,
                "message": message, **{k: v for k, v in fields.items() if v is not None}}
        sys.stderr.write(json.dumps(line) + "\n")
        sys.stderr.flush()


def log_console() -> LogConsole:
    """A stderr console: unwrapped lines; tables as wide as the terminal, or off a terminal LOG_WIDTH."""
    return LogConsole()


console = log_console()


def plain_output_off_a_terminal() -> None:
    """Where stderr is a log file or journald, no carriage-return progress bars from transformers (loading and
    saving checkpoints): each CLI calls it first. datasets' own bars are turned off where rows load (data.rows)."""
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        disable_progress_bars()  # hub downloads (a drafter given by its hub id)
