"""Reading ``/proc`` (Linux): is a process still the one we started, or a stranger with its pid?"""

from __future__ import annotations

from dataclasses import dataclass

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


def read_proc_file(pid: int, name: str) -> bytes:
    """``/proc/<pid>/<name>``; ``OSError`` when it cannot be read (no such process, not ours).

    Opened by a plain string: pathlib interns every part of a path, so each pid read through it
    would stay in the interpreter's table of interned strings for good, a table that grew by a
    pid or more with every job a study ran."""
    with open(f"/proc/{pid}/{name}", "rb") as file:
        return file.read()


def read_process_stat(pid: int) -> ProcessStat | None:
    """``/proc/<pid>/stat`` parsed, or None when no such process exists (or it cannot be read)."""
    try:
        raw = read_proc_file(pid, "stat")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return ProcessStat(state=fields[0].decode(), pgid=int(fields[2]), start_ticks=int(fields[19]))


def is_same_process(pid: int, start_ticks: int) -> bool:
    """Whether ``pid`` still is the live process that started at ``start_ticks`` (not a reused pid)."""
    stat = read_process_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and not stat.is_dead
