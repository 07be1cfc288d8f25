"""File-level checks of the venv: RECORD hashes, the build manifest, bytecode, files nobody installed.

RECORD alone is not enough: it sits inside the venv and can be rewritten with the file it describes.
The build manifest (dflash_image.manifest, beside the venv) has every file's hash from the clean build.
`.pyc` files are in no RECORD, and a `.pyc` Python accepts runs instead of its source: each one that
the manifest does not vouch for is compared with a fresh compile of its source.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import marshal
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_image.digest import record_form, sha256_of
from dflash_image.finding import REBUILD, Finding

# Files uv's `venv` puts in site-packages itself; no wheel's RECORD lists them.
VENV_FILES = {"_virtualenv.py", "_virtualenv.pth"}
# site imports these at every interpreter start, from anywhere on sys.path.
STARTUP_HOOKS = {"sitecustomize.py", "usercustomize.py"}


def pyc_mismatch(pyc: Path) -> str | None:
    """Why Python would run this `__pycache__/*.pyc` although it is not its source's bytecode, or None: it
    matches a fresh compile, or the import system would not use it (another interpreter's, stale for a
    changed source, or no source beside its __pycache__), the same rules as importlib's SourceLoader."""
    parts = pyc.name.split(".")  # <module>.<cache tag>[.opt-N].pyc
    if len(parts) not in (3, 4) or parts[1] != sys.implementation.cache_tag:
        return None
    optimize = 0
    if len(parts) == 4:
        if not (parts[2].startswith("opt-") and parts[2][4:].isdigit()):
            return None
        optimize = int(parts[2][4:])
    source = pyc.parent.parent / f"{parts[0]}.py"
    try:
        data, src = pyc.read_bytes(), source.read_bytes()
    except OSError:
        return None
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER or int.from_bytes(data[4:8], "little") & ~0b11:
        return None  # rejected: the source is compiled instead
    flags = int.from_bytes(data[4:8], "little")
    if flags & 0b01:  # hash-based; a checked one must carry its source's hash, an unchecked one always runs
        if flags & 0b10 and data[8:16] != importlib.util.source_hash(src):
            return None
    else:
        st = source.stat()
        if (int.from_bytes(data[8:12], "little"), int.from_bytes(data[12:16], "little")) != (
                int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF):
            return None
    try:
        code = marshal.loads(data[16:])
    except (EOFError, ValueError, TypeError):
        return f"Python would load it instead of {source.name}, and it is not valid bytecode"
    try:
        fresh = compile(src, str(source), "exec", dont_inherit=True, optimize=optimize)
    except (SyntaxError, ValueError):
        return f"Python would run it instead of {source.name}, which does not compile"
    if code != fresh:
        return f"Python would run it instead of {source.name}, and it does not match a fresh compile of it"
    return None


