"""The quality benchmark's study watcher (benchmarks/quality/study.py) with real child processes: with
the arms of a seed side by side, a study that fails must stop the one beside it, processes and all."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.quality.study import MARKER_ENV, StudyFailed, marked_processes, watch_child

# A study stand-in that starts a grandchild of its own, as a study starts its jobs, then waits.
STUDY = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


def test_an_abort_stops_the_study_beside_a_failed_one_and_every_process_it_started(tmp_path: Path) -> None:
    log = tmp_path / "study.log"
    abort = threading.Event()
    started = time.monotonic()
    timer = threading.Timer(1.0, abort.set)  # the other arm's failure, a second in
    timer.start()
    try:
        with pytest.raises(StudyFailed, match="a study beside it failed"):
            watch_child([sys.executable, "-c", STUDY], dict(os.environ), log, lambda: False, True, abort)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 30  # stopped, not waited out
    assert marked_processes(str(log)) == []  # the child and its grandchild are gone


def test_without_an_abort_a_study_that_exits_zero_is_not_stopped(tmp_path: Path) -> None:
    done = watch_child(
        [sys.executable, "-c", f"import os; assert os.environ['{MARKER_ENV}']"],
        dict(os.environ),
        tmp_path / "study.log",
        lambda: False,
        True,
        threading.Event(),
    )
    assert done is False
