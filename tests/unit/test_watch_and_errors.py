"""Pure helpers around job outcomes: the worker's error above torchrun's summary, and which errors
are worth a retry."""

from __future__ import annotations

import sqlite3

import pytest

from tunepod.errors import JobError, SpecError, TransientError, is_transient
from tunepod.launch.drive import worker_error

WORKER = """\
Traceback (most recent call last):
  File "train.py", line 9, in <module>
    raise ValueError("lr must be positive")
ValueError: lr must be positive
"""
TORCHRUN = """\
E1130 05:55:59.731000 10416 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 940, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
"""


def test_worker_error_is_the_text_above_torchruns_summary() -> None:
    assert worker_error(WORKER + TORCHRUN, lines=20) == WORKER.rstrip()


def test_worker_error_keeps_only_the_last_lines() -> None:
    assert worker_error(WORKER + TORCHRUN, lines=1) == "ValueError: lr must be positive"


def test_worker_error_without_torchrun_summary_is_the_tail() -> None:
    assert worker_error("one\ntwo\nthree\n", lines=2) == "two\nthree"


def test_worker_error_with_only_the_summary_keeps_it() -> None:
    assert "ChildFailedError" in worker_error(TORCHRUN, lines=20)


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (TransientError("ssh: connection reset"), True),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (sqlite3.OperationalError("database is locked"), True),
        (sqlite3.OperationalError("no such table: runs"), False),
        (JobError("trial 3 FAILED"), False),
        (SpecError("spec.yaml", []), False),
        (ValueError("bad"), False),
    ],
)
def test_only_transient_errors_are_retried(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient
