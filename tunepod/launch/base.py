"""The launcher contract, and the template every backend fills in (modelled on submitit's Executor).

A job is a command, never a pickled function: clusters do not share the orchestrator's Python. The
orchestrator hands the job everything through environment variables (see ``tunepod.runtime``) and
learns its outcome from the files the job writes under ``job_dir`` (see ``JobPaths``).

Bookkeeping is written ONCE, here, in ``LauncherBase``:

- the submission record (``tunepod.launch.submission``), written ahead of the backend call: an intent
  with the deterministic name, a submission id and the job's stop grace, then the backend's job id;
- idempotent submission: after any error while sending, and whenever an intent without a job id is
  read back, the job is looked up on the backend by that name and submission id before anything is
  created again, so a job dir never gets two live jobs; a submit that finds its intent's job that way
  returns it (the attempt was sent: its caller follows it, whatever its state);
- refuse-if-running: a job dir whose recorded job has not ended takes no new submission;
- the cancel marker, written (with the reason) before the stop is sent;
- warn-once on settings a backend ignores;
- one batched status cache (``tunepod.launch.status_cache``) for every job the launcher follows.

A backend supplies the hooks: ``render`` (pure, golden-tested), ``send``, ``find``, ``poll``
(batched), ``stop``, ``read_logs`` and ``describe_status``; see each one's docstring.
"""

from __future__ import annotations

import logging
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from tunepod import world
from tunepod.errors import JobError, StopUnfinished, TransientError
from tunepod.launch.job_state import JobState
from tunepod.launch.paths import JobPaths
from tunepod.launch.status_cache import NativeStatus, StatusCache, TrackedJob
from tunepod.launch.submission import (
    STOP_GRACE_DETAIL,
    CancelMarker,
    CancelReason,
    Submission,
    make_job_dir,
    new_submission_id,
    now_iso,
    read_cancel_marker,
    read_submission,
    write_cancel_marker,
    write_private,
    write_submission,
)
from tunepod.launch.watchdog import Limits
from tunepod.spec.resources import Resources

logger = logging.getLogger(__name__)

SUBMISSION_ID_ENV = "TUNEPOD_SUBMISSION_ID"
"""Every process of a job inherits this: the submission id of its attempt (see ``Submission``)."""

__all__ = [
    "SUBMISSION_ID_ENV",
    "Accepted",
    "Job",
    "JobHandle",
    "JobSpec",
    "JobState",
    "Launcher",
    "LauncherBase",
    "NameTaken",
    "Rendered",
    "Resources",
    "wait",
]


# What torchrun --standalone exports to its only worker: a job of one process on one node starts the
# interpreter directly with these (local and Slurm launchers), saving torchrun's seconds of start-up.
# MASTER_PORT=0: a one-process job that still calls init_process_group binds a free port (world size 1:
# no peer has to find it).
SINGLE_PROCESS_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_RANK": "0",
    "ROLE_WORLD_SIZE": "1",
    "ROLE_NAME": "default",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "0",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
}


@dataclass(frozen=True)
class JobSpec:
    """One job to run: a Python entrypoint under torchrun, its arguments and environment."""

    name: str
    entrypoint: Path
    job_dir: Path
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    limits: Limits = field(default_factory=Limits)
    """When the job counts as timed out or hung: the driver's watchdog reads it, and a backend with
    its own hang detection (the HyperPod training operator) renders its rules from it."""

    @property
    def paths(self) -> JobPaths:
        return JobPaths(self.job_dir)

    def with_env(self, extra: Mapping[str, str]) -> JobSpec:
        return replace(self, env={**self.env, **extra})


