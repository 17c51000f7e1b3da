"""Mirroring one job dir into one MLflow run: every step's reports, the job's tags, the final record.

A mirror never runs on a thread that drives a job: the ``TrackingOutbox`` calls ``sync`` from its own
thread, and again, later, for as long as MLflow does not answer. So ``sync`` is idempotent, and what it
has already brought over is kept in the job dir (``<job_dir>/mlflow.json``): the run id, how far into
the metrics file the run holds the reports, the logged model, whether the final record was written. A
restarted orchestrator carries on from there instead of logging anything twice.

The job's reports wait in its metrics file, which the job appends durably: the metrics file IS the
outbox, and an MLflow outage costs nothing but delay. Every line of it reaches the run once, two lines
at one step included (a resumed job that redoes steps appends new lines: new points). The position
saved is that of whole lines, after the batch that logged them: a crash between a batch and its save
logs that batch again, the same points (each carries its report's own time), which MLflow's SQL store
keeps once.

A point MLflow refuses (a metric name it does not take: a job on an older runtime, or writing the file
itself) would fail every sync and hold back everything after it. The mirror sets such points aside for
good (a warning, the names in ``mlflow.json`` and in the run's ``<tag prefix>refused_metrics`` tag) and
logs the rest: those the runtime's rule (``metric_name_problem``) refuses without asking MLflow, and
those MLflow itself refuses (``INVALID_PARAMETER_VALUE``) on a run that takes writes, narrowed down to
the points refused. An MLflow that does not answer is no refusal: the sync fails, and is retried.

The ranks' telemetry (``ctx.step_done``: step time, samples and tokens per second, peak memory, in
their heartbeat files) is logged as ``rank<N>/<figure>`` metrics at the rank's step, when a sync finds
figures newer than those it logged, at most every ``TELEMETRY_MIRROR_S`` while the job runs, and the
last figures once more with the final record. Each point carries the time the rank measured it, so a
restarted orchestrator that logs the same figures again writes the same point, which MLflow keeps once.

A job with checkpoint tiers records each restore in its restores file (``tunepod.runtime.restores``).
The run carries them as tags, set again whenever the file grew: ``<tag prefix>restored_from`` and
``restored_step`` (the latest restore: a search such as ``tags."tunepod.restored_from" = 'peer
memory'`` finds the trials a node loss sent to a peer's copy) and ``restores`` (all of them, a JSON
list). Tags, not params or metrics: a tier is text, a restore happens once per attempt at most, and a
tag set again to the same value is no change, so a restarted orchestrator writes nothing twice.

A job whose group changed size (an elastic job re-formed with fewer nodes after a node loss, or a job
that came back on another number of nodes) has more than one line in its worlds file
(``tunepod.runtime.worlds``): the run gets the metric ``<tag prefix>world_size`` at the step each world
started from (the restored step), each point with the time rank 0 recorded it, so logging it again
writes the same points; and the tag of that name holds the latest. A job that always ran in one world
logs neither.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import BaseModel, ValidationError

from tunepod import world
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.locks import locked
from tunepod.runtime import Report, ReportTail
from tunepod.runtime.checkpoints import verified_checkpoint
from tunepod.runtime.files import write_bytes_atomic
from tunepod.runtime.metrics import metric_name_problem
from tunepod.runtime.progress import RankProgress, read_progress
from tunepod.runtime.restores import Restore, read_restores
from tunepod.runtime.worlds import read_worlds
from tunepod.tracking import tags
from tunepod.tracking.mlflow_tracker import Point, RunStatus, RunTracker
from tunepod.tracking.reserve import RunReserve, adopt_reserved_run, forget_reserved_run

logger = logging.getLogger(__name__)

REPORTS_PER_BATCH = 1000
"""Reports logged to MLflow between two saves of how far the run is up to date."""
TELEMETRY_MIRROR_S = 30.0
"""While a job runs, its ranks' telemetry is logged at most this often (the final record always logs
the last figures): a point per rank and figure every 30 s, whatever the job's step rate."""


MAX_TAG_CHARS = 8000
"""MLflow's limit on a tag's value."""

