"""When a running job's time is up: its run-time limit, and hangs, read from the job dir.

Both clocks start when the job starts running, not when it was submitted (queue time is not the
job's fault), and both survive an orchestrator restart: the start is kept in ``running.json`` (the
first time a driver saw this job id running, or the first heartbeat of its ranks if that is earlier),
and progress is what the ranks' heartbeats say (``tunepod.runtime.progress``).

No clock of the orchestrator's host is trusted alone, since it may jump (an NTP step, a VM resumed)
and differ from the compute nodes' clocks. How long a rank has not advanced, and how long it has
run, are measured on the rank's own monotonic clock while it beats (the beat's ``idle_s`` and
``ran_s``; ``beat_at - advanced_at`` and ``beat_at - started_at`` for a beat of a runtime without
them), plus, once it stops beating, the time this driver has watched its heartbeat file not change,
on the driver's monotonic clock. The wall clock only says when a job may be over its time
(``running.json``); a second clock must agree before it counts as timed out: its ranks', within one
heartbeat interval, so a requeued Slurm job's new run (whose ranks started afresh) is never taken for
the old one, even when no driver saw the requeue; or, for a job without heartbeats (an evaluation,
SageMaker without a writable FSx), how long drivers have watched it running on their monotonic
clocks, which ``running.json`` keeps too: a re-attach goes on from there (only time no driver
watched is not counted), and a driver whose wall clock jumped or runs ahead of its predecessor's
cannot stop a healthy job early.

A rank's heartbeat counts only for the run it belongs to. A run that is over may leave a rank
behind that beats on into the same file: on a node whose slurmd died, Slurm requeues the job (or
ends it NODE_FAIL and the driver restarts it) while the processes there live on until someone kills
them, stuck or training. So when a run is over (``new_run``: a requeue seen, a restart), the
identities of its ranks (host, pid and start, which a process keeps as long as it beats) are kept in
``earlier_runs.json``, and a beat of one of them belongs to an earlier run, whatever the clocks say
(a node's clock stepped back between two runs makes the next run's starts look older). A rank that
started before a beat already heard of the same rank (a requeue no driver saw) belongs to an
earlier run too, by the ranks' own clocks (never the driver's: a requeued run starts a SlurmdTimeout
and a queue wait after the run it replaces). Its beat is passed over, and the rank's last beat of
the current run stands for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError

from tunepod import world
from tunepod.launch.paths import JobPaths
from tunepod.runtime.files import write_bytes_atomic
from tunepod.runtime.progress import RankProgress, read_progress
from tunepod.spec.models import TrainJob
from tunepod.spec.resources import Resources

# Slurm sends --signal up to a minute before the time it was asked for (its event resolution).
TIME_LIMIT_SIGNAL_SLACK_S = 60.0
# How often the watched time of a job without heartbeats is recorded: what a crash of the driver loses.
WATCH_RECORD_S = 30.0
# Ranks of ended runs kept in earlier_runs.json: restarts times ranks, bounded for a long-lived job dir.
MAX_EARLIER_RANKS = 4096


class EarlierRuns(BaseModel):
    """``<job_dir>/earlier_runs.json``: the heartbeats of runs that are over, by their ranks' starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    started_until: float
    """The newest start (on its rank's clock) of a rank of a run that is over; what tells an earlier
    run's rank in a record without ``ranks``."""
    ranks: list[tuple[str, int, float]] = []
    """(host, pid, started_at) of every rank of the runs that are over (the newest ``MAX_EARLIER_RANKS``)."""
    job_id: str | None = None
    """The job whose run was the last to be over."""
    stop_requested_at: float | None = None
    """When that run's ranks were asked to stop by a signal their script listened for (a
    preemption): a driver that re-attaches to that job after a crash, once ``new_run`` removed the
    heartbeats that said so, still reads its exit 0 as a stop, not as the end of training."""


