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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
    optimize = _pyc_optimization(pyc)
    if optimize is None:
        return None
    source = _pyc_source(pyc)
    try:
        data, src = pyc.read_bytes(), source.read_bytes()
    except OSError:
        return None
    if not _import_accepts_header(data, src, source):
        return None  # rejected: the source is compiled instead
    return _bytecode_mismatch(data[16:], src, source, optimize)


def _pyc_optimization(pyc: Path) -> int | None:
    """The optimization level of a `<module>.<cache tag>[.opt-N].pyc` this interpreter would load, else None."""
    parts = pyc.name.split(".")
    if len(parts) not in (3, 4) or parts[1] != sys.implementation.cache_tag:
        return None
    if len(parts) == 3:
        return 0
    if not (parts[2].startswith("opt-") and parts[2][4:].isdigit()):
        return None
    return int(parts[2][4:])


def _pyc_source(pyc: Path) -> Path:
    """The source file a `__pycache__/<module>.*.pyc` is the bytecode of."""
    return pyc.parent.parent / f"{pyc.name.split('.')[0]}.py"


def _import_accepts_header(data: bytes, src: bytes, source: Path) -> bool:
    """Whether the import system would run this bytecode for `source` rather than compile the source: the
    magic number of this interpreter, known flags, and a hash or mtime and size that fit the source."""
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(data[4:8], "little")
    if flags & ~0b11:
        return False
    if flags & 0b01:  # hash-based; a checked one must carry its source's hash, an unchecked one always runs
        return not flags & 0b10 or data[8:16] == importlib.util.source_hash(src)
    st = source.stat()
    return (int.from_bytes(data[8:12], "little"), int.from_bytes(data[12:16], "little")) == (
        int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)


def _bytecode_mismatch(code_bytes: bytes, src: bytes, source: Path, optimize: int) -> str | None:
    """Why the marshalled code is not a fresh compile of the source, or None when it is."""
    try:
        code = marshal.loads(code_bytes)
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


@dataclass
class _Venv:
    """What one check compares: the venv's files, who installed them, and what the build made."""
    venv: Path
    sites: list[Path]
    locked: set[str]
    built: dict | None
    hashes: bool
    owner: dict[Path, str] = field(default_factory=dict)  # file -> the distribution whose RECORD lists it
    owner_key: dict[Path, str] = field(default_factory=dict)  # file -> that distribution's key in `installed`
    record: dict[Path, tuple[str, str, int | None]] = field(default_factory=dict)  # file -> (RECORD entry, hash, size)
    replaced: set[Path] = field(default_factory=set)  # files make deploy may replace: judged by RECORD only
    in_manifest: dict[Path, tuple[str, int]] = field(default_factory=dict)  # file -> (sha256, size) at build

    def read_records(self, installed: dict[str, md.Distribution]) -> None:
        for key, dist in installed.items():
            name = dist.metadata["Name"]
            base = Path(dist.locate_file(""))
            for entry in dist.files or []:
                path = Path(os.path.normpath(base / entry))
                self.owner[path], self.owner_key[path] = name, key
                if entry.hash is not None:
                    self.record[path] = (str(entry), entry.hash.value, entry.size)

    def read_manifest(self, local: set[str]) -> None:
        built = self.built or {}
        self.replaced = {self.venv / rel for rel in built.get("replaceable", ())} | {
            path for path, key in self.owner_key.items() if key in local}
        self.in_manifest = {self.venv / rel: entry for rel, entry in built.get("files", {}).items()
                            if self.venv / rel not in self.replaced}

    def unit(self, path: Path) -> str:
        """What a file's drift is reported under: its top-level name in site-packages (a package, a dist-info),
        else its top-level name in the venv (bin, pyvenv.cfg)."""
        for site in self.sites:
            if path.is_relative_to(site):
                return path.relative_to(site).parts[0]
        return path.relative_to(self.venv).parts[0]