# Every metric of every line is checked, and a job's few names come back on every line: a cache makes
# the check cost a lookup (bounded: a job may make up a name per step).
_name_problem = functools.lru_cache(maxsize=1024)(metric_name_problem)


class MirrorState(BaseModel):
    """``<job_dir>/mlflow.json``: how far the job's run is up to date."""

    run_id: str | None = None
    synced_offset: int | None = None
    """The run holds the reports of the metrics file's first ``synced_offset`` bytes (whole lines).
    None: a record of a version that kept only ``synced_step`` (see ``legacy_offset``)."""
    synced_step: int = -1
    """The highest step of a report in the run. What versions before ``synced_offset`` went by (they
    lost a report at a step already mirrored); still kept, for an older tunepod reading this record and
    for the growth benchmark."""
    run_requested: bool | None = None
    """Whether a run was asked of MLflow for this job dir (it may exist though its id never came
    back); None in a record of a version that did not say (then it may have been)."""
    refused_metrics: tuple[str, ...] = ()
    """Metric names whose points were set aside because MLflow refuses them (sorted)."""
    model_id: str | None = None
    finalized: bool = False
    named: bool = True
    """False while the run is one made ahead (``tunepod.tracking.reserve``) that does not yet carry the
    job's name, tags and params: the next sync sets them."""


def read_mirror_state(job_dir: Path) -> MirrorState:
    try:
        return MirrorState.model_validate_json(JobPaths(job_dir).tracking.read_bytes())
    except (FileNotFoundError, ValidationError):
        return MirrorState()


@dataclass(frozen=True)
class RunPlan:
    """How to find, or else create, the run a job writes into."""

    key: str
    """Unique in the experiment (the ``tunepod.key`` tag): looked up before a run is created."""
    name: str
    parent_run_id: str | None
    tags: Mapping[str, str]
    params: Mapping[str, object]


@dataclass(frozen=True)
class ModelPlan:
    """A checkpoint folder to log as the run's MLflow logged model."""

    checkpoint: Path
    name: str
    step: int
    params: Mapping[str, object]


@dataclass(frozen=True)
class Final:
    """What the run records once the job's outcome is known."""

    tags: Mapping[str, object]
    status: RunStatus | None
    """How the run ends; None leaves it open (an evaluation writes into its trial's run)."""
    metrics: tuple[Point, ...] = ()
    error: str | None = None
    model: ModelPlan | None = None
    checkpoints: tuple[Path, ...] = field(default_factory=tuple)


@dataclass
class _Writes:
    """What one sync writes into its run, and what the mirror records once it is written."""

    points: list[Point] = field(default_factory=list)
    tags: dict[str, object] = field(default_factory=dict)
    params: dict[str, object] = field(default_factory=dict)
    state: dict[str, object] = field(default_factory=dict)
    """Fields of the job dir's tracking record, saved once written."""
    on_written: list[Callable[[], None]] = field(default_factory=list)


