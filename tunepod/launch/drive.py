"""Driving one job dir to its outcome: the one loop the tuner and the train/evaluate steps share.

The job dir is the truth, on every (re)start:

- a result file means the job completed: it is never submitted again;
- a cancel marker means tunepod stopped the job, and says why (pruned, paused, exploited, timed out): that is
  its outcome, and a stop that a crash interrupted is finished first; a paused job is started again
  (a new attempt resuming from its checkpoints) only when the driver is told to resume that attempt;
- the submission record names the job to re-attach to (an intent is resolved by name on the backend);
- only a job that is really over without a result is started again, as a new attempt that resumes
  from its checkpoints, and only while ``max_restarts`` allows;
- a running job past its run time is stopped as timed out, and one whose ranks stopped advancing is
  stopped as hung, then restarted like a failed job (``tunepod.launch.watchdog`` keeps both clocks).

A transient backend error is waited out (logged), never read as "the job is gone", and never cancels
anything. A stop that has not finished when the launcher's wait runs out (a node stuck in COMPLETING)
is sent again at the next poll, with a warning each time: the job has not ended, and is settled only
once it has. One driver per job dir: the driver holds the job dir's lease (``tunepod.launch.lease``)
while it drives, and acts on the job (submits, adopts, stops, restarts it, resets its clocks) only
inside the lease's fence, so a driver whose lease another took over acts no more (``LeaseLost``); a
driver that finds the lease held by another live driver follows the job dir read-only until that
driver lets go, then carries on from what the job dir says.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import TypeVar

from tunepod import world
from tunepod.errors import StopUnfinished, TransientError
from tunepod.launch.base import JobHandle, JobSpec, JobState, Launcher
from tunepod.launch.lease import Lease, LeaseLost, Leases
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import (
    HUNG,
    LAUNCH_REASONS,
    TIMED_OUT,
    CancelMarker,
    CancelReason,
    read_cancel_marker,
    read_submission,
)
from tunepod.launch.watchdog import Stall, Watchdog
from tunepod.runtime import Report, ReportTail, Result, read_result

logger = logging.getLogger(__name__)

# Called with the reports that appeared since the last call; returns why to stop the job (pruned,
# paused) or None to let it go on. Called with none, too, every TELEMETRY_NUDGE_S while none appear:
# a job that reports rarely still gets its ranks' telemetry (in their heartbeat files) mirrored by
# the handler's sync.
ReportHandler = Callable[[list[Report]], CancelReason | None]
# Called with each job handle the driver follows (True when it was just submitted); may wrap it.
JobObserver = Callable[[JobHandle, bool], JobHandle]

T = TypeVar("T")

LOG_TAIL_LINES = 20
LOG_SCAN_LINES = 400
# How often a transient outage is logged while it lasts.
_OUTAGE_LOG_S = 60.0
# How often the report handler is called without new reports (see ReportHandler).
TELEMETRY_NUDGE_S = 30.0
# torchrun's agent prints its own traceback (ending in ChildFailedError) after the worker's; the
# worker's traceback above it is what the user needs to see.
TORCHRUN_SUMMARY = re.compile(
    r"^.*torch/distributed/elastic/multiprocessing/api\.py.*failed \(exitcode", re.MULTILINE
)


class Outcome(StrEnum):
    COMPLETED = "COMPLETED"
    """A result file exists (or the job exited 0 without one: see ``DriveResult.result``)."""
    STOPPED = "STOPPED"
    """Stopped by its owner's decision (``DriveResult.reason``: a search policy's word), after its
    checkpoint; a stopped job may be resumed later (``DriveSettings.resume_attempt``)."""
    TIMED_OUT = "TIMED_OUT"
    FAILED = "FAILED"


@dataclass(frozen=True)
class DriveSettings:
    poll_s: float
    max_restarts: int = 0
    resume_attempt: int | None = None
    """The attempt whose job was stopped by its owner and is to be resumed: once it is found ended,
    stopped, a new attempt starts from its checkpoints. Any other stopped job settles as STOPPED."""
    kept_at_the_end: frozenset[CancelReason] = frozenset()
    """The owner's stops that its handler may decide on a job's last reports, fed as the job ended:
    the job then settles STOPPED for it, not restarted (an ASHA pause: the trial waits at its rung, to
    resume from its checkpoints). Any other stop so decided is left to the next attempt's reports."""


