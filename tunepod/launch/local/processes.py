"""Finding a local job's processes in ``/proc`` (Linux only).

torchrun starts its workers in sessions of their own (torch's ``SubprocessHandler`` passes
``start_new_session=True``), so the wrapper's process group does NOT hold them. Every process of a job
instead inherits ``SUBMISSION_ID_ENV``, unique to one submission, and a job's processes are found by
that value in their environment (or by the wrapper's process group while the wrapper lives).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tunepod.launch.base import SUBMISSION_ID_ENV

_DEAD_STATES = frozenset({"Z", "X", "x"})


@dataclass(frozen=True)
class ProcessStat:
    """The few fields of ``/proc/<pid>/stat`` this module needs."""

    state: str
    pgid: int
    start_ticks: int
    """Field 22: start time in clock ticks after boot. With the pid, it identifies one process."""

    @property
    def is_dead(self) -> bool:
        """A zombie has exited; only its parent has not collected the exit status yet."""
        return self.state in _DEAD_STATES


def read_process_stat(pid: int) -> ProcessStat | None:
    """``/proc/<pid>/stat`` parsed, or None when no such process exists (or it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return ProcessStat(state=fields[0].decode(), pgid=int(fields[2]), start_ticks=int(fields[19]))


def is_same_process(pid: int, start_ticks: int) -> bool:
    """Whether ``pid`` still is the live process that started at ``start_ticks`` (not a reused pid)."""
    stat = read_process_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and not stat.is_dead


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
