"""When a running job's time is up: its run-time limit, and hangs, read from the job dir.

Both clocks start when the job starts running, not when it was submitted (queue time is not the
job's fault), and both survive an orchestrator restart: the start is kept in ``running.json`` (the
first time a driver saw this job id running, or the first heartbeat of its ranks if that is earlier),
and progress is what the ranks' heartbeats say (``tunepod.runtime.progress``). Wall-clock times
throughout, so a restarted orchestrator, on this host or another, sees the same history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError

from tunepod.launch.paths import JobPaths
from tunepod.runtime.files import write_bytes_atomic
from tunepod.runtime.progress import RankProgress, read_progress
from tunepod.spec.models import TrainJob
from tunepod.spec.resources import Resources

# Slurm sends --signal up to a minute before the time it was asked for (its event resolution).
TIME_LIMIT_SIGNAL_SLACK_S = 60.0


class RunningSince(BaseModel):
    """``<job_dir>/running.json``: when job ``job_id`` was first seen running."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    since: float


@dataclass(frozen=True)
class Limits:
    timeout_s: float | None = None
    """Run time of one attempt."""
    hang_timeout_s: float | None = None
    """Time a rank's training loop may go without advancing."""
    startup_timeout_s: float | None = None
    """Time from running to the first heartbeat (image pull, imports, a slow mount)."""

    @classmethod
    def of(cls, resources: Resources, train: TrainJob | None = None) -> Limits:
        """A job's limits: the run time from its resources; hang detection for training jobs only
        (an evaluation or a preload sends no heartbeat while it works)."""
        timeout_s = None if resources.timeout_min is None else resources.timeout_min * 60
        if train is None:
            return cls(timeout_s=timeout_s)
        return cls(timeout_s, train.hang_timeout_s, train.startup_timeout_s)

    def run_time_only(self) -> Limits:
        return Limits(timeout_s=self.timeout_s)


@dataclass(frozen=True)
class Stall:
    """Why a running job counts as hung."""

    idle_s: float
    beats: list[RankProgress]
    """Every rank's last heartbeat (none: the job never got as far as ``runtime.init``)."""
    stalled_ranks: list[int]

    def describe(self, now: float) -> str:
        if not self.beats:
            return f"no rank sent a heartbeat in {self.idle_s:.0f} s of running (stuck starting up?)"
        steps = [beat.step for beat in self.beats if beat.step is not None]
        last_step = f"last step {max(steps)}" if steps else "no step reached"
        # Every rank, not only those past the limit: a rank that went quiet a poll later (blocked in
        # the collective the first one left) is part of the picture, and the job stops as a whole.
        ranks = ", ".join(_rank_state(beat, now) for beat in self.beats)
        return f"no progress for {self.idle_s:.0f} s ({last_step}); stopped: {ranks}"


def _rank_state(beat: RankProgress, now: float) -> str:
    state = f"rank {beat.rank} on {beat.host} pid {beat.pid} advanced {now - beat.advanced_at:.0f} s ago"
    if now - beat.beat_at > 3 * beat.interval_s:
        return f"{state}, its heartbeat stopped {now - beat.beat_at:.0f} s ago (killed or frozen)"
    return f"{state}, alive (stuck in a collective, I/O or a loop)"


class Watchdog:
    """Reads and keeps one job dir's clocks for the driver that holds its lease."""

    def __init__(self, paths: JobPaths, limits: Limits) -> None:
        self.paths = paths
        self.limits = limits

    def running_since(self, job_id: str) -> float:
        """When ``job_id`` started running; recorded now when this is the first look at it running."""
        recorded = self._read(job_id)
        beats = read_progress(self.paths.progress)
        first_beat = min((beat.started_at for beat in beats), default=None)
        if recorded is None:
            since = min(time.time(), first_beat) if first_beat is not None else time.time()
            record = RunningSince(job_id=job_id, since=since)
            write_bytes_atomic(self.paths.running, record.model_dump_json().encode())
            return since
        return recorded.since if first_beat is None else min(recorded.since, first_beat)

    def timed_out(self, job_id: str, now: float) -> bool:
        limit = self.limits.timeout_s
        return limit is not None and now - self.running_since(job_id) > limit

    def stall(self, job_id: str, now: float) -> Stall | None:
        """Why the running job ``job_id`` counts as hung at ``now``; None while it progresses."""
        limits = self.limits
        if limits.hang_timeout_s is None and limits.startup_timeout_s is None:
            return None
        every_rank = read_progress(self.paths.progress)
        if not every_rank:
            idle = now - self.running_since(job_id)
            if limits.startup_timeout_s is not None and idle > limits.startup_timeout_s:
                return Stall(idle, [], [])
            return None
        if limits.hang_timeout_s is None:
            return None
        # A rank whose loop is over (it called finish, or exited) waits for the others legitimately.
        working = [beat for beat in every_rank if not beat.finished]
        stalled = [beat for beat in working if now - beat.advanced_at > limits.hang_timeout_s]
        if not stalled:
            return None
        idle = now - max(beat.advanced_at for beat in stalled)
        return Stall(idle, every_rank, [beat.rank for beat in stalled])

    def stop_requested_at(self) -> float | None:
        """When the first rank of this run was asked to stop by a signal its script listened for
        (``ctx.should_stop()``); None when no rank was."""
        return min(
            (beat.stop_requested_at for beat in read_progress(self.paths.progress) if beat.stop_requested_at),
            default=None,
        )

    def stopped_by_time_limit(self, job_id: str, stop_requested_at: float, grace_s: float) -> bool:
        """Whether a stop signal at ``stop_requested_at`` was the backend's warning before the run-time
        limit (``sbatch --signal`` sends it ``grace_s`` early, up to a minute earlier still)."""
        return self.timed_out(job_id, stop_requested_at + grace_s + TIME_LIMIT_SIGNAL_SLACK_S)

    def new_run(self) -> None:
        """The backend put the job back in its queue (a Slurm requeue): its next run starts both
        clocks afresh, and the last run's heartbeats must not count against it."""
        self.paths.running.unlink(missing_ok=True)
        for beat_file in self.paths.progress.glob("rank-*.json"):
            beat_file.unlink(missing_ok=True)

    def _read(self, job_id: str) -> RunningSince | None:
        try:
            record = RunningSince.model_validate_json(self.paths.running.read_bytes())
        except (FileNotFoundError, ValidationError):
            return None
        return record if record.job_id == job_id else None
