"""Durable, atomic file writes: the building blocks of the result file and of checkpoints.

A reader on the shared filesystem must see either nothing or a whole file, never half of one, even if
the writer is killed mid-way. So every file is written under a hidden temporary name in the same folder
(``os.replace`` is only atomic within one filesystem), flushed and fsynced, then renamed, and the folder
is fsynced so the rename itself survives a crash. An append is whole or absent too: a failed one is
cut back off the file.

A full filesystem (or a spent quota) is reported once, here: ``disk_full_explained`` turns ENOSPC and
EDQUOT into a ``DiskFullError`` naming the path, the free space on its mount and what to change.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tunepod.errors import DiskFullError

_HASH_CHUNK_BYTES = 1 << 20
_FILE_MODE = 0o644
_DISK_FULL_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make the content of the already written file ``path`` durable."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def write_bytes_atomic(path: Path, data: bytes, *, mode: int = _FILE_MODE) -> None:
    """Replace ``path`` with ``data`` atomically; creates the parent folder if needed.

    The file ends up ``rw-r--r--`` by default: mkstemp's private 0600 would hide a result or a staged
    dataset from an orchestrator or a job running as another user on the shared filesystem. Files
    that hold secrets (a job's environment) pass ``mode=0o600``; the mode is set before any byte is
    written, so the data is never readable by others, not even for a moment.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
    fsync_dir(path.parent)


def append_line_durably(path: Path, line: str) -> None:
    """Append one line to ``path`` whole or not at all (see ``append_whole``), then fsync.

    If the file does not end with a newline (a writer was killed mid-line), a newline is written first
    so the new line is not glued onto the torn one. Only one process may append to a given file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        torn = start > 0 and os.pread(fd, 1, start - 1) != b"\n"
        _append_at_end(fd, start, (b"\n" if torn else b"") + line.encode("utf-8") + b"\n", fsync=True)
    finally:
        os.close(fd)


def append_whole(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Append ``data`` to ``path`` (unbuffered: a SIGKILL right after loses none of it) and, with
    ``fsync``, make it durable; if any of that fails (a full disk), cut the file back to its length
    before, so readers never find a torn record. The caller serializes the writers."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        _append_at_end(fd, os.lseek(fd, 0, os.SEEK_END), data, fsync=fsync)
    finally:
        os.close(fd)


def _append_at_end(fd: int, start: int, data: bytes, *, fsync: bool) -> None:
    try:
        view = memoryview(data)
        while view:  # a write on a filling disk may be short before the next one fails
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def disk_full_error(exc: BaseException, path: Path, fix: str) -> DiskFullError | None:
    """The ``DiskFullError`` for ``exc`` when it (or an exception it was raised from: torch wraps its
    write errors in a RuntimeError) is ENOSPC or EDQUOT, naming ``path``, the free space on its
    mount and ``fix``; ``exc`` itself when it already is one; ``None`` for any other failure."""
    if isinstance(exc, DiskFullError):
        return exc
    number = _disk_full_errno(exc)
    if number is None:
        return None
    mount = mount_point(path)
    try:
        usage = os.statvfs(mount)
        free = f"{usage.f_bavail * usage.f_frsize / 2**20:.1f} MiB free on {mount}"
    except OSError:
        free = f"free space on {mount} unknown"
    return DiskFullError(f"{_DISK_FULL_ERRNOS[number]} writing {path}: {free}; fix: {fix}")


def _disk_full_errno(exc: BaseException | None) -> int | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def disk_full_explained(path: Path, fix: str) -> Iterator[None]:
    """Re-raise a full filesystem or quota met inside the block as ``disk_full_error(exc, path, fix)``;
    every other exception passes unchanged. The block must leave nothing half written on failure."""
    try:
        yield
    except Exception as exc:
        error = disk_full_error(exc, path, fix)
        if error is None or error is exc:
            raise
        raise error from exc


def mount_point(path: Path) -> Path:
    """Where the filesystem holding ``path`` (or its nearest existing parent) is mounted."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        current = current.parent
    while not os.path.ismount(current):
        current = current.parent
    return current


def sha256_of(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in chunks so large checkpoints fit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