def _fingerprint(path: Path, hashes: bool) -> tuple[str | None, int] | None:
    """(sha256 or None, size) of a regular file; None when it is gone (or no longer a regular file)."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        return (sha256_of(path) if hashes else None), path.stat().st_size
    except FileNotFoundError:
        return None


def check(venv: Path, installed: dict[str, md.Distribution], locked: set[str], local: set[str], sites: list[Path],
          built: dict | None, hashes: bool) -> tuple[list[Finding], dict]:
    """Findings, and what was checked ({"files": n, "pyc_compiled": n}). `locked`: the lock's package names;
    `local`: those it installs from a local wheel (the trainer, which make deploy may replace): their files
    are checked against their RECORD, not against the build manifest."""
    findings: list[Finding] = []
    owner: dict[Path, str] = {}  # file -> the distribution whose RECORD lists it
    owner_key: dict[Path, str] = {}
    record: dict[Path, tuple[str, str, int | None]] = {}  # file -> (RECORD entry, hash, size)
    for key, dist in installed.items():
        name = dist.metadata["Name"]
        base = Path(dist.locate_file(""))
        for entry in dist.files or []:
            path = Path(os.path.normpath(base / entry))
            owner[path], owner_key[path] = name, key
            if entry.hash is not None:
                record[path] = (str(entry), entry.hash.value, entry.size)
    replaced = {venv / rel for rel in (built or {}).get("replaceable", ())} | {
        path for path, key in owner_key.items() if key in local}
    in_manifest = {venv / rel: entry for rel, entry in (built or {}).get("files", {}).items()
                   if venv / rel not in replaced}
    todo = sorted(set(record) | {p for p in in_manifest if not _is_pyc(p)})
    with ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 2) * 2)) as pool:
        prints = dict(zip(todo, pool.map(lambda p: _fingerprint(p, hashes), todo), strict=True))

    record_ok: dict[Path, bool] = {}
    for path, (entry, digest, size) in sorted(record.items()):
        fp = prints[path]
        how = ("deleted" if fp is None else "content changed" if hashes and record_form(fp[0]) != digest
               else "size changed" if not hashes and size is not None and fp[1] != size else None)
        record_ok[path] = how is None
        if how:
            findings.append(Finding("modified", owner[path], f"{entry}: {how} since install (RECORD of {owner[path]})",
                                    REBUILD))

    drifted: dict[tuple[str, str], list[Path]] = {}  # (unit, how) -> files; a unit is a top-level folder or file
    for path, (digest, size) in sorted(in_manifest.items()):
        if _is_pyc(path) or not record_ok.get(path, True):
            continue  # bytecode is judged against its source below; a RECORD finding already names the file
        fp = prints[path]
        how = ("deleted" if fp is None else None if fp[1] == size and (not hashes or fp[0] == digest)
               else "rewritten" if path in record_ok else "differs")
        if how:
            drifted.setdefault((_unit(path, venv, sites), how), []).append(path)
    for (unit, how), paths in sorted(drifted.items()):
        pkgs = {owner[p] for p in paths if p in owner}
        findings.append(Finding("modified", pkgs.pop() if len(pkgs) == 1 else None, _drift_detail(unit, how, paths, venv),
                                REBUILD))
    for rel, target in sorted((built or {}).get("links", {}).items()):
        path = venv / rel
        now = os.readlink(path) if path.is_symlink() else None
        if now != target:
            findings.append(Finding("modified", None, f"{rel}: the build made it a link to {target}, it is "
                                    + (f"now a link to {now}" if now else "no longer a link"), REBUILD))

    orphans: dict[str, int] = {}  # top-level name in site-packages -> files no RECORD lists
    added: dict[str, int] = {}  # locked package, or folder outside site-packages -> files the build did not make
    pycs: list[Path] = []
    site_set = set(sites)
    for site in sites:
        for root, _dirs, files in os.walk(site):
            for f in files:
                path = Path(root) / f
                if f.endswith(".pyc") and Path(root).name == "__pycache__":
                    pycs.append(path)
                    continue
                if path in owner:
                    if built and path not in in_manifest and owner_key[path] in locked and path not in replaced:
                        added[owner[path]] = added.get(owner[path], 0) + 1
                    continue  # a package the lock does not name is reported as extra
                if path in in_manifest:
                    continue
                rel = path.relative_to(site)
                if len(rel.parts) == 1 and f in VENV_FILES:
                    continue
                if f.endswith(".pth"):
                    findings.append(Finding("orphan-pth", None, f"{rel} is in no RECORD and runs at every interpreter "
                                            "start", f"delete it, then {REBUILD}"))
                elif len(rel.parts) == 1 and f in STARTUP_HOOKS:
                    findings.append(Finding("startup-hook", None, f"{rel} is in no RECORD and runs at every "
                                            "interpreter start", f"delete it, then {REBUILD}"))
                else:
                    orphans[rel.parts[0]] = orphans.get(rel.parts[0], 0) + 1
    if built:  # outside site-packages (bin/, pyvenv.cfg, the lock copy): what the build did not make
        for root, dirs, files in os.walk(venv):
            dirs[:] = [d for d in dirs if Path(root) / d not in site_set]
            for f in [*files, *(d for d in dirs if (Path(root) / d).is_symlink())]:
                path = Path(root) / f
                rel = path.relative_to(venv).as_posix()
                if path not in in_manifest and rel not in built["links"] and path not in owner and path not in replaced:
                    top = rel.split("/")[0]
                    added[top] = added.get(top, 0) + 1
    for top, n in sorted(orphans.items()):
        findings.append(Finding("orphan", None, f"{top}: {n} file(s) that no installed package's RECORD lists "
                                "(left over by a removed or hand-copied package)", REBUILD))
    packages = set(owner.values())
    for where, n in sorted(added.items()):
        findings.append(Finding("modified", where if where in packages else None,
                                f"{where}: {n} file(s) added since the build (build manifest)", REBUILD))

    compiled = 0
    for pyc in sorted(pycs):
        entry = in_manifest.get(pyc)
        if entry and _fingerprint(pyc, hashes) == ((entry[0] if hashes else None), entry[1]):
            continue  # the build's own bytecode, unchanged
        compiled += 1
        why = pyc_mismatch(pyc)
        if why:
            source = pyc.parent.parent / (pyc.name.split(".")[0] + ".py")
            findings.append(Finding("modified", owner.get(source), f"{pyc.relative_to(venv)}: {why}",
                                    f"delete it, then {REBUILD}"))
    return findings, {"files": len(todo), "pyc_compiled": compiled}


# How a file drifted from the build manifest: (said of one file, said of several).
REWRITTEN = "(the RECORD was rewritten to fit)"
DRIFT = {"deleted": ("deleted since the build", "deleted since the build"),
         "differs": ("content differs from the build manifest", "differ from the build manifest"),
         "rewritten": (f"content differs from the build manifest, although its RECORD line matches it {REWRITTEN}",
                       f"differ from the build manifest, although their RECORD lines match them {REWRITTEN}")}


def _unit(path: Path, venv: Path, sites: list[Path]) -> str:
    """What a file's drift is reported under: its top-level name in site-packages (a package, a dist-info),
    else its top-level name in the venv (bin, pyvenv.cfg)."""
    for site in sites:
        if path.is_relative_to(site):
            return path.relative_to(site).parts[0]
    return path.relative_to(venv).parts[0]


def _drift_detail(unit: str, how: str, paths: list[Path], venv: Path) -> str:
    one, many = DRIFT[how]
    if len(paths) == 1:
        return f"{paths[0].relative_to(venv)}: {one}" + (" (build manifest)" if how == "deleted" else "")
    examples = ", ".join(str(p.relative_to(venv)) for p in paths[:3])
    return f"{unit}: {len(paths)} files {many} (build manifest), e.g. {examples}"


def _is_pyc(path: Path) -> bool:
    return path.suffix == ".pyc" and path.parent.name == "__pycache__"