class RunMirror:
    """Brings one MLflow run up to date with one job dir. See the module docstring.

    ``plan`` finds or creates the run (a trial, a train step); ``run_id`` names an existing run to
    write into instead (an evaluation's trial run); with ``reserve``, a job dir that never asked MLflow
    for a run takes one made ahead, at once, and the first sync names it. Job tags go under
    ``tag_prefix``.
    Thread safety: ``finish`` may be called from any thread; ``sync`` from one thread at a time.
    """

    def __init__(
        self,
        tracker: RunTracker,
        job_dir: Path,
        *,
        plan: RunPlan | None = None,
        run_id: str | None = None,
        tag_prefix: str = tags.PREFIX,
        mirror_reports: bool = True,
        mirror_telemetry: bool | None = None,
        reserve: RunReserve | None = None,
    ) -> None:
        if plan is None and run_id is None:
            raise ValueError("a mirror needs a plan for its run, or the id of an existing run")
        self.tracker = tracker
        self.job_dir = job_dir
        self.plan = plan
        self.tag_prefix = tag_prefix
        self.mirror_reports = mirror_reports
        # Default: only the run's own job (a trial, a train step); an evaluation writing into its
        # trial's run must not mix its ranks' figures into the training's.
        self.mirror_telemetry = (
            mirror_reports and tag_prefix == tags.PREFIX if mirror_telemetry is None else mirror_telemetry
        )
        self._telemetry_logged: dict[int, float] = {}  # rank -> measured_at of its last logged figures
        self._telemetry_synced_at = -math.inf
        self._state = read_mirror_state(job_dir)
        if run_id is not None and self._state.run_id is None:
            self._state = self._state.model_copy(update={"run_id": run_id})
        # Read from the top, also after a restart: the lines up to the saved position are in the run
        # already, and only fill in _logged_last.
        self._tail = ReportTail(JobPaths(job_dir).metrics)
        self._pending: list[tuple[Report, int]] = []  # read, not yet logged: each with its line's end
        # Each metric's logged point at the highest step (the later line, for a step reported twice):
        # the final record's objectives are at the last step, and one that is that very point is not
        # logged again. Kept as the reports are logged, so that the final record need not read the
        # whole metrics file again.
        self._logged_last: dict[str, tuple[int, float]] = {}
        self._refusals_tagged: tuple[str, ...] = ()
        self._restores_size = 0  # bytes of the restores file last tagged
        self._worlds_size = 0  # bytes of the worlds file last logged
        self._tagged: tuple[str, int] | None = None
        # Logged with a write the sync makes anyway; again after a restart, as that write may not
        # have happened (the same value again is no change).
        self._params_pending: Mapping[str, object] = dict(plan.params) if plan is not None else {}
        self._final: Final | None = None
        self._lock = world.lock()
        self._run_known = world.event()
        if self._state.run_id is not None:
            self._run_known.set()
        self._create_record()
        if reserve is not None:
            self._take_reserved(reserve)

    def _create_record(self) -> None:
        """Write the job dir's tracking record if it has none, at once: a job dir with one is a job
        whose run must be brought up to date, even when MLflow never answered while the job ran.
        Under the tracking lock, as every write that may race another mirror of the job dir: a stale
        mirror's write, finished late, would put its empty record over one that names the run, and
        the next look would create a second run."""
        paths = JobPaths(self.job_dir)
        if paths.tracking.exists():
            return
        with locked(paths.tracking_lock):
            if paths.tracking.exists():
                self._catch_up_with_disk()
            else:
                self._save(run_requested=False)

    def _take_reserved(self, reserve: RunReserve) -> None:
        """Take a run made ahead when this job dir never asked MLflow for one (a job dir that did may
        have its run already, found by its key). Under the tracking lock, as every write of the record."""
        if self.plan is None or self._state.run_id is not None or self._state.run_requested is not False:
            return
        with locked(JobPaths(self.job_dir).tracking_lock):
            self._catch_up_with_disk()
            if self._state.run_id is not None or self._state.run_requested is not False:
                return
            taken = adopt_reserved_run(self.job_dir) or reserve.take_into(self.job_dir)
            if taken is not None:
                self._record_reserved(taken)

    def _record_reserved(self, run_id: str) -> None:
        """The job dir's run is ``run_id``, taken from a reserve; named at the next sync."""
        self._save(run_id=run_id, run_requested=True, named=False)
        forget_reserved_run(self.job_dir)

    @property
    def run_id(self) -> str | None:
        return self._state.run_id

    @property
    def model_id(self) -> str | None:
        return self._state.model_id

    @property
    def is_done(self) -> bool:
        """True once the final record is written (nothing left to bring over)."""
        return self._state.finalized

    def wait_for_run(self, timeout_s: float) -> str | None:
        """The run's id once known, waiting up to ``timeout_s`` for the outbox to create it."""
        self._run_known.wait(timeout_s)
        return self._state.run_id

    def finish(self, final: Final) -> None:
        """The job's outcome is known: write ``final`` at the next sync (once)."""
        with self._lock:
            self._final = final

    def sync(self) -> None:
        """Bring the run up to date. Raises whatever MLflow raises; calling again later is safe.

        What a sync finds (the job's tags, its new reports, restores, world sizes and ranks' figures,
        its final record) goes to MLflow in one write where MLflow's limits allow, not a write each:
        every write is a SQLite transaction or a request to a tracking server, and an outbox behind
        short trials finds all of a trial's records at once."""
        # Read before the reports: once the outcome is known the job has ended, so the reports read
        # next are all of them. Read after, a batch that took long to log could have started before
        # the job's last reports, and the run would end with them still to come.
        with self._lock:
            final = self._final
        self._catch_up_with_disk()
        run_id = self._ensure_run()
        synced_from = self._state
        writes = _Writes()
        self._add_job_tags(writes)
        if self.mirror_reports:
            self._add_reports(run_id, writes)
        self._add_restores(writes)
        self._add_worlds(writes)
        if self.mirror_telemetry and not self._state.finalized:
            self._add_telemetry(writes, last=final is not None)
        ending = final if final is not None and not self._state.finalized else None
        if ending is not None:
            self._add_final(run_id, ending, writes)
        # The plan's params ride with a write made anyway, never one of their own (two drivers of a
        # job dir writing its params at once make MLflow fail one of them).
        if self._params_pending and (writes.points or writes.tags):
            writes.params |= self._params_pending
            writes.on_written.append(functools.partial(setattr, self, "_params_pending", {}))
        self._write(run_id, writes)
        if ending is not None:
            self._end(run_id, ending)
        # Saved once, after the run's end: a crash before the save costs the same writes again,
        # which MLflow takes as no change.
        if self._state != synced_from:
            self._save()

    # ------------------------------------------------------------------------------------ steps

    def _catch_up_with_disk(self) -> None:
        """Take what an earlier driver of the job dir (a previous attempt of the step, a previous run)
        already brought over, so it is not written twice."""
        disk = read_mirror_state(self.job_dir)
        mine = self._state
        offsets = [offset for offset in (mine.synced_offset, disk.synced_offset) if offset is not None]
        self._state = MirrorState(
            run_id=mine.run_id or disk.run_id,
            run_requested=_either(mine.run_requested, disk.run_requested),
            synced_offset=max(offsets, default=None),
            synced_step=max(mine.synced_step, disk.synced_step),
            refused_metrics=tuple(sorted({*mine.refused_metrics, *disk.refused_metrics})),
            model_id=mine.model_id or disk.model_id,
            finalized=mine.finalized or disk.finalized,
            # Naming again what another driver named is the same write again: no harm.
            named=mine.named and disk.named,
        )
        if self._state.run_id is not None:
            self._run_known.set()

    def _ensure_run(self) -> str:
        if self._state.run_id is not None:
            return self._state.run_id
        # Under the job dir's tracking lock: two mirrors of one job dir (two orchestrators, one of
        # them stale) must not both create its run.
        with locked(JobPaths(self.job_dir).tracking_lock):
            self._catch_up_with_disk()
            if self._state.run_id is not None:
                return self._state.run_id
            return self._find_or_create_run()

    def _find_or_create_run(self) -> str:
        """The job's run: looked up by its key once a run was ever asked for (a restart, a create whose
        answer was lost, a crash before its id was saved), else created, the request recorded first."""
        assert self.plan is not None
        plan = self.plan
        if self._state.run_requested is False and (taken := adopt_reserved_run(self.job_dir)) is not None:
            self._record_reserved(taken)  # taken by a mirror that crashed before it recorded the take
            return taken
        found = None if self._state.run_requested is False else self.tracker.find_run(plan.key)
        if found is None:
            self._save(run_requested=True)
            found = self.tracker.start_run(
                plan.name, parent_run_id=plan.parent_run_id, tags={**plan.tags, tags.KEY: plan.key}
            )
        self._save(run_id=found)
        return found

    def _add_job_tags(self, writes: _Writes) -> None:
        """The job's tags when its submission is new, and the name and tags of the plan when the run
        was made ahead and not named yet (each again after a restart: that write may not have
        happened, and the same value again is no change)."""
        if naming := self._naming_tags():
            writes.tags |= naming
            writes.state["named"] = True
        record = read_submission(JobPaths(self.job_dir))
        submitted = None if record is None or record.job_id is None else (record.job_id, record.attempt)
        if submitted is not None and submitted != self._tagged:
            job_id, job_dir, attempt = tags.job_tags(self.tag_prefix)
            writes.tags |= {job_id: submitted[0], job_dir: str(self.job_dir), attempt: submitted[1]}
            writes.on_written.append(functools.partial(setattr, self, "_tagged", submitted))

    def _naming_tags(self) -> dict[str, object]:
        """What a run made ahead lacks of its plan: name, tags, key; nothing once named."""
        if self._state.named or self.plan is None:
            return {}
        plan = self.plan
        return {tags.RUN_NAME: plan.name, **plan.tags, tags.KEY: plan.key, tags.RESERVED: "false"}

    def _add_reports(self, run_id: str, writes: _Writes) -> None:
        """The metrics file's new lines. A backlog (a job that reported faster than MLflow took its
        reports, an MLflow outage) is written batch by batch first, each position saved after it, so
        a restart costs one batch, not the whole backlog; the last batch goes with the sync's other
        writes."""
        self._pending += self._tail.read_new_with_ends()
        if self._state.synced_offset is None:
            # Not saved: found again from the same file after a crash, and saved with the next write.
            self._state = self._state.model_copy(
                update={"synced_offset": legacy_offset(self._pending, self._state.synced_step)}
            )
        in_run = self._state.synced_offset or 0
        # Lines up to the saved position are in the run: logged before a restart, or by another
        # driver of the job dir since this one read them (see _catch_up_with_disk).
        for report, end in self._pending:
            if end <= in_run:
                self._note_logged(report)
        self._pending = [(report, end) for report, end in self._pending if end > in_run]
        while len(self._pending) > REPORTS_PER_BATCH:
            backlog = _Writes()
            self._add_lines(backlog, self._pending[:REPORTS_PER_BATCH])
            self._write(run_id, backlog)
            self._save()
        if self._pending:
            self._add_lines(writes, list(self._pending))

    def _add_lines(self, writes: _Writes, lines: list[tuple[Report, int]]) -> None:
        """The first ``lines`` of those pending, with the position past them saved once written. A
        point the runtime's rule refuses is set aside without asking MLflow (``screened``)."""
        reports = [report for report, _ in lines]
        loggable, refused = screened(reports)
        self._set_aside(refused)
        writes.points += report_points(loggable)
        # Noted now, for the final record's points: a line not written stays pending, and the
        # next sync writes it again, so a final point equal to it is not lost.
        for report in reports:
            self._note_logged(report)
        writes.state["synced_offset"] = lines[-1][1]
        writes.state["synced_step"] = max(self._state.synced_step, *(report.step for report in reports))
        writes.on_written.append(functools.partial(self._drop_pending, len(lines)))

    def _drop_pending(self, count: int) -> None:
        del self._pending[:count]

    def _write(self, run_id: str, writes: _Writes) -> None:
        """Write ``writes`` (points MLflow refuses set aside), and take what they brought over into the
        state (the caller saves it)."""
        if self._state.refused_metrics != self._refusals_tagged:  # set aside while collecting
            writes.tags[self._refusals_tag] = refused_tag_value(self._state.refused_metrics)
            writes.on_written.append(
                functools.partial(setattr, self, "_refusals_tagged", self._state.refused_metrics)
            )
        refused = self._log_refusing(run_id, writes) if writes.points or writes.tags or writes.params else []
        self._set_aside(refused)
        for done in writes.on_written:
            done()
        self._state = self._state.model_copy(update=writes.state)
        self._tag_refusals(run_id)  # names MLflow itself refused just now (rare): a write of their own

    def _log_refusing(self, run_id: str, writes: _Writes) -> list[tuple[str, str]]:
        """Write ``writes``; if MLflow refuses them while the run takes writes, the refusal is about a
        point, or a tag or param: the tags and params are written alone (a refusal raised), and the
        points MLflow refuses on their own are returned as (name, MLflow's reason), the rest
        logged (see ``_log_points_refusing``). Raises what MLflow raises otherwise."""
        try:
            self.tracker.log_batch(run_id, writes.points, writes.tags, params=writes.params or None)
            return []
        except Exception as exc:
            # A deleted run refuses every write with the same error code: that is no reason to drop
            # the job's reports (retried, as while MLflow is away).
            if not refused_by_mlflow(exc) or not self.tracker.run_is_active(run_id):
                raise
        if writes.tags or writes.params:
            self.tracker.log_batch(run_id, (), writes.tags, params=writes.params or None)
        return self._log_points_refusing(run_id, writes.points)

    def _log_points_refusing(self, run_id: str, points: Sequence[Point]) -> list[tuple[str, str]]:
        """Log ``points`` of a run that takes writes; those MLflow refuses on their own are returned,
        as (name, MLflow's reason), and the rest logged (halves, then quarters: a few calls for one
        bad point in a batch)."""
        if not points:
            return []
        try:
            self.tracker.log_batch(run_id, points, {})
            return []
        except Exception as exc:
            if not refused_by_mlflow(exc):
                raise
            reason = mlflow_reason(exc)
        if len(points) == 1:
            return [(points[0].key, reason)]
        middle = len(points) // 2
        return [
            *self._log_points_refusing(run_id, points[:middle]),
            *self._log_points_refusing(run_id, points[middle:]),
        ]

    def _note_logged(self, report: Report) -> None:
        for key, value in report.metrics.items():
            later = report.step >= self._logged_last.get(key, (-1, 0.0))[0]
            if later and key not in self._state.refused_metrics:
                self._logged_last[key] = (report.step, value)

    def _set_aside(self, refused: Sequence[tuple[str, str]]) -> None:
        """Points MLflow refuses, as (metric name, why): each new name warned about once and kept in
        the state (saved with the next write's position; tagged on the run by _write)."""
        new = {name: why for name, why in refused if name not in self._state.refused_metrics}
        for name, why in new.items():
            logger.warning(
                "%s: MLflow refuses the metric %r (%s); its points are set aside and the rest of the job's "
                "records are logged (the run's tag %s lists it)",
                self.job_dir,
                name,
                why,
                self._refusals_tag,
            )
        if new:
            names = tuple(sorted({*self._state.refused_metrics, *new}))
            self._state = self._state.model_copy(update={"refused_metrics": names})

    @property
    def _refusals_tag(self) -> str:
        return f"{self.tag_prefix}{tags.REFUSED_METRICS}"

    def _tag_refusals(self, run_id: str) -> None:
        """The run's tag lists the names set aside (again after a restart: the same value is no change)."""
        names = self._state.refused_metrics
        if names != self._refusals_tagged:
            self.tracker.set_tags(run_id, {self._refusals_tag: refused_tag_value(names)})
            self._refusals_tagged = names

    def _add_restores(self, writes: _Writes) -> None:
        """The job's restores as tags when its restores file grew (a stat per sync else)."""
        path = JobPaths(self.job_dir).restores
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._restores_size:
            return
        if found := read_restores(path):
            writes.tags |= restore_tags(self.tag_prefix, found)
        writes.on_written.append(functools.partial(setattr, self, "_restores_size", size))

    def _add_worlds(self, writes: _Writes) -> None:
        """The job's world sizes when its worlds file grew and holds a change (a stat per sync else)."""
        path = JobPaths(self.job_dir).worlds
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._worlds_size:
            return
        found = read_worlds(path)
        if len(found) > 1:
            name = f"{self.tag_prefix}{tags.WORLD_SIZE}"
            writes.points += [Point(name, float(w.world_size), w.step, int(w.time * 1000)) for w in found]
            writes.tags[name] = str(found[-1].world_size)
        writes.on_written.append(functools.partial(setattr, self, "_worlds_size", size))

    def _add_telemetry(self, writes: _Writes, *, last: bool) -> None:
        """The ranks' figures that are newer than the logged ones; while the job runs (not ``last``),
        at most every ``TELEMETRY_MIRROR_S``."""
        now = world.monotonic()
        if not last and now - self._telemetry_synced_at < TELEMETRY_MIRROR_S:
            return
        fresh = [
            beat
            for beat in read_progress(JobPaths(self.job_dir).progress)
            if beat.telemetry is not None
            and beat.telemetry.measured_at > self._telemetry_logged.get(beat.rank, -math.inf)
        ]
        if not fresh:
            return
        writes.points += report_points(telemetry_report(beat) for beat in fresh)
        writes.on_written.append(functools.partial(self._telemetry_written, now, fresh))

    def _telemetry_written(self, now: float, fresh: list[RankProgress]) -> None:
        self._telemetry_synced_at = now
        for beat in fresh:
            assert beat.telemetry is not None
            self._telemetry_logged[beat.rank] = beat.telemetry.measured_at

    def _add_final(self, run_id: str, final: Final, writes: _Writes) -> None:
        """The final record's points and tags (its model logged first, in writes of its own)."""
        model_id = self._state.model_id
        if final.model is not None and model_id is None:
            model_id = self._log_model(run_id, final.model)
        self._set_aside([(m.key, problem) for m in final.metrics if (problem := _name_problem(m.key))])
        writes.points += [
            metric
            for metric in final.metrics
            if metric.key not in self._state.refused_metrics
            # The job's own report of that step, logged, is this very point: log it once.
            and self._logged_last.get(metric.key) != (metric.step, metric.value)
        ]
        writes.tags |= final.tags
        if final.model is not None:
            writes.tags[tags.MODEL_ID] = model_id or ""
        if final.checkpoints:
            writes.tags[tags.CHECKPOINTS] = " ".join(path.as_uri() for path in final.checkpoints)

    def _end(self, run_id: str, final: Final) -> None:
        """The run's error and end, once its final record is written."""
        if final.error:
            self.tracker.log_text(run_id, final.error, "error.txt")
        if final.status is not None:
            self.tracker.end_run(run_id, final.status)
        self._state = self._state.model_copy(update={"finalized": True})

    def _log_model(self, run_id: str, model: ModelPlan) -> str | None:
        # Looked up first: a reply lost after the model was logged must not log it twice.
        model_id = self.tracker.find_logged_model(run_id, model.name)
        if model_id is None:
            intact = intact_model(model)
            if intact is None:
                return None
            model_id = self.tracker.log_checkpoint_model(
                run_id, intact.checkpoint, name=intact.name, step=intact.step, params=intact.params
            )
        self._save(model_id=model_id)
        return model_id

    def _save(self, **update: object) -> None:
        self._state = self._state.model_copy(update=update)
        write_bytes_atomic(JobPaths(self.job_dir).tracking, self._state.model_dump_json().encode())
        if self._state.run_id is not None:
            self._run_known.set()


