"""python -m dflash_trainer.bench.peers --peer specforge|speculators --features DIR --target PATH --out DIR
[--config NAME --set k=v ...]

Trains a peer's DFlash drafter (SpecForge's or vLLM speculators' model, loss and step, from their installed
packages) on the features our trainer dumped (`dflash-train ... --dump-features DIR`), with the run config our
trainer reads (the same flags: --config, --set): the same micro-batches in the same order, steps, block size,
anchors, layers, learning-rate schedule and precision. Writes OUT/drafter (our drafter format: dflash-eval
--drafter OUT/drafter) and OUT/summary.json. Exit 0 done, 1 a fault while training, 2 bad input (a missing
peer: the message gives the install command).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...cli_args import (
    BAD_INPUT,
    FAULT,
    add_config_flags,
    directory,
    exit_code,
    key_flag,
    parse_with_config,
    say_error,
)
from ...infra.console import console, plain_output_off_a_terminal
from .common import PeerMissing, PeerRefused

PEERS = ("specforge", "speculators")
KEY_FLAGS = {"--target": "target.path", "--features": "data.features_dir"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_trainer.bench.peers", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", required=True, choices=PEERS, help="whose model, loss and step train the drafter")
    key_flag(p, "--features", "data.features_dir", "the features our trainer dumped (--dump-features DIR)",
             required=True, type=directory)
    key_flag(p, "--target", "target.path", "the target whose features they are (its embedding and LM head)",
             required=True)
    p.add_argument("--out", required=True, type=directory,
                   help="where OUT/drafter and OUT/summary.json go (a new directory)")
    add_config_flags(p)
    return p


def peer_module(name: str):
    if name == "specforge":
        from . import specforge_peer

        return specforge_peer
    from . import speculators_peer

    return speculators_peer


def main(argv: list[str] | None = None) -> int:
    plain_output_off_a_terminal()
    parsed = parse_with_config(parser(), argv, KEY_FLAGS, console)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    out = Path(args.out)
    if (out / "summary.json").exists() or (out / "drafter").exists():
        say_error(console, f"--out {out} holds a drafter already: give a new directory (or remove this one)")
        return BAD_INPUT
    import torch

    from .common import load_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        peer = peer_module(args.peer)
        peer.modules()  # PeerMissing before the features are read
        inputs = load_inputs(cfg, device)
        out.mkdir(parents=True, exist_ok=True)
        summary = peer.train(inputs, out)
    except (PeerMissing, PeerRefused) as exc:
        say_error(console, str(exc))
        return BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - one line and the exit code the contract gives it
        code = exit_code(exc)
        say_error(console, f"{type(exc).__name__}: {exc}" if code == FAULT else str(exc))
        if code == FAULT:
            console.print_exception()
        return code
    console.print(f"{args.peer}: {summary['steps']} steps in {summary['train_s']:.1f} s, loss "
                  f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, drafter in {summary['drafter_dir']}",
                  markup=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
