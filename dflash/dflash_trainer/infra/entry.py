"""How every command of the trainer starts and ends (the console scripts and `python -m`): the signals first, then
the imports (seconds: torch, transformers), then the command's main.

- SIGTERM and Ctrl-C before the command's own handling takes over (infra/stop_signal.py) end it in one line with
  exit 130 / 143, never a traceback of the import it was in;
- a reader that stops reading the command's stdout (`| head -1`, `| true`) ends it quietly with exit 0, as the
  Python docs advise for SIGPIPE (stdout pointed at /dev/null, so the interpreter's last flush fails no more).
"""

from __future__ import annotations

import importlib
import os
import select
import sys

from .stop_signal import exit_code, exit_on_signals, interrupt_on_signals, received, signal_name_of


def stdout_closed() -> bool:
    """stdout is a pipe whose reader is gone (poll says POLLERR): a BrokenPipeError is about it, not a socket's."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd (a test's captured stdout), no poll
        return False


def _quiet_stdout() -> None:
    """stdout to /dev/null: what is still buffered, and the interpreter's flush at exit, go nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run_command(prog: str, module: str) -> int:
    """`module`'s main() with the ending above; its exit code. The module is imported here, after the signals: a
    signal during the imports ends the process at once (exit_on_signals), one during main() unwinds it
    (interrupt_on_signals), and what main() does not say itself is said here."""
    exit_on_signals(prog)
    main = importlib.import_module(module).main
    interrupt_on_signals()
    try:
        code = main()
        sys.stdout.flush()  # a closed stdout shows here, inside the try, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        if not stdout_closed():
            raise
        _quiet_stdout()
        return 0
    except BaseException as exc:
        # An Interrupted, or what it left behind (a library its exception cut short, failing at its next use)
        name = signal_name_of(exc) if isinstance(exc, KeyboardInterrupt) else received()
        if name is None:
            raise
        sys.stderr.write(f"{prog}: stopped by {name} before it finished (exit {exit_code(name)})\n")
        return exit_code(name)


def train() -> None:
    sys.exit(run_command("dflash-train", "dflash_trainer.train"))


def evaluate() -> None:
    sys.exit(run_command("dflash-eval", "dflash_trainer.eval.cli"))


def regenerate() -> None:
    sys.exit(run_command("dflash-regenerate", "dflash_trainer.regenerate.cli"))


def export() -> None:
    sys.exit(run_command("dflash-export", "dflash_trainer.export.cli"))