def legacy_offset(reports: Sequence[tuple[Report, int]], synced_step: int) -> int:
    """Where the run's reports end in the metrics file, for a record that kept only ``synced_step`` (a
    tunepod before ``synced_offset``), from the file's ``reports`` (each with its line's end).

    That version logged each line it read whose step was above the highest step already logged, so
    the run holds the first line that reached ``synced_step``, and the lines before it were all read
    (logged, or lost to its same-step bug: not recoverable without logging the whole file again). The
    position is just past that line: the lines after it are logged now; one logged then too is the
    same point again, which MLflow keeps once. No such line (the file is not the one mirrored): 0.
    """
    if synced_step < 0:
        return 0
    return next((end for report, end in reports if report.step >= synced_step), 0)


def report_points(reports: Iterable[Report]) -> list[Point]:
    """The points of ``reports``, each at its report's step and time; a value MLflow does not store
    (NaN, an infinity) is left out."""
    return [
        Point(key, float(value), report.step, int(report.time * 1000))
        for report in reports
        for key, value in report.metrics.items()
        if math.isfinite(value)
    ]


def screened(reports: Sequence[Report]) -> tuple[list[Report], list[tuple[str, str]]]:
    """``reports`` without the metrics whose names MLflow refuses (``metric_name_problem``), and those
    as (name, why). A report left with no metric is dropped."""
    kept: list[Report] = []
    refused: list[tuple[str, str]] = []
    for report in reports:
        problems = {key: problem for key in report.metrics if (problem := _name_problem(key))}
        refused += problems.items()
        metrics = {key: value for key, value in report.metrics.items() if key not in problems}
        if metrics:
            kept.append(report if not problems else replace(report, metrics=metrics))
    return kept, refused


