"""Durable, atomic file writes: the building blocks of the result file and of checkpoints.

A reader on the shared filesystem must see either nothing or a whole file, never half of one, even if
the writer is killed mid-way. So every file is written under a hidden temporary name in the same folder
(``os.replace`` is only atomic within one filesystem), flushed and fsynced, then renamed, and the folder
is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

_HASH_CHUNK_BYTES = 1 << 20
_FILE_MODE = 0o644


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
    """Append one line to ``path`` with a single write, then flush and fsync.

    If the file does not end with a newline (a writer was killed mid-line), a newline is written first
    so the new line is not glued onto the torn one. Only one process may append to a given file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as handle:
        handle.seek(0, os.SEEK_END)
        prefix = b""
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            prefix = b"" if handle.read(1) == b"\n" else b"\n"
        handle.write(prefix + line.encode("utf-8") + b"\n")
        handle.flush()
        os.fsync(handle.fileno())


def sha256_of(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in chunks so large checkpoints fit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
