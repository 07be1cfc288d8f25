"""The console every part of the trainer prints to: stderr, so stdout stays free for what a command
prints as its answer (a table, JSON, a config)."""

from rich.console import Console

console = Console(stderr=True)
