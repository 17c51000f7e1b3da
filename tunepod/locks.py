"""A file lock the kernel releases when its holder dies: ``flock`` on a lock file.

Used where several orchestrators (processes, or threads of one) may touch one thing at once: a
study's trial scheduling, a job dir's lease, the first opening of a SQLite MLflow store. A holder
that is SIGKILLed leaves nothing to wait out or to force open. Works on local filesystems, NFSv4 and
FSx for Lustre with its default ``flock`` mount option.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock of ``path`` (created if missing) for the ``with`` block.

    Each call opens its own descriptor, so the lock excludes other threads of this process as well
    as other processes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
