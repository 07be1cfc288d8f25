"""The export formats by name: each writes a drafter directory in another project's format. A new format
(DSpark, DFlash 2) is one module beside speculators.py and one entry in FORMATS."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import speculators
from .source import Drafter, target_config


@dataclass(frozen=True)
class Format:
    write: Callable[[Drafter, str, Path], None]  # (drafter, target path or hub id, an empty directory)
    summary: str


def _speculators(drafter: Drafter, target: str, out: Path) -> None:
    speculators.write(drafter, target, target_config(target), out)


FORMATS: dict[str, Format] = {
    "speculators": Format(_speculators, "vLLM's speculators (DFlashSpeculatorConfig, DSparkSpeculatorConfig for DSpark; speculators 0.9)"),
}