def check(venv: Path, installed: dict[str, md.Distribution], locked: set[str], local: set[str], sites: list[Path],
          built: dict | None, hashes: bool) -> tuple[list[Finding], dict]:
    """Findings, and what was checked ({"files": n, "pyc_compiled": n}). `locked`: the lock's package names;
    `local`: those it installs from a local wheel (the trainer, which make deploy may replace): their files
    are checked against their RECORD, not against the build manifest."""
    scope = _Venv(venv, sites, locked, built, hashes)
    scope.read_records(installed)
    scope.read_manifest(local)
    todo = sorted(set(scope.record) | {p for p in scope.in_manifest if not _is_pyc(p)})
    with ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 2) * 2)) as pool:
        prints = dict(zip(todo, pool.map(lambda p: _fingerprint(p, hashes), todo), strict=True))
    record_findings, record_ok = _record_drift(scope, prints)
    walk = _walk_sites(scope)
    if built:
        _count_added_outside_sites(scope, walk.added)
    pyc_findings, compiled = _pyc_drift(scope, walk.pycs)
    findings = [*record_findings, *_manifest_drift(scope, prints, record_ok), *_link_drift(scope),
                *walk.findings, *_orphan_findings(walk.orphans), *_added_findings(scope, walk.added), *pyc_findings]
    return findings, {"files": len(todo), "pyc_compiled": compiled}


def _record_drift(scope: _Venv, prints: dict) -> tuple[list[Finding], dict[Path, bool]]:
    """Files whose content (or, without hashes, size) no longer fits their RECORD line; and per RECORD file
    whether it fits."""
    findings: list[Finding] = []
    record_ok: dict[Path, bool] = {}
    for path, (entry, digest, size) in sorted(scope.record.items()):
        fp = prints[path]
        how = ("deleted" if fp is None else "content changed" if scope.hashes and record_form(fp[0]) != digest
               else "size changed" if not scope.hashes and size is not None and fp[1] != size else None)
        record_ok[path] = how is None
        if how:
            owner = scope.owner[path]
            findings.append(Finding("modified", owner, f"{entry}: {how} since install (RECORD of {owner})", REBUILD))
    return findings, record_ok


def _manifest_drift(scope: _Venv, prints: dict, record_ok: dict[Path, bool]) -> list[Finding]:
    """Files that differ from the build manifest, one finding per unit and kind of drift."""
    drifted: dict[tuple[str, str], list[Path]] = {}  # (unit, how) -> files; a unit is a top-level folder or file
    for path, (digest, size) in sorted(scope.in_manifest.items()):
        if _is_pyc(path) or not record_ok.get(path, True):
            continue  # bytecode is judged against its source below; a RECORD finding already names the file
        fp = prints[path]
        how = ("deleted" if fp is None else None if fp[1] == size and (not scope.hashes or fp[0] == digest)
               else "rewritten" if path in record_ok else "differs")
        if how:
            drifted.setdefault((scope.unit(path), how), []).append(path)
    findings = []
    for (unit, how), paths in sorted(drifted.items()):
        pkgs = {scope.owner[p] for p in paths if p in scope.owner}
        findings.append(Finding("modified", pkgs.pop() if len(pkgs) == 1 else None,
                                _drift_detail(unit, how, paths, scope.venv), REBUILD))
    return findings


def _link_drift(scope: _Venv) -> list[Finding]:
    """Symlinks the build made that now point elsewhere or are no longer links."""
    findings = []
    for rel, target in sorted((scope.built or {}).get("links", {}).items()):
        path = scope.venv / rel
        now = os.readlink(path) if path.is_symlink() else None
        if now != target:
            findings.append(Finding("modified", None, f"{rel}: the build made it a link to {target}, it is "
                                    + (f"now a link to {now}" if now else "no longer a link"), REBUILD))
    return findings


@dataclass
class _SiteWalk:
    """What a walk of site-packages found besides the files RECORDs and the manifest account for."""
    findings: list[Finding] = field(default_factory=list)  # .pth files and startup hooks no RECORD lists
    orphans: Counter[str] = field(default_factory=Counter)  # top-level name -> files no RECORD lists
    # locked package, or top-level name outside site-packages -> files the build did not make
    added: Counter[str] = field(default_factory=Counter)
    pycs: list[Path] = field(default_factory=list)


def _walk_sites(scope: _Venv) -> _SiteWalk:
    walk = _SiteWalk()
    for site in scope.sites:
        for root, _dirs, files in os.walk(site):
            for f in files:
                _sort_site_file(scope, walk, site, Path(root) / f)
    return walk


