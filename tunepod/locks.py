"""A file lock the kernel releases when its holder dies: ``flock`` on a lock file.

Used where several orchestrators (processes, or threads of one) may touch one thing at once: a
study's trial scheduling, a job dir's lease, the first opening of a SQLite MLflow store. A holder
that is SIGKILLed leaves nothing to wait out or to force open. Works on local filesystems, NFSv4 and
FSx for Lustre with its default ``flock`` mount option; a filesystem without locks (NFS mounted with
``nolock``) is refused with the fix (``tunepod.world``), never run unlocked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tunepod import world


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock of ``path`` (created if missing) for the ``with`` block.

    Each call opens its own descriptor, so the lock excludes other threads of this process as well
    as other processes; a thread must not take a lock it already holds (it would wait for itself).
    """
    with world.file_lock(path):
        yield


def try_locked(path: Path) -> contextlib.AbstractContextManager[bool]:
    """As ``locked``, without waiting: the block gets False (and holds nothing) when another holds it."""
    return world.file_lock(path, blocking=False)
