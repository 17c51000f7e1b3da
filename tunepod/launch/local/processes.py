"""Finding a local job's processes in ``/proc`` (Linux only).

torchrun starts its workers in sessions of their own (torch's ``SubprocessHandler`` passes
``start_new_session=True``), so the wrapper's process group does NOT hold them. Every process of a job
instead inherits ``SUBMISSION_ID_ENV``, unique to one submission, and a job's processes are found by
that value in their environment (or by the wrapper's process group while the wrapper lives).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from tunepod.launch.base import SUBMISSION_ID_ENV
from tunepod.launch.procfs import ProcessStat, read_process_stat


def live_processes() -> Iterator[tuple[int, ProcessStat]]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := read_process_stat(int(entry.name))) and not stat.is_dead:
            yield int(entry.name), stat


def carries_submission(pid: int, submission_id: str) -> bool:
    """Whether process ``pid`` inherited ``SUBMISSION_ID_ENV=submission_id``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's process: not ours either way
        return False
    return f"\0{SUBMISSION_ID_ENV}={submission_id}\0".encode() in b"\0" + environ


def submission_processes(submission_id: str) -> list[tuple[int, ProcessStat]]:
    """Every live process that carries ``submission_id``."""
    return [(pid, stat) for pid, stat in live_processes() if carries_submission(pid, submission_id)]
