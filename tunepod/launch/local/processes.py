"""Finding a local job's processes in ``/proc`` (Linux only).

torchrun starts its workers in sessions of their own (torch's ``SubprocessHandler`` passes
``start_new_session=True``), so the wrapper's process group does NOT hold them. Every process of a job
instead inherits ``SUBMISSION_ID_ENV``, unique to one submission, and a job's processes are found by
that value in their environment (or by the wrapper's process group while the wrapper lives).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tunepod.launch.base import SUBMISSION_ID_ENV
from tunepod.launch.procfs import ProcessStat, read_process_stat


def live_processes() -> Iterator[tuple[int, ProcessStat]]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := read_process_stat(int(entry.name))) and not stat.is_dead:
            yield int(entry.name), stat


def carries_submission(pid: int, submission_id: str) -> bool:
    """Whether process ``pid`` inherited ``SUBMISSION_ID_ENV=submission_id``."""
    environ = _environ(pid)
    return environ is not None and _submission_entry(submission_id) in environ


def submission_processes(submission_id: str) -> list[tuple[int, ProcessStat]]:
    """Every live process that carries ``submission_id``."""
    return [(pid, stat) for pid, stat in live_processes() if carries_submission(pid, submission_id)]


class SubmissionProcesses:
    """The live processes of several submissions, read in ONE pass over ``/proc`` (each process's
    environment costs a read), made the first time any is asked for: a poll of many jobs pays for one
    pass, and a poll whose jobs' wrappers all live pays nothing."""

    def __init__(self, submission_ids: Iterable[str]) -> None:
        self._wanted = frozenset(submission_ids)
        self._found: dict[str, list[tuple[int, ProcessStat]]] | None = None

    def of(self, submission_id: str) -> list[tuple[int, ProcessStat]]:
        """The processes carrying ``submission_id`` (one of those given), as of the pass."""
        if self._found is None:
            self._found = self._scan()
        return self._found.get(submission_id, [])

    def _scan(self) -> dict[str, list[tuple[int, ProcessStat]]]:
        entries = {submission_id: _submission_entry(submission_id) for submission_id in self._wanted}
        found: dict[str, list[tuple[int, ProcessStat]]] = {}
        for pid, stat in live_processes():
            environ = _environ(pid)
            for submission_id, entry in entries.items():
                if environ is not None and entry in environ:
                    found.setdefault(submission_id, []).append((pid, stat))
        return found


def _environ(pid: int) -> bytes | None:
    """Process ``pid``'s environment, with a leading NUL so that every entry is NUL-delimited. None
    when it cannot be read: also for a process that is exiting, whose memory goes (ESRCH here) while
    its ``stat`` still says it runs, before it becomes a zombie."""
    try:
        return b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, exiting, or another user's process
        return None


def _submission_entry(submission_id: str) -> bytes:
    return f"\0{SUBMISSION_ID_ENV}={submission_id}\0".encode()
