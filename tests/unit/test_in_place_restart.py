"""A job its backend restarts in place (a Kubernetes operator restarting a failed pod under the same
job) starts a new run whose ranks begin afresh: until the new run's first heartbeat, the heartbeat
left in the job dir is the dead run's, and the new run is judged by its start-up time, not by how long
ago the dead run last advanced. The backend's run mark says the run changed, even where no look saw
the job between runs (the stand-in here never shows it Restarting). The mark's reading from the
operator's conditions is tested in tests/unit/test_hyperpod_eks_render.py.

A job requeued while no driver watched it (Slurm requeues it while its orchestrator is down; Slurm
gives no run mark) is the same case for the driver that takes it over: queued at that driver's first
look, its next run is a new run, not the dead run's beat going on."""

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
        write_beat(self.job_dir, pid, idle_s, world.time() if pid == 101 else self._new_run_started_at())

    def _new_run_started_at(self) -> float:
        return world.time() - (self._age() - CRASH_AT_S)


class RequeuedBeforeTakeOver(RestartedInPlace):
    """Submitted by a driver that died: its first run beat once (the beat is still in the job dir),
    then the job was requeued. PENDING until ``CRASH_AT_S`` after the new driver took it over, then a
    second run whose rank beats from ``START_UP_S`` after it started; no run mark."""

    def state(self, *, fresh: bool = False) -> JobState:
        age = self._age()
        if age < CRASH_AT_S:
            return JobState.PENDING
        return super().state(fresh=fresh)

    def run_mark(self) -> str | None:
        return None


def write_beat(job_dir: Path, pid: int, idle_s: float, started_at: float) -> None:
    """Rank 0's heartbeat, as a rank ``idle_s`` past its last advance writes it."""
    now = world.time()
    beat = RankProgress(
        rank=0,
        host="pod-0",
        pid=pid,
        started_at=started_at,
        beat_at=now,
        advanced_at=now - idle_s,
        step=None,
        interval_s=LIMIT_S,
        idle_s=idle_s,
        ran_s=idle_s,
    )
    record = asdict(beat)
    del record["telemetry"]
    folder = progress_dir(job_dir / "metrics.jsonl")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank-0.json").write_text(json.dumps(record))


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


def test_a_job_requeued_before_a_driver_took_it_over_is_given_its_start_up_time(tmp_path: Path) -> None:
    limits = Limits(hang_timeout_s=LIMIT_S, startup_timeout_s=LIMIT_S)
    job = JobSpec(
        name="trial-0", entrypoint=tmp_path / "train.py", job_dir=tmp_path / "trial-0", limits=limits
    )
    with world.installed(SteppedClocks()):
        backend = OneJobBackend("slurm", RequeuedBeforeTakeOver)
        backend.jobs.append(RequeuedBeforeTakeOver(job.job_dir))  # the dead driver's submission
        driver = JobDriver(backend, job, DriveSettings(poll_s=0.02), what="Trial 0")  # type: ignore[arg-type]
        driven = driver.run()

    (requeued,) = backend.jobs  # re-attached to, never submitted again
    assert requeued.cancelled == [], driven.message
    assert driven.outcome is Outcome.COMPLETED, driven.message
