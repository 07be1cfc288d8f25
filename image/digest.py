"""The sha256 of a file, and the form a wheel's RECORD writes it in: the one copy this package uses."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a file's content."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_form(hexdigest: str) -> str:
    """A sha256 as RECORD lines carry it (`sha256=<this>`): urlsafe base64 without padding."""
    return base64.urlsafe_b64encode(bytes.fromhex(hexdigest)).rstrip(b"=").decode()