class RunningSince(BaseModel):
    """``<job_dir>/running.json``: when job ``job_id`` was first seen running."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    since: float
    watched_s: float = 0.0
    """How long drivers have watched it running, on their monotonic clocks (no jump moves them)."""


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
class RankIdle:
    """One rank's last heartbeat, and how long it has not advanced (see the module docstring)."""

    beat: RankProgress
    idle_s: float
    silent_s: float
    """How long this driver has watched the rank's heartbeat not change (0: it just did)."""

    def describe(self) -> str:
        beat = self.beat
        state = f"rank {beat.rank} on {beat.host} pid {beat.pid} advanced {self.idle_s:.0f} s ago"
        if self.silent_s > 3 * beat.interval_s:
            return f"{state}, its heartbeat stopped {self.silent_s:.0f} s ago (killed or frozen)"
        return f"{state}, alive (stuck in a collective, I/O or a loop)"


@dataclass(frozen=True)
class Stall:
    """Why a running job counts as hung."""

    idle_s: float
    ranks: list[RankIdle]
    """Every rank's last heartbeat (none: the job never got as far as ``runtime.init``)."""
    stalled_ranks: list[int]

    @property
    def beats(self) -> list[RankProgress]:
        return [rank.beat for rank in self.ranks]

    def describe(self) -> str:
        if not self.ranks:
            return f"no rank sent a heartbeat in {self.idle_s:.0f} s of running (stuck starting up?)"
        steps = [rank.beat.step for rank in self.ranks if rank.beat.step is not None]
        last_step = f"last step {max(steps)}" if steps else "no step reached"
        # Every rank, not only those past the limit: a rank that went quiet a poll later (blocked in
        # the collective the first one left) is part of the picture, and the job stops as a whole.
        ranks = ", ".join(rank.describe() for rank in self.ranks)
        return f"no progress for {self.idle_s:.0f} s ({last_step}); stopped: {ranks}"


