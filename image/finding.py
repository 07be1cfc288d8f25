"""One thing the drift doctor found, and the fix it names."""

from __future__ import annotations

from dataclasses import dataclass

REBUILD = "make rebuild (locally) or re-create the container from the template (make image)"


@dataclass(frozen=True)
class Finding:
    # missing | extra | version | build | installer | modified | orphan-pth | startup-hook | orphan |
    # system-site | sys-path | startup | manifest | driver
    kind: str
    package: str | None
    detail: str
    fix: str