def _sort_site_file(scope: _Venv, walk: _SiteWalk, site: Path, path: Path) -> None:
    """Put one file of site-packages where it belongs in the walk's tallies, or nowhere when accounted for."""
    f = path.name
    if f.endswith(".pyc") and path.parent.name == "__pycache__":
        walk.pycs.append(path)
        return
    if path in scope.owner:
        if (scope.built and path not in scope.in_manifest and path not in scope.replaced
                and scope.owner_key[path] in scope.locked):
            walk.added[scope.owner[path]] += 1
        return  # a package the lock does not name is reported as extra
    if path in scope.in_manifest:
        return
    rel = path.relative_to(site)
    top_level = len(rel.parts) == 1
    if top_level and f in VENV_FILES:
        return
    if f.endswith(".pth"):
        walk.findings.append(_runs_at_start("orphan-pth", rel))
    elif top_level and f in STARTUP_HOOKS:
        walk.findings.append(_runs_at_start("startup-hook", rel))
    else:
        walk.orphans[rel.parts[0]] += 1


def _runs_at_start(kind: str, rel: Path) -> Finding:
    return Finding(kind, None, f"{rel} is in no RECORD and runs at every interpreter start",
                   f"delete it, then {REBUILD}")


def _count_added_outside_sites(scope: _Venv, added: Counter[str]) -> None:
    """Count, per top-level name, files and folder links outside site-packages (bin/, pyvenv.cfg, the lock
    copy) that the build did not make."""
    site_set = set(scope.sites)
    for root, dirs, files in os.walk(scope.venv):
        dirs[:] = [d for d in dirs if Path(root) / d not in site_set]
        for f in [*files, *(d for d in dirs if (Path(root) / d).is_symlink())]:
            path = Path(root) / f
            rel = path.relative_to(scope.venv).as_posix()
            if (path not in scope.in_manifest and rel not in scope.built["links"] and path not in scope.owner
                    and path not in scope.replaced):
                added[rel.split("/")[0]] += 1


def _orphan_findings(orphans: Counter[str]) -> list[Finding]:
    return [Finding("orphan", None, f"{top}: {n} file(s) that no installed package's RECORD lists "
                    "(left over by a removed or hand-copied package)", REBUILD) for top, n in sorted(orphans.items())]


def _added_findings(scope: _Venv, added: Counter[str]) -> list[Finding]:
    packages = set(scope.owner.values())
    return [Finding("modified", where if where in packages else None,
                    f"{where}: {n} file(s) added since the build (build manifest)", REBUILD)
            for where, n in sorted(added.items())]


def _pyc_drift(scope: _Venv, pycs: list[Path]) -> tuple[list[Finding], int]:
    """Bytecode Python would run instead of its source's, and how many `.pyc` files were compiled to tell:
    the build's own, unchanged, are trusted."""
    findings = []
    compiled = 0
    for pyc in sorted(pycs):
        entry = scope.in_manifest.get(pyc)
        if entry and _fingerprint(pyc, scope.hashes) == ((entry[0] if scope.hashes else None), entry[1]):
            continue  # the build's own bytecode, unchanged
        compiled += 1
        why = pyc_mismatch(pyc)
        if why:
            findings.append(Finding("modified", scope.owner.get(_pyc_source(pyc)),
                                    f"{pyc.relative_to(scope.venv)}: {why}", f"delete it, then {REBUILD}"))
    return findings, compiled


# How a file drifted from the build manifest: (said of one file, said of several).
REWRITTEN = "(the RECORD was rewritten to fit)"
DRIFT = {"deleted": ("deleted since the build", "deleted since the build"),
         "differs": ("content differs from the build manifest", "differ from the build manifest"),
         "rewritten": (f"content differs from the build manifest, although its RECORD line matches it {REWRITTEN}",
                       f"differ from the build manifest, although their RECORD lines match them {REWRITTEN}")}


def _drift_detail(unit: str, how: str, paths: list[Path], venv: Path) -> str:
    one, many = DRIFT[how]
    if len(paths) == 1:
        return f"{paths[0].relative_to(venv)}: {one}" + (" (build manifest)" if how == "deleted" else "")
    examples = ", ".join(str(p.relative_to(venv)) for p in paths[:3])
    return f"{unit}: {len(paths)} files {many} (build manifest), e.g. {examples}"


def _is_pyc(path: Path) -> bool:
    return path.suffix == ".pyc" and path.parent.name == "__pycache__"
