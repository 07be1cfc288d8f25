"""dflash-export: a published drafter in another project's format.

    dflash-export --format speculators DRAFTER_DIR OUT [--target PATH_OR_HUB_ID]

DRAFTER_DIR is a drafter directory (a run's OUTPUT/drafter, a checkpoint); --target defaults to the run's
target when DRAFTER_DIR is a run's OUTPUT/drafter. OUT is written whole or not at all."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from .. import cli_args
from ..infra import storage
from ..run import run_dir as run_dir_lib
from .formats import FORMATS
from .source import ExportError, read_drafter

console = Console(stderr=True, highlight=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=sorted(FORMATS),
                   help="; ".join(f"{name}: {f.summary}" for name, f in FORMATS.items()))
    p.add_argument("drafter", type=Path, help="the drafter directory (a run's OUTPUT/drafter, a checkpoint)")
    p.add_argument("out", type=Path, help="the directory to write (replaced whole if it exists)")
    p.add_argument("--target", help="the target's directory or hub id (default: the run's, for OUTPUT/drafter)")
    return p


def run_target(drafter: Path) -> str:
    """The target of the run whose OUTPUT/drafter (or checkpoint) this is."""
    for run in (drafter.parent, drafter.parent.parent):
        try:
            cfg = json.loads((run / "config.json").read_text())
            return str(run_dir_lib.resolve_stored(cfg["target"]["path"], run))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    raise ExportError(f"{drafter} is not inside a training run's output directory, so its target is not known: "
                      "give --target (the target's directory or hub id)")


def main(argv: list[str] | None = None) -> int:
    args = cli_args.parse(parser(), argv)
    if isinstance(args, int):
        return args
    try:
        drafter = read_drafter(args.drafter)
        target = args.target or run_target(args.drafter)
        if args.out.resolve() == args.drafter.resolve():
            raise ExportError(f"OUT {args.out} is the drafter directory itself: give another directory")
        storage.check_can_create(args.out, "OUT")
        with storage.explained(f"writing {args.out}", args.out, "Free space, or give another OUT."):
            storage.publish_dir(args.out, lambda tmp: FORMATS[args.format].write(drafter, target, tmp))
    except (ExportError, storage.StorageError) as exc:
        cli_args.say_error(console, str(exc))
        return cli_args.exit_code(exc, ExportError)
    console.print(f"{args.format}: {args.out} (from {args.drafter}, target {target})", markup=False)
    return cli_args.OK


if __name__ == "__main__":
    sys.exit(main())
