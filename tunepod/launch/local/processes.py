"""This machine's processes, as the local launcher sees them: the ``ProcessTable`` seam, its Linux
implementation, and how a job's processes are found.

torchrun starts its workers in sessions of their own (torch's ``SubprocessHandler`` passes
``start_new_session=True``), so the wrapper's process group does NOT hold them. Every process of a job
instead inherits ``SUBMISSION_ID_ENV``, unique to one submission, and a job's processes are found by
that value in their environment (or by the wrapper's process group while the wrapper lives).

The launcher reaches processes only through a ``ProcessTable`` (start one in a session of its own,
read a process's stat and environment, list the live ones, signal one, wait a while for one to exit):
``LinuxProcesses`` is ``/proc``, ``subprocess``, ``kill`` and pidfds; the deterministic simulation
(``tests/simulation``) gives the real launcher a table of simulated processes instead.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from tunepod import world
from tunepod.launch.base import SUBMISSION_ID_ENV
from tunepod.launch.procfs import ProcessStat, read_proc_file, read_process_stat


class ProcessTable(Protocol):
    """This machine's processes. Thread safe."""

    def start(self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path) -> int:
        """Start ``argv`` in a session of its own (it outlives the caller), output appended to the two
        files; its pid, which cannot be reused before ``reap`` collects it."""
        ...

    def stat(self, pid: int) -> ProcessStat | None:
        """Process ``pid``'s stat; None when there is none."""
        ...

    def live(self) -> Iterator[tuple[int, ProcessStat]]:
        """Every process that has not exited (zombies left out)."""
        ...

    def environ(self, pid: int) -> bytes | None:
        """Process ``pid``'s environment as NUL-separated ``NAME=value`` entries; None when it cannot be
        read (gone, exiting, another user's)."""
        ...

    def signal(self, pid: int, signum: signal.Signals) -> None:
        """Send ``signum`` to ``pid``; one that is gone is no error."""
        ...

    def wait(self, pid: int, start_ticks: int, seconds: float) -> None:
        """Up to ``seconds``, less once process ``pid`` (that started at ``start_ticks``) has exited."""
        ...

    def reap(self) -> None:
        """Collect the exit status of the processes this table started, so no zombie of ours lingers."""
        ...


def is_same_process(table: ProcessTable, pid: int, start_ticks: int) -> bool:
    """Whether ``pid`` still is the live process that started at ``start_ticks`` (not a reused pid)."""
    stat = table.stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and not stat.is_dead


_EXEC_SETTLE_READS = 200
_EXEC_SETTLE_S = 0.01
"""How often and how far apart a just-started child's empty environment is read again (2 s in all)."""


class LinuxProcesses:
    """``/proc``, ``subprocess``, ``kill`` and pidfds."""

    def __init__(self) -> None:
        self._children: list[subprocess.Popen[bytes]] = []
        self._children_lock = world.lock()

    def start(self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path) -> int:
        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=dict(env),
                start_new_session=True,
            )
        with self._children_lock:
            self._children.append(process)
        return process.pid

    def stat(self, pid: int) -> ProcessStat | None:
        return read_process_stat(pid)

    def live(self) -> Iterator[tuple[int, ProcessStat]]:
        return live_processes()

    def environ(self, pid: int) -> bytes | None:
        for _ in range(_EXEC_SETTLE_READS):
            try:
                environ = read_proc_file(pid, "environ")
            except OSError:  # gone, exiting (its memory goes, ESRCH, while its stat still runs), not ours
                return None
            if environ or not self._is_child(pid):
                return environ
            # Our child inside its exec: Popen returns once the exec is past its point of no return,
            # and the kernel lays out the new environment a moment later (a loaded machine can hold
            # the child in between), so a job just started would not show its submission id.
            world.sleep(_EXEC_SETTLE_S)
        return environ

    def _is_child(self, pid: int) -> bool:
        with self._children_lock:
            return any(process.pid == pid for process in self._children)

    def signal(self, pid: int, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def wait(self, pid: int, start_ticks: int, seconds: float) -> None:
        """Through a pidfd, which works for a process another orchestrator started."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already, or a kernel without pidfds: only the next poll can tell
            world.sleep(seconds)
            return
        try:
            # Checked after the open, so the pidfd is that process's and not a later one's.
            if is_same_process(self, pid, start_ticks):
                select.select([pidfd], [], [], seconds)
            else:
                world.sleep(seconds)
        finally:
            os.close(pidfd)

    def reap(self) -> None:
        with self._children_lock:
            self._children = [process for process in self._children if process.poll() is None]


def live_processes() -> Iterator[tuple[int, ProcessStat]]:
    """Every process of this machine that has not exited (``/proc``)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := read_process_stat(int(entry.name))) and not stat.is_dead:
            yield int(entry.name), stat


def carries_submission(table: ProcessTable, pid: int, submission_id: str) -> bool:
    """Whether process ``pid`` inherited ``SUBMISSION_ID_ENV=submission_id``."""
    environ = table.environ(pid)
    return environ is not None and _submission_entry(submission_id) in b"\0" + environ


def submission_processes(table: ProcessTable, submission_id: str) -> list[tuple[int, ProcessStat]]:
    """Every live process that carries ``submission_id``."""
    return [(pid, stat) for pid, stat in table.live() if carries_submission(table, pid, submission_id)]


class SubmissionProcesses:
    """The live processes of several submissions, read in ONE pass over the table (each process's
    environment costs a read), made the first time any is asked for: a poll of many jobs pays for one
    pass, and a poll whose jobs' wrappers all live pays nothing."""

    def __init__(self, table: ProcessTable, submission_ids: Iterable[str]) -> None:
        self._table = table
        self._wanted = tuple(dict.fromkeys(submission_ids))
        self._found: dict[str, list[tuple[int, ProcessStat]]] | None = None

    def of(self, submission_id: str) -> list[tuple[int, ProcessStat]]:
        """The processes carrying ``submission_id`` (one of those given), as of the pass."""
        if self._found is None:
            self._found = self._scan()
        return self._found.get(submission_id, [])

    def _scan(self) -> dict[str, list[tuple[int, ProcessStat]]]:
        entries = {submission_id: _submission_entry(submission_id) for submission_id in self._wanted}
        found: dict[str, list[tuple[int, ProcessStat]]] = {}
        for pid, stat in self._table.live():
            environ = self._table.environ(pid)
            if environ is None:
                continue
            for submission_id, entry in entries.items():
                if entry in b"\0" + environ:
                    found.setdefault(submission_id, []).append((pid, stat))
        return found


def _submission_entry(submission_id: str) -> bytes:
    """The entry with a NUL on each side: matched against an environment with a NUL put in front."""
    return f"\0{SUBMISSION_ID_ENV}={submission_id}\0".encode()
