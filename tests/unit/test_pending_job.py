"""A job that waits for nodes is in flight, and neither hung nor failed: the driver's clocks (run time,
start-up, hang) start when the job starts running, so hours in the queue (Slurm's PENDING for
Resources or Priority, which ``num_parallel: auto`` makes likely when the cluster fills up) never
stop it. The queue is a stand-in here (the local launcher never queues); the real Slurm PENDING state
and its reason are read in tests/integration/test_slurm_launcher.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from one_job_backend import OneJobBackend

from tunepod.launch.base import JobSpec, JobState
from tunepod.launch.drive import DriveSettings, JobDriver, Outcome
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import CancelReason, read_cancel_marker
from tunepod.launch.watchdog import Limits

#: Every limit of the watchdog, well under the time the job waits in the queue.
LIMIT_S = 0.4
QUEUED_S = 4 * LIMIT_S
RUNNING_S = LIMIT_S / 4


class QueuedJob:
    """PENDING for ``QUEUED_S`` after its submission, then RUNNING for ``RUNNING_S``, then SUCCEEDED."""

    def __init__(self, job_dir: Path) -> None:
        self.job_id = "queued-1"
        self.job_dir = job_dir
        self.submitted_at = time.monotonic()
        self.seen: list[JobState] = []
        self.cancelled: list[CancelReason] = []

    def state(self, *, fresh: bool = False) -> JobState:
        age = time.monotonic() - self.submitted_at
        state = (
            JobState.PENDING
            if age < QUEUED_S
            else JobState.RUNNING
            if age < QUEUED_S + RUNNING_S
            else JobState.SUCCEEDED
        )
        self.seen.append(state)
        return state

    def cancel(self, reason: CancelReason = "cancelled") -> None:
        self.cancelled.append(reason)

    def logs(self, tail: int = 50) -> str:
        return ""

    def describe(self) -> str:
        return f"job {self.job_id}"

    def run_mark(self) -> str | None:
        return None

    def idle(self, seconds: float) -> None:
        time.sleep(seconds)


def test_a_job_waiting_in_the_queue_past_every_limit_is_neither_hung_nor_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limits = Limits(timeout_s=LIMIT_S, hang_timeout_s=LIMIT_S, startup_timeout_s=LIMIT_S)
    job = JobSpec(
        name="trial-0", entrypoint=tmp_path / "train.py", job_dir=tmp_path / "trial-0", limits=limits
    )
    queue = OneJobBackend("queue", QueuedJob)
    driver = JobDriver(queue, job, DriveSettings(poll_s=0.05, max_restarts=0), what="Trial 0")  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="tunepod"):
        driven = driver.run()

    (queued,) = queue.jobs
    assert driven.outcome is Outcome.COMPLETED, driven.message
    assert queued.cancelled == [] and read_cancel_marker(JobPaths(job.job_dir)) is None
    assert queued.seen.count(JobState.PENDING) * 0.05 >= 2 * LIMIT_S  # watched in the queue past the limits
    assert JobState.RUNNING in queued.seen
    assert caplog.records == [], caplog.text
