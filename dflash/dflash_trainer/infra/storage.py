"""The run's files on disk: what a failed write means in words, and writes that replace a file or a
directory in one step (a reader sees the old one or the new one, never a mix)."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class StorageError(RuntimeError):
    """A write to the run's storage failed (disk full, read-only, no permission): says which, and where."""


_WORDS = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied (read-only for this user)",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large for this file system",
}


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind exc: itself, its cause or context, or the errno that torch.save and safetensors
    put in their own error types ("os error 28")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        match = re.search(r"os error (\d+)", str(exc))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        exc = exc.__cause__ or exc.__context__
    return None


def describe(error: OSError, where: Path) -> str:
    words = _WORDS.get(error.errno, error.strerror or str(error))
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            words += f", {shutil.disk_usage(_existing(where)).free / 2**20:,.1f} MiB free there"
        except OSError:
            pass
    return words


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextmanager
def explained(doing: str, where: Path, fix: str) -> Iterator[None]:
    """Turn a failed write into a StorageError: '<doing>: disk full (...). <fix>'."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        error = os_error_in(exc)
        if error is None:
            raise
        raise StorageError(f"{doing}: {describe(error, Path(where))}. {fix}") from exc


def check_writable(directory: Path) -> None:
    """Create directory (and parents) and prove a file can be written in it; nothing is left behind."""
    with explained(f"cannot write to the output directory {directory}", directory,
                   "Give a writable --output-dir (or make this one writable)."):
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)


def check_can_create(path: Path, flag: str) -> None:
    """path (a directory a command will write, named by its option `flag`), or the directory it will be made
    in, takes files: checked before the work starts, creating nothing (a probe file is made and removed).
    A file in the way is a ValueError (the input needs a change), a write that fails a StorageError."""
    path = Path(path)
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    if where == path and not where.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a directory: give a directory")
    if not where.is_dir():
        raise ValueError(f"{flag} {path}: {where} is a file, so no directory can be made there: give another {flag}")
    with explained(f"cannot write to {flag} {path}" + (f" (in {where})" if where != path else ""), where,
                   f"Give a writable {flag} (or make this one writable)"):
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=where)
        os.close(fd)
        os.unlink(probe)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    # Files first, then the directories that name them: after a power loss the rename must not
    # expose a directory whose entries or contents are still only in the page cache.
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def _umask() -> int:
    try:  # read, not set: os.umask would change it for every thread for a moment
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE).group(1), 8)
    except (OSError, AttributeError):
        return 0o022


FILE_MODE, DIR_MODE = 0o666, 0o777  # less the umask: what open() and mkdir give


def readable_tree(root: Path) -> None:
    """Every file and directory under root (root too) with the permissions open() and mkdir would have given
    them: temporary files and directories (mkstemp, mkdtemp) and safetensors' writes are 0600 / 0700."""
    umask = _umask()
    root.chmod(DIR_MODE & ~umask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            (Path(dirpath) / name).chmod(DIR_MODE & ~umask)
        for name in filenames:
            file = Path(dirpath) / name
            if not file.is_symlink():
                file.chmod(FILE_MODE & ~umask)


def publish_file(path: Path, write: Callable[[Path], None]) -> Path:
    """write(tmp) fills a hidden file beside `path` (.<name>.tmp-random), which is fsynced and then
    replaces `path` in one step, with the permissions open() would have given it; a failed write
    leaves no temporary behind."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        # After the write: mkstemp makes 0600, and writers such as safetensors replace the file with
        # their own 0600 one, so a server running as another user could not read what we publish.
        tmp.chmod(FILE_MODE & ~_umask())
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def write_text_atomic(path: Path, text: str) -> None:
    publish_file(path, lambda tmp: tmp.write_text(text))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def remove(path: Path) -> None:
    """A file, a link (not what it points to) or a directory tree; nothing when there is none."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_dir(new: Path, final: Path) -> None:
    """Put directory `new` at `final` in one step; what `final` held before is removed after."""
    if not (final.exists() or final.is_symlink()):
        os.rename(new, final)
    elif _exchange(new, final):
        remove(new)  # now the old contents
    else:  # rename(2) cannot replace a non-empty directory: move the old one aside first
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, old / final.name)
        os.rename(new, final)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(final.parent)


def publish_dir(final: Path, write: Callable[[Path], None], prefix: str | None = None) -> Path:
    """write(tmp) fills a hidden directory beside `final` (named prefix + random, by default
    .<name>.tmp-), which then replaces `final` whole, with the permissions mkdir would have given it."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix or f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        readable_tree(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
