"""A job the local launcher has just started is found by its submission id at once: the kernel lays
out a new program's environment a moment after ``Popen`` returns, so a read of ``/proc/<pid>/environ``
right after the start is empty about one time in seven on this machine; ``LinuxProcesses`` reads a
child's empty environment again. ``find`` after a lost reply depends on it."""

from __future__ import annotations

import signal
from pathlib import Path

from tunepod.launch.base import SUBMISSION_ID_ENV
from tunepod.launch.local.processes import LinuxProcesses, carries_submission

STARTS = 100


def test_a_child_just_started_carries_its_submission_id(tmp_path: Path) -> None:
    table = LinuxProcesses()
    started = []
    try:
        for number in range(STARTS):
            submission_id = f"{number:016x}"
            pid = table.start(
                ["/bin/sh", "-c", "sleep 30"],
                {SUBMISSION_ID_ENV: submission_id},
                tmp_path / "out.log",
                tmp_path / "err.log",
            )
            started.append(pid)
            assert carries_submission(table, pid, submission_id), f"start {number}: no id in its environment"
    finally:
        for pid in started:
            table.signal(pid, signal.SIGKILL)
        table.reap()