@runtime_checkable
class JobHandle(Protocol):
    """A submitted job, shaped like a future. Safe to query from several threads."""

    job_id: str
    job_dir: Path

    def state(self, *, fresh: bool = False) -> JobState:
        """The job's current state; never blocks for long (``fresh``: asked of the backend now, not
        from the launcher's last poll). ``TransientError`` when the backend has not answered for a
        while: wait and ask again, it never means the job is gone."""
        ...

    def cancel(self, reason: CancelReason = "cancelled") -> None:
        """Stop the job and everything it started. Idempotent; returns once the job has ended.
        ``StopUnfinished`` when it has not ended within the launcher's wait: call again to retry."""
        ...

    def logs(self, tail: int = 50) -> str:
        """The last ``tail`` lines of the job's stderr (stdout where stderr is empty)."""
        ...

    def describe(self) -> str:
        """One line on how the backend saw the job end (exit code, scheduler state and reason)."""
        ...

    def run_mark(self) -> str | None:
        """What tells the backend's current run of the running job from the one before: it changes
        when the backend restarts the job in place (a Kubernetes operator restarting its pods), where
        no look may have seen it between runs; None where the backend does not tell, or between runs."""
        ...

    def idle(self, seconds: float) -> None:
        """Wait ``seconds`` between two polls, or less: a backend that can tell its job ended returns
        then, so that a finished job's slot is freed at once rather than at the next poll."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts jobs on one backend and finds them again after the orchestrator restarts."""

    @property
    def kind(self) -> str:
        """The spec's ``launcher.kind`` of this backend."""
        ...

    @property
    def private_job_dirs(self) -> bool:
        """Whether job dirs are created owner-only (jobs run as the submitting user)."""
        ...

    @property
    def job_writes_job_dir(self) -> bool:
        """Whether what a job writes (reports, heartbeats, results) lands in the job dir this
        machine reads; False when it goes where only the backend keeps it."""
        ...

    def submit(self, job: JobSpec) -> JobHandle:
        """Start ``job``; returns as soon as the backend has accepted it."""
        ...

    def attach(self, job_id: str, job_dir: Path) -> JobHandle:
        """A handle on a job submitted earlier, possibly by another process."""
        ...

    def recorded(self, job_dir: Path) -> JobHandle | None:
        """The job the job dir's submission record names (an intent resolved by name on the backend);
        None when no job was ever created there."""
        ...

    def render(self, job: JobSpec, attempt: int, variant: int = 0) -> Rendered:
        """What ``submit`` sends for ``attempt`` of ``job`` (its env holding ``SUBMISSION_ID_ENV``),
        sending nothing and touching no backend: ``tunepod render`` shows it."""
        ...


def wait(handle: JobHandle, poll_s: float = 0.5, timeout_s: float | None = None) -> JobState:
    """Block until ``handle`` reaches a terminal state (or ``timeout_s`` passes) and return it."""
    deadline = None if timeout_s is None else world.monotonic() + timeout_s
    while not (state := handle.state()).is_terminal:
        if deadline is not None and world.monotonic() > deadline:
            return state
        world.sleep(poll_s)
    return state


# ------------------------------------------------------------------------------------------ template