def refused_by_mlflow(exc: BaseException) -> bool:
    """MLflow answered and refused the data sent (``INVALID_PARAMETER_VALUE``: a name, value, step or
    timestamp it does not take; also any write to a deleted run), as opposed to not answering: no
    server, a locked SQLite file, a proxy's error (no MLflow error code, or ``INTERNAL_ERROR``,
    ``TEMPORARILY_UNAVAILABLE``), which is retried. MLflow's exceptions (``MlflowException``, and
    ``RestException`` for a tracking server's answer) carry the code's name as ``error_code``."""
    return getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE"


def mlflow_reason(exc: BaseException) -> str:
    return str(getattr(exc, "message", exc))[:500]


def refused_tag_value(names: Sequence[str]) -> str:
    """The names as a JSON list, cut to what a tag holds."""
    value = json.dumps(list(names))
    return value if len(value) <= MAX_TAG_CHARS else value[: MAX_TAG_CHARS - 3] + "..."


def restore_tags(prefix: str, restores: Sequence[Restore]) -> dict[str, str]:
    """The run's tags for a job's ``restores`` (oldest first, at least one): the latest one's tier and
    step, and all of them as a JSON list, the oldest left out first when it does not fit a tag."""
    latest = restores[-1]
    listed = [json.loads(restore.to_json()) for restore in restores]
    value = json.dumps(listed, sort_keys=True)
    while len(value) > MAX_TAG_CHARS and len(listed) > 1:
        listed.pop(0)
        value = json.dumps(listed, sort_keys=True)
    return {
        f"{prefix}{tags.RESTORED_FROM}": latest.tier,
        f"{prefix}{tags.RESTORED_STEP}": str(latest.step),
        f"{prefix}{tags.RESTORES}": value[:MAX_TAG_CHARS],
    }


def _either(mine: bool | None, disk: bool | None) -> bool | None:
    """True if either knows a run was requested, None if either does not know, else False."""
    if mine or disk:
        return True
    return None if mine is None or disk is None else False


def intact_model(model: ModelPlan) -> ModelPlan | None:
    """``model`` once its checkpoint's sha256 is verified (the logged model is what registration
    takes, so it is hashed here, once, and not at the trial's end with every kept step); if that step
    is corrupted, the newest intact one before it; None, logged, when no step is intact."""
    found = verified_checkpoint(model.checkpoint.parent, model.step)
    if found is None:
        logger.error("no intact checkpoint up to %s: no model is logged for it", model.checkpoint)
        return None
    if found.path != model.checkpoint:
        logger.warning("%s is corrupted; logging the model of %s instead", model.checkpoint, found.path)
    return replace(model, checkpoint=found.path, step=found.step)


def telemetry_report(beat: RankProgress) -> Report:
    """A rank's telemetry as the points MLflow logs: ``rank<N>/step_time_s``, ``/samples_per_s``,
    ``/tokens_per_s`` (when the rank counts them), ``/peak_memory_bytes`` and ``/cpu_busy``, at its
    step and time."""
    measured = beat.telemetry
    assert measured is not None
    figures = {
        "step_time_s": measured.step_time_s,
        "samples_per_s": measured.samples_per_s,
        "tokens_per_s": measured.tokens_per_s,
        "peak_memory_bytes": measured.peak_memory_bytes,
        "cpu_busy": measured.cpu_busy,
    }
    metrics = {f"rank{beat.rank}/{key}": float(value) for key, value in figures.items() if value is not None}
    return Report(step=measured.step, metrics=metrics, time=measured.measured_at)
