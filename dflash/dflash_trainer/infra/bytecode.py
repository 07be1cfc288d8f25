"""Whether this Python environment holds compiled bytecode for torch: a start without it compiles about
2,400 modules of torch, transformers and their dependencies from source again, every time.

Measured on an H200 host at the Gemma 3 270M shape: the trainer's imports took 4.9-7.2 s with bytecode and
14.9-19.2 s without it (an environment installed without .pyc files and run with PYTHONDONTWRITEBYTECODE).
The frozen image compiles its bytecode when it is built; a venv made by hand may not have it, and Python
writes none where the venv is read-only or PYTHONDONTWRITEBYTECODE is set.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def uncompiled_note(module: ModuleType | None = None) -> str | None:
    """A line that says the environment has no bytecode for `module` (torch by default) and how to compile
    it once; None where the bytecode is there (Python wrote it at this import, or it was shipped)."""
    if module is None:
        import torch as module
    source = getattr(module, "__file__", None)
    if not source or not source.endswith(".py"):
        return None
    try:
        cached = importlib.util.cache_from_source(source)
    except NotImplementedError:  # an interpreter without bytecode caching
        return None
    if os.path.exists(cached):
        return None
    why = "bytecode writing is off: PYTHONDONTWRITEBYTECODE or python -B" if sys.dont_write_bytecode \
        else f"{Path(cached).parent} is not writable"
    path = Path(source)
    site = path.parents[1] if path.name == "__init__.py" else path.parent  # the folder that holds it
    return (f"note: no compiled bytecode for {module.__name__} ({why}): every start compiles the sources of "
            f"torch and transformers again (about 10 s). Compile them once, as the owner of that folder: "
            f"{sys.executable} -m compileall -q -j 0 {site}")