@dataclass(frozen=True)
class Rendered:
    """What a backend renders for one attempt of a job (pure, so golden-testable)."""

    name: str
    """The name the backend creates the job under: how ``find`` looks it up after a lost reply."""
    payload: Any
    """What ``send`` needs: the argv, the batch script, the request, the manifest."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Files kept in the job dir for people to read (the batch script, the request); written
    owner-only before sending, because they hold the job's environment."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """Facts ``find`` needs to look the job up later (a namespace, a resource kind); recorded with
    the intent."""


@dataclass(frozen=True)
class Accepted:
    """The backend took the job: its id, and facts the backend wants in the submission record."""

    job_id: str
    details: Mapping[str, Any] = field(default_factory=dict)


class NameTaken(JobError):
    """The name ``render`` chose is held by a job that is not this attempt's (a backend whose names are
    never freed); the template renders the next variant of the name."""


S = TypeVar("S", bound=NativeStatus)

_NAME_VARIANTS = 5


def _intent_was_sent(previous: Submission | None) -> bool:
    """Whether a job that ``_resolve`` found for the job dir's ``previous`` record is that record's own
    unfinished attempt (an intent: its job was created, its id never recorded). Refusing it as a running
    job would fail the caller's retry of a submit that only lost its answer; starting a new attempt
    beside it, once it ended, would run the attempt twice."""
    return previous is not None and previous.is_intent


def _intent_details(job: JobSpec, rendered: Rendered) -> dict[str, Any]:
    """What an intent records besides its name: the backend's facts for ``find``, and the job's stop
    grace. The grace is on disk before the backend hears of the job, and every later record of the
    attempt is this intent completed (by ``send``, or by ``find`` after a lost reply or a crash), so
    whichever way a launcher comes to hold the job, its stop reads the grace the job asked for."""
    grace = job.resources.stop_grace_s
    return {**rendered.details, **({} if grace is None else {STOP_GRACE_DETAIL: grace})}


class LauncherBase(ABC, Generic[S]):
    """The bookkeeping every backend shares (see the module docstring); a backend subclasses it.

    Thread safety: ``submit``, ``attach`` and ``recorded`` may be called from several threads for
    different job dirs (one job dir is driven by one thread at a time: see ``tunepod.launch.lease``).
    """

    kind: ClassVar[str]
    private_job_dirs: ClassVar[bool] = True
    """Create job dirs owner-only (jobs run as the submitting user); False for container backends."""
    job_writes_job_dir: bool = True
    stop_hint: ClassVar[str] = "cancel it"

    def __init__(
        self,
        *,
        poll_cache_s: float,
        cancel_timeout_s: float,
        cancel_poll_s: float,
        stale_limit_s: float = 300.0,
    ) -> None:
        self.cancel_timeout_s = cancel_timeout_s
        self.cancel_poll_s = cancel_poll_s
        self.cache: StatusCache[S] = StatusCache(
            self.poll, max_age_s=poll_cache_s, stale_limit_s=stale_limit_s
        )
        self._warned: set[str] = set()
        self._warn_lock = world.lock()

    # ------------------------------------------------------------------------------------ hooks

    @abstractmethod
    def render(self, job: JobSpec, attempt: int, variant: int = 0) -> Rendered:
        """Pure: what to send for ``attempt`` of ``job`` (its env holds ``SUBMISSION_ID_ENV``). Raises
        ``TunepodError`` for input the backend cannot express, before anything is written.
        ``variant`` > 0 asks for another name after ``NameTaken``."""

    @abstractmethod
    def send(self, job: JobSpec, rendered: Rendered, intent: Submission) -> Accepted:
        """Create the job on the backend. ``TransientError`` when the outcome is unknown (the job may
        exist); ``NameTaken`` when the name belongs to another submission."""

    @abstractmethod
    def find(self, intent: Submission, job_dir: Path) -> Accepted | None:
        """The job created for ``intent`` (its name AND its submission id), or None when there is none.
        ``TransientError`` when the backend cannot tell now."""

    @abstractmethod
    def poll(self, jobs: Mapping[str, TrackedJob]) -> Mapping[str, S]:
        """A status for every job in ``jobs`` (see ``StatusCache``), in as few calls as possible."""

    @abstractmethod
    def stop(self, job: Job[S]) -> None:
        """Ask the backend to end ``job`` (the template then waits until its state is terminal). A
        backend that waits for the end itself raises ``StopUnfinished`` when that wait runs out."""

    @abstractmethod
    def read_logs(self, job: Job[S], tail: int) -> str:
        """The last ``tail`` lines of the job's output, or a line saying where they are."""

    def stop_command(self, job_id: str, record: Submission | None) -> str:
        """How a person stops the job by hand, for error messages; default: ``stop_hint``."""
        return self.stop_hint.format(job_id=job_id)

    def run_mark(self, status: S) -> str | None:
        """``JobHandle.run_mark`` from the backend's status; default: None (a backend that never
        restarts a job in place, or one whose restarts show as a requeue: PENDING between runs)."""
        return None

    def describe_status(self, job: Job[S], status: S) -> str:
        """One line on the job's state for an error message; default: the status's own ``describe``."""
        describe = getattr(status, "describe", None)
        return str(describe(job.job_id)) if callable(describe) else f"{self.kind} job {job.job_id}"

    def ignored_settings(self, job: JobSpec) -> Mapping[str, str]:
        """Settings of ``job`` or of the launcher this backend cannot honour, keyed by field."""
        return {}

    def prepare(self, job: JobSpec, previous: Submission | None) -> None:
        """Called before a new attempt is recorded: clear what an ended earlier attempt left on the
        backend (a name the new job needs). Default: nothing."""

    def stale_outcome_files(self, paths: JobPaths) -> list[Path]:
        """Files an earlier attempt left that must not describe the new one (besides the cancel marker)."""
        return []

    def check_job_id(self, job_id: str) -> None:
        """Raise ``JobError`` when ``job_id`` is not one of this backend's ids."""

    def make_job(self, job_id: str, job_dir: Path, record: Submission | None) -> Job[S]:
        """The handle type of this backend (a subclass of ``Job`` may add backend-only methods)."""
        return Job(self, job_id, job_dir, record)

    # ------------------------------------------------------------------------------------ template

    def submit(self, job: JobSpec) -> Job[S]:
        """Start a new attempt of ``job`` in its job dir; returns once the backend has accepted it.

        Refused (``JobError``) when the job dir's recorded job has not ended. An intent left by a crash
        whose job never came to exist is sent again under the same name and submission id; one whose
        job exists is that attempt, sent already (a submit that failed after the backend took it, its
        reply lost and the look-up failing too): its job is returned, running or ended.
        """
        self._warn_ignored(job)
        paths = job.paths
        previous = read_submission(paths)
        current = self._resolve(previous, paths) if previous is not None else None
        if current is not None and _intent_was_sent(previous):
            return current
        if current is not None and not current.status(max_age_s=0).job_state.is_terminal:
            raise JobError(self._refusal(current))
        unsent = previous if previous is not None and previous.is_intent and current is None else None
        attempt = unsent.attempt if unsent else (previous.attempt + 1 if previous else 1)
        submission_id = unsent.submission_id if unsent else new_submission_id()
        job = job.with_env({SUBMISSION_ID_ENV: submission_id})
        rendered = self.render(job, attempt)  # refuses bad input before anything is written
        make_job_dir(paths.job_dir, private=self.private_job_dirs)
        self.prepare(job, previous)
        intent = Submission(
            backend=self.kind,
            name=rendered.name,
            attempt=attempt,
            submission_id=submission_id,
            details=_intent_details(job, rendered),
            intent_at=unsent.intent_at if unsent else now_iso(),
        )
        # The new attempt goes on record before its predecessor's outcome files go: a crash in between
        # must not leave the old job's record without the cancel marker that tells why it ended.
        write_submission(paths, intent)
        for stale in (paths.cancelled, paths.running, *self.stale_outcome_files(paths)):
            stale.unlink(missing_ok=True)
        shutil.rmtree(paths.progress, ignore_errors=True)  # the earlier attempt's heartbeats
        accepted, intent = self._send_recorded(job, rendered, intent)
        record = intent.accepted(accepted.job_id, dict(accepted.details))
        # Should this write fail, the intent stays, and find() recovers the job from it.
        write_submission(paths, record)
        return self._track(accepted.job_id, paths.job_dir, record)

    def attach(self, job_id: str, job_dir: Path) -> Job[S]:
        """A handle on a job submitted earlier, by this process or another (no backend call here)."""
        self.check_job_id(job_id)
        paths = JobPaths(job_dir)
        record = read_submission(paths)
        if record is not None and record.job_id is not None and record.job_id != job_id:
            raise JobError(
                f"cannot attach to {self.kind} job {job_id}: {paths.submission} names job {record.job_id} "
                f"(the job dir was reused by a later submission); attach to {record.job_id} instead"
            )
        return self._track(job_id, job_dir, record if record is not None and record.job_id else None)

    def recorded(self, job_dir: Path) -> Job[S] | None:
        """The job the job dir's record names; an intent is resolved on the backend by name (and the
        record completed). None when no job was ever created there. ``TransientError`` when the
        backend cannot tell now."""
        paths = JobPaths(job_dir)
        record = read_submission(paths)
        return None if record is None else self._resolve(record, paths)

    # ------------------------------------------------------------------------------------ internals

    def _resolve(self, record: Submission, paths: JobPaths) -> Job[S] | None:
        if record.backend != self.kind:
            raise JobError(
                f"{paths.job_dir} was submitted by the {record.backend} launcher, and the spec now names "
                f"{self.kind}; fix: finish (or cancel) that job with the {record.backend} launcher, or move "
                "the job dir aside"
            )
        if record.job_id is not None:
            return self._track(record.job_id, paths.job_dir, record)
        found = self.find(record, paths.job_dir)
        if found is None:
            return None
        logger.warning(
            "%s: found job %s of an unrecorded submission (%s) and adopted it",
            paths.job_dir,
            found.job_id,
            record.name,
        )
        completed = record.accepted(found.job_id, dict(found.details))
        write_submission(paths, completed)
        return self._track(found.job_id, paths.job_dir, completed)

    def _send_recorded(
        self, job: JobSpec, rendered: Rendered, intent: Submission
    ) -> tuple[Accepted, Submission]:
        """Record ``intent``, write the rendered files, send; on an unknown outcome, find before failing."""
        paths = job.paths
        for variant in range(1, _NAME_VARIANTS + 1):
            write_submission(paths, intent)
            for name, text in rendered.files.items():
                write_private(paths.job_dir / name, text.encode())
            try:
                return self.send(job, rendered, intent), intent
            except NameTaken as exc:
                logger.warning("%s: %s; trying another name", paths.job_dir, exc)
                rendered = self.render(job, intent.attempt, variant)
                intent = intent.model_copy(
                    update={"name": rendered.name, "details": _intent_details(job, rendered)}
                )
            except TransientError:
                # The backend may have created the job before the error reached us: look before failing.
                found = self.find(intent, paths.job_dir)
                if found is None:
                    raise
                logger.warning(
                    "%s: sending failed, but job %s exists; adopted it", paths.job_dir, found.job_id
                )
                return found, intent
        raise JobError(f"{_NAME_VARIANTS} names for {job.name} (attempt {intent.attempt}) are all taken")

    def _track(self, job_id: str, job_dir: Path, record: Submission | None) -> Job[S]:
        job = self.make_job(job_id, job_dir, record)
        self.cache.track(job_id, job.tracked)
        return job

    def _refusal(self, current: Job[S]) -> str:
        return (
            f"job dir {current.job_dir} belongs to {current.describe()}, which has not ended; "
            f"{self.stop_command(current.job_id, current.record)} or wait for it before submitting again "
            "into the same job dir"
        )

    def _warn_ignored(self, job: JobSpec) -> None:
        for key, message in self.ignored_settings(job).items():
            with self._warn_lock:
                if key in self._warned:
                    continue
                self._warned.add(key)
            logger.warning("%s launcher: %s", self.kind, message)