@dataclass(frozen=True)
class DriveResult:
    outcome: Outcome
    result: Result | None
    """The job's result file, when it wrote one."""
    handle: JobHandle | None
    message: str = ""
    """For FAILED and TIMED_OUT: a runbook (job id, state, log tail, where the logs are)."""
    reason: CancelReason | None = None
    """For STOPPED: why its owner stopped it."""


class JobDriver:
    """Drives one job dir; see the module docstring. One instance per job dir and call of ``run``."""

    def __init__(
        self,
        launcher: Launcher,
        job: JobSpec,
        settings: DriveSettings,
        *,
        what: str,
        on_reports: ReportHandler | None = None,
        observe: JobObserver | None = None,
        leases: Leases | None = None,
    ) -> None:
        self.launcher = launcher
        self.job = job
        self.settings = settings
        self.what = what
        self.paths = JobPaths(job.job_dir)
        self._on_reports = on_reports
        self._observe = observe or (lambda handle, _new: handle)
        self._leases = leases or Leases(private_job_dirs=launcher.private_job_dirs)
        self._reports = ReportTail(self.paths.metrics)
        # Without the job's heartbeats (SageMaker without a read-write FSx) nothing can tell a hang.
        limits = job.limits if launcher.job_writes_job_dir else job.limits.run_time_only()
        self._watchdog = Watchdog(self.paths, limits)
        self._outage_logged_at = -_OUTAGE_LOG_S
        self._nudged_at = world.monotonic()
        self._lease: Lease | None = None
        self._stall: Stall | None = None
        """Why this driver last stopped the job as hung (for the failure message)."""

    def run(self, lease: Lease | None = None) -> DriveResult:
        """Drive the job dir to an outcome, holding ``lease``. A lease given stays held: its caller
        releases it once it has recorded the outcome (a tuner tells Optuna first; released before, a
        second orchestrator saw the trial RUNNING with its lease free and drove it again). A lease
        taken here when none is given is released here."""
        if lease is not None:
            return self._drive(lease)
        lease = self._take_lease()
        try:
            return self._drive(lease)
        finally:
            lease.release()

    # ------------------------------------------------------------------------------------ the loop

    def _drive(self, lease: Lease) -> DriveResult:
        self._lease = lease
        handle = self._waiting(lambda: self._fenced(self._current_job))
        # A job this driver re-attached to may have run under an earlier driver: queued at the first
        # look, it was requeued (or never ran), and its next run is a new run, whatever heartbeats
        # the earlier run left.
        reattached = handle is not None
        if handle is None:
            result = read_result(self.paths.result)
            if result is not None:  # finished, and its record is gone: never run it again
                return DriveResult(Outcome.COMPLETED, result, None)
            handle = self._submit()
        stopping: CancelReason | None = self._marker_reason(handle)
        seen_running, run_mark = False, None
        while True:
            if lease.lost:
                raise LeaseLost(f"{self.what}: {self.paths.job_dir} is driven by another orchestrator now")
            state = self._state(handle)
            if state is not None and state.is_terminal:
                settled = self._settle(handle, state, self._stop_at_the_end(stopping))
                if settled is not None:
                    return settled
                # A restart: the new attempt resumes from the checkpoints, and the ended run's ranks,
                # should one beat on (on a node its scheduler gave up on), are not the new attempt's.
                self._fenced(partial(self._watchdog.new_run, handle.job_id))
                handle = self._submit()
                stopping, seen_running, run_mark, reattached = None, False, None, False
                continue
            if state is JobState.PENDING and (seen_running or reattached):
                self._queued_again(handle, seen_running=seen_running)
                run_mark = None  # the next run's mark is its own, not a restart that no look saw
            reattached = reattached and state is None
            if state is JobState.RUNNING:
                run_mark = self._run_restarted(handle, run_mark)
            seen_running = state is JobState.RUNNING or (seen_running and state is None)
            if stopping is None:
                stopping = self._feed_reports()
            if stopping is None and state is JobState.RUNNING:
                stopping = self._overdue(handle)
            if stopping is not None and state is not None:
                self._stop(handle, stopping)
                continue
            handle.idle(self.settings.poll_s)

    def _queued_again(self, handle: JobHandle, *, seen_running: bool) -> None:
        """The job is queued after a run: one this driver saw (a requeue, a restart), or one before a
        re-attaching driver's first look. Its next run is a new run: the heartbeats left by the run
        before, which no longer advance, never make the next one look hung."""
        if seen_running:
            logger.warning(
                "%s: job %s was requeued or is restarting; it resumes from its checkpoints",
                self.what,
                handle.job_id,
            )
        self._fenced(partial(self._watchdog.new_run, handle.job_id))

    def _run_restarted(self, handle: JobHandle, seen: str | None) -> str | None:
        """The running job's run mark; a mark other than the one seen last means the backend restarted
        the job in place between two looks (no look saw it between runs): the heartbeats heard before
        are the ended run's, and the new run gets its start-up time from now, not the dead run's last
        advance (``Watchdog.restarted_in_place``)."""
        mark = handle.run_mark()
        if mark is None:
            return seen
        if seen is not None and mark != seen:
            logger.warning(
                "%s: job %s was restarted in place; it resumes from its checkpoints", self.what, handle.job_id
            )
            self._fenced(partial(self._watchdog.restarted_in_place, handle.job_id))
        return mark

    def _stop_at_the_end(self, stopping: CancelReason | None) -> CancelReason | None:
        """The stop decided on for a job that ended: this driver's, else one its last reports decide
        that its end beat, where the owner keeps such a stop (``DriveSettings.kept_at_the_end``). A
        job that failed just as it reached a rung ASHA pauses it at then waits there, not restarted
        to train past it."""
        decided = self._feed_reports()
        return stopping or (decided if decided in self.settings.kept_at_the_end else None)

    def _settle(
        self, handle: JobHandle, state: JobState, stopping: CancelReason | None
    ) -> DriveResult | None:
        """The outcome of a job that ended; None when it is to be started again. ``stopping`` is a
        stop this driver decided on, which the job may have beaten to the end."""
        result = read_result(self.paths.result)
        if result is not None or self._ended_on_its_own(handle, state):
            # Finished, whatever stop anyone decided on meanwhile: the stop came too late (or never
            # got through; the cancel marker only says it was decided).
            return DriveResult(Outcome.COMPLETED, result, handle)
        marker = self._marker(handle)
        reason = marker.reason if marker is not None else stopping
        kind = self.launcher.kind
        if reason is not None and reason not in LAUNCH_REASONS:
            return (
                None if self._resuming(handle) else DriveResult(Outcome.STOPPED, None, handle, reason=reason)
            )
        if reason == HUNG:
            if self._may_restart(handle, "hung"):
                return None
            stall = self._stall
            hung = f"{self.what} hung: {stall.describe() if stall else 'it stopped progressing'}"
            return DriveResult(Outcome.FAILED, None, handle, failure_message(hung, handle, state, kind=kind))
        if reason == TIMED_OUT:
            limit = self.job.resources.timeout_min
            what = f"{self.what} (timed out after {limit} min)" if limit else f"{self.what} (timed out)"
            return DriveResult(
                Outcome.TIMED_OUT, None, handle, failure_message(what, handle, state, kind=kind)
            )
        # Someone's cancel on the backend (CANCELLED) was meant; any other stop the script saved on was not.
        if reason is None and state is not JobState.CANCELLED:
            asked_at = self._watchdog.stop_requested_at(handle.job_id)
            if asked_at is not None:
                return self._settle_stopped(handle, state, asked_at)
        if state is JobState.SUCCEEDED:
            return DriveResult(Outcome.COMPLETED, None, handle)
        if state is JobState.FAILED and reason is None and self._may_restart(handle, "failed"):
            return None
        return DriveResult(Outcome.FAILED, None, handle, failure_message(self.what, handle, state, kind=kind))

    def _ended_on_its_own(self, handle: JobHandle, state: JobState) -> bool:
        """Exited 0 and not on a stop signal its script listened for (a preemption saves and exits 0)."""
        return state is JobState.SUCCEEDED and self._watchdog.stop_requested_at(handle.job_id) is None

    def _settle_stopped(self, handle: JobHandle, state: JobState, asked_at: float) -> DriveResult | None:
        """A job whose script saved and exited on a stop signal tunepod did not send: the warning
        before its time limit (timed out), or a preemption, a node drain (restarted: None)."""
        kind = self.launcher.kind
        if self._watchdog.stopped_by_time_limit(
            handle.job_id, asked_at, self.job.resources.time_limit_warning_s
        ):
            limit = self.job.resources.timeout_min
            what = f"{self.what} (timed out after {limit} min; it saved at the warning)"
            message = failure_message(what, handle, state, kind=kind)
            return DriveResult(Outcome.TIMED_OUT, None, handle, message)
        if self._may_restart(handle, "was stopped by a signal (preempted)"):
            return None
        what = f"{self.what} (preempted, and max_restarts is spent)"
        return DriveResult(Outcome.FAILED, None, handle, failure_message(what, handle, state, kind=kind))

    def _may_restart(self, handle: JobHandle, why: str) -> bool:
        record = read_submission(self.paths)
        restarts = (record.attempt - 1) if record is not None else 0
        if restarts >= self.settings.max_restarts:
            return False
        logger.warning(
            "%s: job %s %s; restart %d of %d, resuming from its checkpoints",
            self.what,
            handle.job_id,
            why,
            restarts + 1,
            self.settings.max_restarts,
        )
        return True

    def _overdue(self, handle: JobHandle) -> CancelReason | None:
        """A reason to stop the running job: its run time is up, or it stopped progressing. Fenced:
        the first look at a job running records when it started."""
        return self._fenced(lambda: self._overdue_now(handle))

    def _overdue_now(self, handle: JobHandle) -> CancelReason | None:
        now = world.time()
        if self._watchdog.timed_out(handle.job_id, now):
            return TIMED_OUT if self._still_running(handle) else None
        stall = self._watchdog.stall(handle.job_id, now)
        if stall is None or not self._still_running(handle):
            return None
        self._stall = stall
        logger.warning("%s: job %s is hung, stopping it: %s", self.what, handle.job_id, stall.describe())
        return HUNG

    def _still_running(self, handle: JobHandle) -> bool:
        """Whether the backend, asked now, still runs the job. A stop for its run time or a hang ends
        the trial's attempt, so it is decided on a fresh answer, not on a state read before the
        orchestrator was paused (a process stopped, a host frozen): a job that failed meanwhile is
        then settled as the failure it was, restarted, not ended as timed out. No answer: not now."""
        try:
            return handle.state(fresh=True) is JobState.RUNNING
        except TransientError:
            return False

    # ------------------------------------------------------------------------------------ helpers

    def _take_lease(self) -> Lease:
        return acquire_or_follow(
            self._leases, self.paths.job_dir, what=self.what, poll_s=self.settings.poll_s
        )

    def _current_job(self) -> JobHandle | None:
        handle = self.launcher.recorded(self.paths.job_dir)
        return None if handle is None else self._observe(handle, False)

    def _submit(self) -> JobHandle:
        handle = self._waiting(lambda: self._fenced(lambda: self.launcher.submit(self.job)))
        assert handle is not None
        return self._observe(handle, True)

    def _fenced(self, action: Callable[[], T]) -> T:
        """``action()`` inside the lease's fence: ``LeaseLost``, and nothing done, once another driver
        took the job dir over."""
        assert self._lease is not None, "a driver acts only while it drives"
        with self._lease.fenced():
            return action()

    def _state(self, handle: JobHandle) -> JobState | None:
        """The job's state; None while the backend does not answer (logged once a minute)."""
        try:
            return handle.state()
        except TransientError as exc:
            self._log_outage(handle, exc)
            world.sleep(self.settings.poll_s)
            return None

    def _stop(self, handle: JobHandle, reason: CancelReason) -> None:
        """Stop the job for ``reason``. A stop the backend has not finished (or did not answer) is not
        the job's outcome: the marker is written, so the next round sends the stop again, and the job
        is settled, once, only when the backend says it has ended."""
        try:
            self._fenced(lambda: handle.cancel(reason=reason))
        except TransientError as exc:
            self._log_outage(handle, exc)
            world.sleep(self.settings.poll_s)
        except StopUnfinished as exc:
            logger.warning(
                "%s: job %s has not ended yet after tunepod stopped it (%s): %s; stopping it again",
                self.what,
                exc.job_id,
                reason,
                exc.state,
            )
            handle.idle(self.settings.poll_s)

    def _waiting(self, call: Callable[[], JobHandle | None]) -> JobHandle | None:
        """``call()``, retried for as long as it fails transiently (never read as "no job")."""
        while True:
            try:
                return call()
            except TransientError as exc:
                self._log_outage(None, exc)
                world.sleep(max(self.settings.poll_s, 1.0))

    def _feed_reports(self) -> CancelReason | None:
        """Hand new reports to the handler (none, every ``TELEMETRY_NUDGE_S`` without any); the reason
        it gives to stop the job, if it does."""
        reports = self._reports.read_new()
        now = world.monotonic()
        if not reports and now - self._nudged_at < TELEMETRY_NUDGE_S:
            return None
        self._nudged_at = now
        return None if self._on_reports is None else self._on_reports(reports)

    def _resuming(self, handle: JobHandle) -> bool:
        """The stopped job ``handle`` is the attempt this driver was told to resume."""
        record = read_submission(self.paths)
        resume = self.settings.resume_attempt
        if resume is None or record is None or record.attempt != resume:
            return False
        logger.info("%s: resuming from its checkpoints (job %s was stopped)", self.what, handle.job_id)
        return True

    def _marker(self, handle: JobHandle) -> CancelMarker | None:
        marker = read_cancel_marker(self.paths)
        return marker if marker is not None and marker.job_id in (handle.job_id, "") else None

    def _marker_reason(self, handle: JobHandle) -> CancelReason | None:
        """A stop decided before a restart of the orchestrator is carried out, not forgotten."""
        marker = self._marker(handle)
        return None if marker is None else marker.reason

    def _log_outage(self, handle: JobHandle | None, exc: Exception) -> None:
        now = world.monotonic()
        if now - self._outage_logged_at < _OUTAGE_LOG_S:
            return
        self._outage_logged_at = now
        job = f"job {handle.job_id}" if handle is not None else str(self.paths.job_dir)
        logger.warning(
            "%s: the %s backend did not answer about %s (%s); waiting",
            self.what,
            self.launcher.kind,
            job,
            exc,
        )


