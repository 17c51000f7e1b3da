"""A job its backend restarts in place (a Kubernetes operator restarting a failed pod under the same
job) starts a new run whose ranks begin afresh: until the new run's first heartbeat, the heartbeat
left in the job dir is the dead run's, and the new run is judged by its start-up time, not by how long
ago the dead run last advanced. The backend's run mark says the run changed, even where no look saw
the job between runs (the stand-in here never shows it Restarting). The mark's reading from the
operator's conditions is tested in tests/unit/test_hyperpod_eks_render.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from one_job_backend import OneJobBackend

from tunepod import world
from tunepod.launch.base import JobSpec, JobState
from tunepod.launch.drive import DriveSettings, JobDriver, Outcome
from tunepod.launch.submission import CancelReason
from tunepod.launch.watchdog import Limits
from tunepod.runtime.progress import RankProgress, progress_dir

LIMIT_S = 1.0
#: How long the dead run's last beat says its loop had not advanced: past the hang timeout soon.
DEAD_IDLE_S = LIMIT_S / 2
CRASH_AT_S = 0.1
#: The new run's start-up: within its start-up timeout, past the dead run's hang timeout.
START_UP_S = 0.8 * LIMIT_S
DONE_AT_S = CRASH_AT_S + START_UP_S + 0.4


class RestartedInPlace:
    """RUNNING throughout: a first run that beats once and crashes at ``CRASH_AT_S``, then a second
    run (another run mark) whose rank beats from ``START_UP_S`` after it started until it succeeds."""

    def __init__(self, job_dir: Path) -> None:
        self.job_id = "restarted-1"
        self.job_dir = job_dir
        self.submitted_at = world.monotonic()
        self.cancelled: list[CancelReason] = []
        self._beat(pid=101, idle_s=DEAD_IDLE_S)

    def state(self, *, fresh: bool = False) -> JobState:
        age = self._age()
        if age >= DONE_AT_S:
            return JobState.SUCCEEDED
        if age >= CRASH_AT_S + START_UP_S:
            self._beat(pid=202, idle_s=0.0)
        return JobState.RUNNING

    def run_mark(self) -> str | None:
        return "first" if self._age() < CRASH_AT_S else "second"

    def cancel(self, reason: CancelReason = "cancelled") -> None:
        self.cancelled.append(reason)

    def logs(self, tail: int = 50) -> str:
        return ""

    def describe(self) -> str:
        return f"job {self.job_id}"

    def idle(self, seconds: float) -> None:
        world.sleep(seconds)

    def _age(self) -> float:
        return world.monotonic() - self.submitted_at

    def _beat(self, *, pid: int, idle_s: float) -> None:
        now = world.time()
        beat = RankProgress(
            rank=0,
            host="pod-0",
            pid=pid,
            started_at=now if pid == 101 else self._new_run_started_at(),
            beat_at=now,
            advanced_at=now - idle_s,
            step=None,
            interval_s=LIMIT_S,
            idle_s=idle_s,
            ran_s=idle_s,
        )
        record = asdict(beat)
        del record["telemetry"]
        folder = progress_dir(self.job_dir / "metrics.jsonl")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rank-0.json").write_text(json.dumps(record))

    def _new_run_started_at(self) -> float:
        return world.time() - (self._age() - CRASH_AT_S)


class SteppedClocks(world.RealWorld):
    """Real files, locks and threads, and clocks that move only as the driver sleeps (and a
    millisecond per reading, so that a loop that never sleeps still sees time pass): the limits here
    are a second or less, which a loaded machine's scheduling alone could overrun."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def time(self) -> float:
        self.now += 0.001
        return self.now

    def monotonic(self) -> float:
        return self.time()

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_run_restarted_in_place_is_given_its_start_up_time_not_judged_by_the_dead_runs_beat(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limits = Limits(hang_timeout_s=LIMIT_S, startup_timeout_s=LIMIT_S)
    job = JobSpec(
        name="trial-0", entrypoint=tmp_path / "train.py", job_dir=tmp_path / "trial-0", limits=limits
    )
    with world.installed(SteppedClocks()):
        backend = OneJobBackend("restarts-in-place", RestartedInPlace)
        driver = JobDriver(backend, job, DriveSettings(poll_s=0.02), what="Trial 0")  # type: ignore[arg-type]
        driven = driver.run()

    (restarted,) = backend.jobs
    assert restarted.cancelled == [], driven.message
    assert driven.outcome is Outcome.COMPLETED, driven.message
    assert "restarted in place" in caplog.text