class Job(Generic[S]):
    """A submitted job of a ``LauncherBase``, followed through its launcher's status cache.

    Thread safety: every method may be called from several threads; concurrent ``cancel`` calls are
    serialized and all return once the job has ended.
    """

    def __init__(
        self, launcher: LauncherBase[S], job_id: str, job_dir: Path, record: Submission | None
    ) -> None:
        self.launcher = launcher
        self.job_id = job_id
        self.job_dir = job_dir
        self.record = record
        self.tracked = TrackedJob(job_dir, record)
        """What the launcher's cache follows it by."""
        self.paths = JobPaths(job_dir)
        self._cancel_lock = world.lock()
        self._outcome: JobState | None = None

    def status(self, *, max_age_s: float | None = None) -> S:
        """The backend's own view of the job, from the launcher's cache."""
        return self.launcher.cache.status(self.job_id, self.tracked, max_age_s=max_age_s)

    def state(self, *, fresh: bool = False) -> JobState:
        """The mapped state; a job that failed (or vanished) after tunepod cancelled it is CANCELLED."""
        if self._outcome is not None:
            return self._outcome
        state = self.status(max_age_s=0 if fresh else None).job_state
        if state is JobState.FAILED and self.cancel_marker() is not None:
            state = JobState.CANCELLED
        if state.is_terminal:
            # Kept: a later submission into the job dir removes the cancel marker this read depends on.
            self._outcome = state
        return state

    def cancel_marker(self) -> CancelMarker | None:
        """Why tunepod stopped this job, when it did."""
        marker = read_cancel_marker(self.paths)
        return marker if marker is not None and marker.job_id in (self.job_id, "") else None

    def cancel(self, reason: CancelReason = "cancelled") -> None:
        """Mark the job cancelled (with ``reason``), stop it, and wait until the backend says it ended.

        Idempotent. The marker is written first, even for a job that has already ended: it records the
        decision (a PBT exploit, a prune), which an orchestrator restarted after a crash must carry out
        as this one would have, not read the ended job as a failure to restart. A job that exited 0
        keeps its outcome (the driver reads a result or a clean exit before the marker).
        ``StopUnfinished`` when it is still not over after the launcher's ``cancel_timeout_s``,
        ``TransientError`` when the backend did not answer: either way the marker stays, and calling
        again sends the stop again and waits anew.
        """
        with self._cancel_lock:
            if self.cancel_marker() is None:
                write_cancel_marker(self.paths, self.job_id, reason)
            if self.status(max_age_s=0).job_state.is_terminal:
                return
            self.launcher.stop(self)
            self._wait_until_ended()

    def logs(self, tail: int = 50) -> str:
        return self.launcher.read_logs(self, tail) if tail > 0 else ""

    def describe(self) -> str:
        return self.launcher.describe_status(self, self.status())

    def run_mark(self) -> str | None:
        return self.launcher.run_mark(self.status())

    def idle(self, seconds: float) -> None:
        world.sleep(seconds)  # a backend known only through its polls: nothing to wait on between them

    def _wait_until_ended(self) -> None:
        deadline = world.monotonic() + self.launcher.cancel_timeout_s
        # Asked fresh each time: a long poll_cache_s must not slow a cancel down.
        while not (status := self.status(max_age_s=self.launcher.cancel_poll_s)).job_state.is_terminal:
            if world.monotonic() > deadline:
                state = self.launcher.describe_status(self, status)
                raise StopUnfinished(
                    f"{state} {self.launcher.cancel_timeout_s:g}s after tunepod stopped it; "
                    f"{self.launcher.stop_command(self.job_id, self.record)} by hand and check its nodes; "
                    f"job dir: {self.job_dir}",
                    job_id=self.job_id,
                    state=state,
                )
            world.sleep(self.launcher.cancel_poll_s)
