"""What tells a file left alone from one rewritten or replaced, for tests of work that must not redo it."""

from __future__ import annotations

import os


def file_identity(stat: os.stat_result) -> tuple[int, ...]:
    """Inode, device, size, mode, mtime and ctime: a rewrite or a replacement changes one of them. Not
    the atime, which merely reading the file may move (relatime moves it at the first read after a
    write)."""
    return (stat.st_ino, stat.st_dev, stat.st_size, stat.st_mode, stat.st_mtime_ns, stat.st_ctime_ns)