def acquire_or_follow(leases: Leases, job_dir: Path, *, what: str, poll_s: float) -> Lease:
    """The lease of ``job_dir``; while another live driver holds it, wait (saying once who drives it)."""
    announced = False
    while (lease := leases.acquire(job_dir)) is None:
        holder = leases.holder(job_dir)
        if not announced and holder is not None:
            logger.warning("%s: %s is driven by %s; following it", what, job_dir, holder.describe())
            announced = True
        world.sleep(max(poll_s, 0.2))
    return lease


def failure_message(what: str, handle: JobHandle, state: JobState, *, kind: str) -> str:
    """A runbook for a job that ended badly: which job, what state, the log tail, where the logs are."""
    paths = JobPaths(handle.job_dir)
    try:
        log = handle.logs(LOG_SCAN_LINES)
        described = handle.describe()
    except TransientError as exc:
        log, described = "", f"(the backend did not answer: {exc})"
    tail = worker_error(log, LOG_TAIL_LINES) or "(no output)"
    message = (
        f"{what} ({kind} job {handle.job_id}) ended {state}: {described}.\n"
        f"Last {LOG_TAIL_LINES} lines of its log:\n{tail}"
    )
    # Backends whose output is elsewhere (pod logs, CloudWatch) say where in their logs() text.
    if paths.stderr.exists() or paths.stdout.exists():
        message += f"\nFull logs: {paths.stderr} and {paths.stdout}"
    return message


def worker_error(log: str, lines: int) -> str:
    """The last ``lines`` lines of ``log`` before torchrun's own failure summary (the worker's
    traceback), or of the whole log when there is no such summary."""
    starts = [match.start() for match in TORCHRUN_SUMMARY.finditer(log)]
    relevant = log[: starts[-1]] if starts and log[: starts[-1]].strip() else log
    return "\n".join(relevant.rstrip().splitlines()[-lines:])
