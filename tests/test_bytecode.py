"""The start-up note for an environment without compiled bytecode (infra/bytecode.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

from dflash_trainer.infra.bytecode import uncompiled_note

PROBE = "import sys, probe_pkg; from dflash_trainer.infra.bytecode import uncompiled_note; " \
        "print(uncompiled_note(probe_pkg))"


def _note_in_child(tmp_path, **env) -> str:
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    environ.update(PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), **env)
    done = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_no_bytecode_and_none_written_is_named_with_the_fix(tmp_path):
    note = _note_in_child(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path / "pyc"))
    assert note.startswith("note: no compiled bytecode for probe_pkg (bytecode writing is off: PYTHONDONTWRITEBYTECODE")
    assert f"-m compileall -q -j 0 {tmp_path}" in note
    assert not (tmp_path / "pyc").exists()  # the check writes nothing


def test_bytecode_python_wrote_or_found_gives_no_note(tmp_path):
    prefix = tmp_path / "pyc"
    assert _note_in_child(tmp_path, PYTHONPYCACHEPREFIX=str(prefix)) == "None"  # written at this import
    assert any(prefix.rglob("*.pyc"))
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(prefix)}
    assert _note_in_child(tmp_path, **env) == "None"  # shipped (written earlier), not written now


def test_torch_is_the_module_checked_by_default(tmp_path, monkeypatch):
    fake = types.ModuleType("torch")
    fake.__file__ = str(tmp_path / "torch" / "__init__.py")  # no bytecode beside it
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert uncompiled_note().startswith("note: no compiled bytecode for torch (")
