"""A real size-limited filesystem for the disk-full tests: a tmpfs the test mounts, fills and unmounts."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from needs import skip_or_fail

MiB = 1 << 20


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` on ``folder`` (created) for the block; unmount it after, even
    when the test fails. Skips (fails under CI=true) where mounting is not permitted."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        skip_or_fail(f"cannot mount a tmpfs on {folder} ({done.stderr.strip()}); run the tests as root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def fill(filesystem: Path) -> Path:
    """Write a filler file in ``filesystem`` until it is full (a real ENOSPC); returns the file, whose
    removal gives the space back."""
    filler = filesystem / "filler"
    chunk = b"\0" * (64 << 10)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:  # the last write comes up short on the last free byte, the next one fails
            os.write(fd, chunk)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler
