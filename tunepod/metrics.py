"""Prometheus metrics of a running pipeline: trials by state, trial and queue durations, staging,
checkpoint saves, and what the shipped alert rules watch (job progress, restarts, the last completed
trial).

Exposure: the pipeline process serves ``/metrics`` over HTTP while it runs (``metrics:`` in the spec),
and Prometheus scrapes it. Pull, not a Pushgateway push at the end of each step: a tune step runs for
minutes to hours, and what an operator needs then is live (trials running, jobs waiting in the queue),
which a push at step end cannot show; pull also needs no extra daemon and leaves no stale series
behind. A pipeline shorter than the scrape interval could end before any scrape, so
``metrics.linger_s`` keeps the endpoint up that long after the run ends.

Labels stay low-cardinality: ``pipeline``, ``study``, ``step``, ``state``; never a run id, and a trial
only on the per-rank gauges (``tunepod_rank_*``: ``trial``, ``rank``), which exist while the trial's job
runs and are removed when it stops, so their number is bounded by the running jobs' ranks. The
training job never imports prometheus-client: checkpoint save times come from the
``save_seconds`` the runtime writes into each checkpoint's metadata, and job progress from the ranks'
heartbeat files (``tunepod.runtime.progress``), read here as they appear. Per-job facts are therefore
reported per step, as the worst job of the step: the oldest progress among its running jobs says
whether any trial is stuck, which is what an alert needs; the driver's log names the trial. Speed is
per rank (``ctx.step_done``'s telemetry in the same files): step time, samples and tokens per second
and peak memory, so a dashboard sums a trial's throughput over its ranks and shows a rank unlike the
others.

Thread safety: every object here may be used from any thread (prometheus-client metrics are thread
safe; the mutable state of ``TrialObserver`` and ``ObservedJob`` sits behind a lock).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tunepod.launch.base import JobHandle, JobState
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import CancelReason, read_submission
from tunepod.runtime.checkpoints import saved_checkpoint, step_folders
from tunepod.runtime.progress import RankProgress, read_progress

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tunepod.hpo.trials import Tally
    from tunepod.spec.models import MetricsSpec

log = logging.getLogger(__name__)

#: The Optuna trial states ``tunepod_trials`` reports (WAITING trials are never created by tunepod).
TRIAL_STATES = ("RUNNING", "COMPLETE", "PRUNED", "FAIL")

# Buckets sized for what each one measures: trials last seconds (tests) to a day (real training).
TRIAL_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
QUEUE_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 14400)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STAGING_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)

TRIAL_LABELS = ("pipeline", "study", "step")
RANK_LABELS = (*TRIAL_LABELS, "trial", "rank")


class TunepodMetrics:
    """Every ``tunepod_*`` metric, registered in one registry (tests pass a fresh one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.trials = Gauge(
            "tunepod_trials",
            "Trials of the study in each Optuna state, as this orchestrator last read the study.",
            [*TRIAL_LABELS, "state"],
            registry=registry,
        )
        self.trial_duration = Histogram(
            "tunepod_trial_duration_seconds",
            "Seconds from a trial's first job submission to its final state, by final state.",
            [*TRIAL_LABELS, "state"],
            buckets=TRIAL_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "tunepod_trial_queue_wait_seconds",
            "Seconds from a job's submission to the first time it was seen running.",
            list(TRIAL_LABELS),
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.checkpoint_save = Histogram(
            "tunepod_checkpoint_save_seconds",
            "Seconds a training job took to write, fsync and hash one checkpoint (from its metadata).",
            list(TRIAL_LABELS),
            buckets=CHECKPOINT_BUCKETS,
            registry=registry,
        )
        self.last_progress = Gauge(
            "tunepod_job_last_progress_timestamp_seconds",
            "Unix time the least recently advancing running job of the step last advanced (its slowest "
            "rank's heartbeat). Absent while no job of the step runs with heartbeats.",
            list(TRIAL_LABELS),
            registry=registry,
        )
        self.rank_step_time = Gauge(
            "tunepod_rank_step_seconds",
            "Mean wall-clock seconds per training step of one rank of a running trial, over the steps "
            "between its last two heartbeats (ctx.step_done). Absent once the job stops running.",
            list(RANK_LABELS),
            registry=registry,
        )
        self.rank_samples = Gauge(
            "tunepod_rank_samples_per_second",
            "Samples per second one rank of a running trial processed over the same window (the "
            "samples it passed to ctx.step_done). Absent when it passes none.",
            list(RANK_LABELS),
            registry=registry,
        )
        self.rank_tokens = Gauge(
            "tunepod_rank_tokens_per_second",
            "Tokens per second one rank of a running trial processed over the same window (the "
            "tokens it passed to ctx.step_done). Absent when it passes none.",
            list(RANK_LABELS),
            registry=registry,
        )
        self.rank_cpu_busy = Gauge(
            "tunepod_rank_cpu_busy_ratio",
            "CPU seconds per wall second of one rank's training loop thread over the same window. Ranks "
            "in lockstep share one step time; on CPU jobs the rank the others wait for is the one near 1.",
            list(RANK_LABELS),
            registry=registry,
        )
        self.rank_peak_memory = Gauge(
            "tunepod_rank_peak_memory_bytes",
            "Peak memory of one rank of a running trial: CUDA's peak allocation when it uses CUDA, "
            "else its peak resident set size.",
            list(RANK_LABELS),
            registry=registry,
        )
        self.restarts = Counter(
            "tunepod_job_restarts",
            "Jobs of the step started again in place (after a failure or a hang) by this orchestrator.",
            list(TRIAL_LABELS),
            registry=registry,
        )
        self.last_completed = Gauge(
            "tunepod_study_last_completed_timestamp_seconds",
            "Unix time the study's last trial completed, or this orchestrator started the step if later.",
            list(TRIAL_LABELS),
            registry=registry,
        )
        self.staging_bytes = Counter(
            "tunepod_staging_copied_bytes",
            "Bytes a stage step copied onto the shared filesystem (unchanged files are not copied).",
            ["pipeline", "step"],
            registry=registry,
        )
        self.staging_seconds = Histogram(
            "tunepod_staging_seconds",
            "Wall-clock seconds of one stage step's copy.",
            ["pipeline", "step"],
            buckets=STAGING_BUCKETS,
            registry=registry,
        )

    def observe_staging(self, pipeline: str, step: str, *, copied_bytes: int, seconds: float) -> None:
        """Record one finished stage step."""
        self.staging_bytes.labels(pipeline, step).inc(copied_bytes)
        self.staging_seconds.labels(pipeline, step).observe(seconds)

    def trial_observer(self, *, pipeline: str, study: str, step: str) -> TrialObserver:
        """An observer for the trials of one tune step of ``pipeline``."""
        return TrialObserver(self, pipeline=pipeline, study=study, step=step)


_default: TunepodMetrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> TunepodMetrics:
    """The process-wide metrics, in prometheus-client's global registry (what the server exposes).
    Created on first use: registering the same names twice in one registry is an error."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TunepodMetrics(REGISTRY)
        return _default


# ---------------------------------------------------------------------------------------------- trials


class TrialObserver:
    """Feeds the trial metrics of one tune step. The tuner calls it; any thread may.

    Trial durations run from the trial's first submission that this process saw (or, for a job it
    re-attached to, the time the launcher wrote ``submission.json``) to the final state, so a job
    restarted in place still counts as one trial. Jobs are keyed by their job dir, which is stable
    per trial.
    """

    def __init__(self, metrics: TunepodMetrics, *, pipeline: str, study: str, step: str) -> None:
        self.metrics = metrics
        self.pipeline = pipeline
        self.study = study
        self.step = step
        self._first_submit: dict[Path, float] = {}
        self._progress: dict[Path, float] = {}
        self._rank_series: dict[Path, set[tuple[str, tuple[str, ...]]]] = {}
        # A resumed study's last completion may be days old: the stretch without one starts no
        # earlier than this step did, so the stalled-study alert does not fire at a resume.
        self._started_at = time.time()
        self._lock = threading.Lock()
        # From zero: increase() over a window needs the sample before the first restart.
        metrics.restarts.labels(*self.labels())

    def labels(self) -> tuple[str, str, str]:
        return (self.pipeline, self.study, self.step)

    def count_trials(self, tally: Tally) -> None:
        """Set ``tunepod_trials`` and the last completion from the study's tally (the study's own
        counts, not this process's: right after a resume and with several orchestrators on one study)."""
        for state in TRIAL_STATES:
            self.metrics.trials.labels(*self.labels(), state).set(tally.count(state))
        last = max(self._started_at, tally.last_completed or self._started_at)
        self.metrics.last_completed.labels(*self.labels()).set(last)

    def submitted(self, handle: JobHandle) -> ObservedJob:
        """``handle`` was just submitted: time its queue wait and watch its checkpoints. A submission
        whose record says attempt 2 or later is a restart (the driver submits every attempt here)."""
        now = time.time()
        self._remember_submit(handle.job_dir, now)
        record = read_submission(JobPaths(handle.job_dir))
        if record is not None and record.attempt > 1:
            self.metrics.restarts.labels(*self.labels()).inc()
        return ObservedJob(handle, self, submitted_at=now, seen_pending=True)

    def attached(self, handle: JobHandle) -> ObservedJob:
        """``handle`` was submitted earlier (maybe by another process): time it from its submission."""
        submitted_at = _submission_time(handle.job_dir)
        self._remember_submit(handle.job_dir, submitted_at)
        return ObservedJob(handle, self, submitted_at=submitted_at, seen_pending=False)

    def finished(self, job_dir: Path, state: str) -> None:
        """The trial whose job dir is ``job_dir`` reached its final ``state`` (COMPLETE/PRUNED/FAIL)."""
        self.progressed(job_dir, None)
        self.ranks_measured(job_dir, [])
        with self._lock:
            started = self._first_submit.pop(job_dir, None)
        if started is not None:
            duration = max(0.0, time.time() - started)
            self.metrics.trial_duration.labels(*self.labels(), state).observe(duration)

    def progressed(self, job_dir: Path, advanced_at: float | None) -> None:
        """The running job in ``job_dir`` last advanced at ``advanced_at``; None: it is not running
        (or sends no heartbeats), so it no longer counts."""
        gauge = self.metrics.last_progress
        with self._lock:
            if advanced_at is None:
                self._progress.pop(job_dir, None)
            else:
                self._progress[job_dir] = advanced_at
            if self._progress:
                gauge.labels(*self.labels()).set(min(self._progress.values()))
            else:
                gauge.remove(*self.labels())  # a step with nothing running is not stuck

    def ranks_measured(self, job_dir: Path, beats: list[RankProgress]) -> None:
        """Set the per-rank gauges of the job in ``job_dir`` from its ranks' heartbeats (the ranks
        that sent telemetry), and remove its series that no beat carries any more; no beats (the
        job is not running): remove them all."""
        trial = job_dir.name
        wanted: dict[tuple[str, tuple[str, ...]], float] = {}
        for beat in beats:
            measured = beat.telemetry
            if measured is None:
                continue
            rank_labels = (*self.labels(), trial, str(beat.rank))
            for gauge, value in (
                ("rank_step_time", measured.step_time_s),
                ("rank_samples", measured.samples_per_s),
                ("rank_tokens", measured.tokens_per_s),
                ("rank_peak_memory", measured.peak_memory_bytes),
                ("rank_cpu_busy", measured.cpu_busy),
            ):
                if value is not None:
                    wanted[(gauge, rank_labels)] = float(value)
        with self._lock:
            for gauge, gone in self._rank_series.pop(job_dir, set()) - wanted.keys():
                getattr(self.metrics, gauge).remove(*gone)
            for (gauge, kept), value in wanted.items():
                getattr(self.metrics, gauge).labels(*kept).set(value)
            if wanted:
                self._rank_series[job_dir] = set(wanted)

    def _remember_submit(self, job_dir: Path, submitted_at: float) -> None:
        with self._lock:
            self._first_submit.setdefault(job_dir, submitted_at)


class ObservedJob:
    """A ``JobHandle`` that reports what its polls see: the queue wait when the job is first seen
    running, the save time of each checkpoint that appeared since the last poll, and, while it runs,
    when its slowest rank last advanced and each rank's speed and memory.

    A re-attached job's queue wait counts only if it is seen pending first (one already running has
    waited for an unknown part of the time since its submission); only checkpoints saved after the
    submission count, so a re-attached orchestrator does not count old ones again.

    The tuner polls ``state`` from one thread; the lock keeps a concurrent caller (a cancel from the
    driver, a test) from double counting.
    """

    def __init__(
        self, handle: JobHandle, observer: TrialObserver, *, submitted_at: float, seen_pending: bool
    ) -> None:
        self.handle = handle
        self.job_id = handle.job_id
        self.job_dir = handle.job_dir
        self._observer = observer
        self._submitted_at = submitted_at
        self._seen_running = False
        self._seen_pending = seen_pending
        self._seen_checkpoints: set[str] = set()
        self._lock = threading.Lock()

    def state(self, *, fresh: bool = False) -> JobState:
        state = self.handle.state(fresh=fresh)
        with self._lock:
            self._observe_queue_wait(state)
            self._observe_new_checkpoints()
            self._observe_progress(state)
        return state

    def cancel(self, reason: CancelReason = "cancelled") -> None:
        self.handle.cancel(reason=reason)

    def logs(self, tail: int = 50) -> str:
        return self.handle.logs(tail)

    def idle(self, seconds: float) -> None:
        self.handle.idle(seconds)

    def describe(self) -> str:
        return self.handle.describe()

    def run_mark(self) -> str | None:
        return self.handle.run_mark()

    def _observe_queue_wait(self, state: JobState) -> None:
        if self._seen_running:
            return
        if state is JobState.PENDING:
            self._seen_pending = True
        elif state in (JobState.RUNNING, JobState.SUCCEEDED):
            self._seen_running = True
            if self._seen_pending:
                wait_s = max(0.0, time.time() - self._submitted_at)
                self._observer.metrics.queue_wait.labels(*self._observer.labels()).observe(wait_s)

    def _observe_new_checkpoints(self) -> None:
        histogram = self._observer.metrics.checkpoint_save.labels(*self._observer.labels())
        for folder in step_folders(JobPaths(self.job_dir).checkpoints):
            if folder.name in self._seen_checkpoints:
                continue
            info = saved_checkpoint(folder)
            if info is None:
                continue  # a save in progress, or a broken one: look again at the next poll
            self._seen_checkpoints.add(folder.name)
            if info.save_seconds is not None and info.time >= self._submitted_at:
                histogram.observe(info.save_seconds)

    def _observe_progress(self, state: JobState) -> None:
        """The oldest advance among the ranks still working (as the watchdog reads them), and every
        rank's telemetry; a queued or ended job, or one whose ranks have not beaten yet (starting
        up), has none."""
        beats = [] if state is not JobState.RUNNING else read_progress(JobPaths(self.job_dir).progress)
        advanced = [beat.advanced_at for beat in beats if not beat.finished]
        self._observer.progressed(self.job_dir, min(advanced) if advanced else None)
        self._observer.ranks_measured(self.job_dir, beats)


def _submission_time(job_dir: Path) -> float:
    """When the launcher wrote the job's ``submission.json``; now, when it cannot be read."""
    try:
        return JobPaths(job_dir).submission.stat().st_mtime
    except OSError:
        return time.time()


# ---------------------------------------------------------------------------------------------- exposure


@dataclass
class PipelineMetrics:
    """The metrics side of one pipeline run: its name for the labels, and the endpoint, if served.

    Owned by the ``PipelineRun`` that opened it; ``close`` is called once, when the run ends.
    """

    pipeline: str
    run_id: str
    host: str = ""
    linger_s: float = 0.0
    server: WSGIServer | None = None

    @property
    def url(self) -> str | None:
        """http://host:port/metrics while served, else None."""
        if self.server is None:
            return None
        return f"http://{self.host}:{self.server.server_port}/metrics"

    def close(self) -> None:
        """Keep serving ``linger_s`` more seconds (so a final scrape sees the final counts), then stop
        the endpoint."""
        if self.server is not None:
            if self.linger_s > 0:
                log.info("metrics: serving %s %.0f s more for a final scrape", self.url, self.linger_s)
                time.sleep(self.linger_s)
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def open_pipeline_metrics(settings: MetricsSpec | None, *, pipeline: str, run_id: str) -> PipelineMetrics:
    """When ``settings`` is given, serve ``/metrics`` on its host and port until ``close``.

    A port already in use is logged, not raised: losing the metrics must not fail a training run.
    """
    metrics = PipelineMetrics(pipeline, run_id)
    if settings is None:
        return metrics
    default_metrics()  # register the tunepod_* names, so a scrape before the first step sees them
    try:
        server, _ = start_http_server(settings.port, addr=settings.host, registry=REGISTRY)
    except OSError as exc:
        log.warning(
            "metrics: cannot serve on %s:%d (%s); the pipeline runs without its /metrics endpoint. "
            "Fix: set metrics.port to a free port in the spec",
            settings.host,
            settings.port,
            exc,
        )
        return metrics
    metrics.server, metrics.host, metrics.linger_s = server, settings.host, settings.linger_s
    log.info("metrics: serving %s", metrics.url)
    return metrics