class Watchdog:
    """Reads and keeps one job dir's clocks for the driver that holds its lease."""

    def __init__(self, paths: JobPaths, limits: Limits) -> None:
        self.paths = paths
        self.limits = limits
        # rank -> (its heartbeat as last read, the driver's monotonic time when that was new)
        self._heard: dict[int, tuple[tuple[int, float, float], float]] = {}
        # rank -> its newest-started beat heard (the current run's, which a stale one does not replace)
        self._current: dict[int, RankProgress] = {}
        # job id -> the driver's monotonic time of its first look at the job running
        self._first_look: dict[str, float] = {}
        # job id -> (the driver's monotonic time of its last look at the job running, watched_s then)
        self._looked: dict[str, tuple[float, float]] = {}

    def running_since(self, job_id: str) -> float:
        """When ``job_id`` started running (wall clock); recorded now when this is the first look at it
        running."""
        recorded = self._read(job_id)
        beats = self._beats()
        first_beat = min((beat.started_at for beat in beats), default=None)
        if recorded is None:
            now = world.time()
            since = min(now, first_beat) if first_beat is not None else now
            record = RunningSince(job_id=job_id, since=since)
            write_bytes_atomic(self.paths.running, record.model_dump_json().encode())
            return since
        return recorded.since if first_beat is None else min(recorded.since, first_beat)

    def timed_out(self, job_id: str, now: float) -> bool:
        """Over its run time by the wall clock, and by its ranks' own clocks when they beat, else by how
        long drivers have watched it running (see the module docstring). Called at each look at the
        job running: the looks are what the watch adds up."""
        limit = self.limits.timeout_s
        if limit is None:
            return False
        ranks = self._ranks()
        watched = self._watched_s(job_id, record=not ranks)
        if not self._wall_clock_past(job_id, now, limit):
            return False
        if not ranks:
            return watched > limit
        # A rank's own measure runs up to one heartbeat behind (and starts after its process did).
        return max(ran + rank.beat.interval_s for rank, ran in ranks) > limit

    def stall(self, job_id: str, now: float) -> Stall | None:
        """Why the running job ``job_id`` counts as hung; None while it progresses. ``now`` (wall
        clock) is only read for a job whose ranks never beat, to record when it was first seen."""
        limits = self.limits
        if limits.hang_timeout_s is None and limits.startup_timeout_s is None:
            return None
        ranks = self._ranks()
        if not ranks:
            self.running_since(job_id)
            idle = world.monotonic() - self._first_look.setdefault(job_id, world.monotonic())
            if limits.startup_timeout_s is not None and idle > limits.startup_timeout_s:
                return Stall(idle, [], [])
            return None
        if limits.hang_timeout_s is None:
            return None
        # A rank whose loop is over (it called finish, or exited) waits for the others legitimately.
        stalled = [
            rank for rank, _ in ranks if not rank.beat.finished and rank.idle_s > limits.hang_timeout_s
        ]
        if not stalled:
            return None
        idle = min(rank.idle_s for rank in stalled)
        return Stall(idle, [rank for rank, _ in ranks], [rank.beat.rank for rank in stalled])

    def stop_requested_at(self, job_id: str | None = None) -> float | None:
        """When the first rank of this run was asked to stop by a signal its script listened for
        (``ctx.should_stop()``); None when no rank was. With no heartbeat of a current run left,
        the run of ``job_id`` that ``new_run`` ended, as ``earlier_runs.json`` says."""
        beats = self._beats()
        if beats or job_id is None:
            return min((beat.stop_requested_at for beat in beats if beat.stop_requested_at), default=None)
        earlier = self._earlier()
        return earlier.stop_requested_at if earlier is not None and earlier.job_id == job_id else None

    def stopped_by_time_limit(self, job_id: str, stop_requested_at: float, grace_s: float) -> bool:
        """Whether a stop signal at ``stop_requested_at`` was the backend's warning before the run-time
        limit (``sbatch --signal`` sends it ``grace_s`` early, up to a minute earlier still)."""
        limit = self.limits.timeout_s
        at = stop_requested_at + grace_s + TIME_LIMIT_SIGNAL_SLACK_S
        return limit is not None and self._wall_clock_past(job_id, at, limit)

    def new_run(self, job_id: str) -> None:
        """The run of job ``job_id`` is over and the next starts afresh (the backend put the job back
        in its queue, as a Slurm requeue, or the driver restarts it): both clocks start again, and the
        last run's heartbeats, even those its ranks left behind go on writing, never count against the
        next run (see the module docstring); whether it was asked to stop is kept."""
        self._end_run(job_id, [*read_progress(self.paths.progress), *self._current.values()])
        for beat_file in self.paths.progress.glob("rank-*.json"):
            beat_file.unlink(missing_ok=True)

    def restarted_in_place(self, job_id: str) -> None:
        """The backend restarted job ``job_id`` in place since this driver's last look (its run mark
        changed): the ranks heard at earlier looks are the ended run's, and both clocks start again,
        as in ``new_run``. Unlike ``new_run``, called before the next run starts, the heartbeat files
        stay: the new run may have beaten already, and its beat counts."""
        self._end_run(job_id, list(self._current.values()))

    def _end_run(self, job_id: str, beats: list[RankProgress]) -> None:
        """Keep the identities of ``beats``' ranks as an earlier run's, and forget this run's clocks."""
        stopped = self.stop_requested_at()
        earlier = self._earlier()
        if beats:
            known = earlier.ranks if earlier is not None else []
            ranks = list(dict.fromkeys([*known, *(_identity(beat) for beat in beats)]))
            started_until = max(beat.started_at for beat in beats)
            if earlier is not None:
                started_until = max(started_until, earlier.started_until)
            record = EarlierRuns(
                started_until=started_until,
                ranks=ranks[-MAX_EARLIER_RANKS:],
                job_id=job_id,
                stop_requested_at=stopped,
            )
            write_bytes_atomic(self.paths.earlier_runs, record.model_dump_json().encode())
        self.paths.running.unlink(missing_ok=True)
        self._heard.clear()
        self._current.clear()
        self._first_look.clear()
        self._looked.clear()

    def _watched_s(self, job_id: str, *, record: bool) -> float:
        """How long drivers have watched ``job_id`` running: what ``running.json`` says earlier drivers
        watched, plus this driver's monotonic time since its first look; written back (``record``)
        every ``WATCH_RECORD_S``."""
        self.running_since(job_id)  # the first look at this job id starts its record
        kept = self._read(job_id)
        recorded = kept.watched_s if kept is not None else 0.0
        now = world.monotonic()
        last = self._looked.get(job_id)
        watched = recorded if last is None else last[1] + (now - last[0])
        self._looked[job_id] = (now, watched)
        if record and kept is not None and watched - recorded >= WATCH_RECORD_S:
            updated = kept.model_copy(update={"watched_s": watched})
            write_bytes_atomic(self.paths.running, updated.model_dump_json().encode())
        return watched

    def _wall_clock_past(self, job_id: str, now: float, limit: float) -> bool:
        return now - self.running_since(job_id) > limit

    def _ranks(self) -> list[tuple[RankIdle, float]]:
        """Each rank's idleness, and how long it has run (see the module docstring)."""
        now = world.monotonic()
        measured = []
        for beat in self._beats():
            heard = (beat.pid, beat.started_at, beat.beat_at)
            last = self._heard.get(beat.rank)
            if last is None or last[0] != heard:
                self._heard[beat.rank] = last = (heard, now)
            silent = now - last[1]
            idle = RankIdle(beat, _idle_s(beat) + silent, silent)
            measured.append((idle, _ran_s(beat) + silent))
        return measured

    def _beats(self) -> list[RankProgress]:
        """The current run's heartbeats, one per rank (see the module docstring)."""
        earlier = self._earlier()
        beats = []
        for beat in read_progress(self.paths.progress):
            heard = self._current.get(beat.rank)
            started_before_heard = heard is not None and beat.started_at < heard.started_at
            if _of_an_earlier_run(beat, earlier) or started_before_heard:
                if heard is not None and not _of_an_earlier_run(heard, earlier):
                    beats.append(heard)
                continue
            self._current[beat.rank] = beat
            beats.append(beat)
        return beats

    def _earlier(self) -> EarlierRuns | None:
        try:
            return EarlierRuns.model_validate_json(self.paths.earlier_runs.read_bytes())
        except (FileNotFoundError, ValidationError):
            return None

    def _read(self, job_id: str) -> RunningSince | None:
        try:
            record = RunningSince.model_validate_json(self.paths.running.read_bytes())
        except (FileNotFoundError, ValidationError):
            return None
        return record if record.job_id == job_id else None


def _idle_s(beat: RankProgress) -> float:
    """How long the rank had not advanced when it beat (see the module docstring)."""
    return beat.idle_s if beat.idle_s is not None else max(0.0, beat.beat_at - beat.advanced_at)


def _ran_s(beat: RankProgress) -> float:
    """How long the rank had run when it beat."""
    return beat.ran_s if beat.ran_s is not None else max(0.0, beat.beat_at - beat.started_at)


def _identity(beat: RankProgress) -> tuple[str, int, float]:
    return (beat.host, beat.pid, beat.started_at)


def _of_an_earlier_run(beat: RankProgress, earlier: EarlierRuns | None) -> bool:
    """Whether ``beat`` is of a rank of a run that is over (see the module docstring)."""
    if earlier is None:
        return False
    if earlier.ranks:
        return _identity(beat) in {tuple(rank) for rank in earlier.ranks}
    return beat.started_at <= earlier.started_until
