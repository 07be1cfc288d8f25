"""Finding and running the external tools this stage drives (uv, mmdebstrap, tar, zstd)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

UV_VERSION = "0.13.9"  # matches [tool.uv] required-version in image/env/pyproject.toml


class ToolError(RuntimeError):
    """A tool is missing or a step failed; the message says what to do."""


def find(tool: str, hint: str) -> str:
    """Path of `tool`: $TOOL (upper case), the running venv's bin/, then PATH."""
    explicit = os.environ.get(tool.upper().replace("-", "_"))
    candidates = [explicit] if explicit else []
    candidates += [str(Path(sys.prefix) / "bin" / tool), shutil.which(tool)]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise ToolError(f"{tool} not found: {hint}")


def uv() -> str:
    return find("uv", f"install it with `pip install uv=={UV_VERSION}` (or set UV=/path/to/uv)")


def run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    """Run a command, its output streaming to ours; raise ToolError naming the step if it fails."""
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    proc = subprocess.run([str(c) for c in cmd], check=False, **kw)
    if proc.returncode != 0:
        raise ToolError(f"{what} failed (exit {proc.returncode}): {' '.join(str(c) for c in cmd)}")
    return proc
