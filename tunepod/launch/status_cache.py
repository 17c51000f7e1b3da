"""One generic, batched cache of what a backend says about the jobs a launcher follows.

Every backend answers many jobs' states with one call (one ``squeue`` for every Slurm job, one LIST
per namespace for HyperPod EKS) or at least one call per period per job (DescribeTrainingJob), so K
trials polling twice a second cost one backend call per period, not 2K per second.

Contract:

- ``poll(jobs)`` is the backend's hook: given the open jobs (id -> its job dir and record) it
  returns a status for EVERY one of them (a job the backend no longer knows gets the backend's own
  "gone" status, never a missing key). It raises ``TransientError`` when the backend did not answer.
- A status whose ``job_state`` is terminal is pinned: that job is never asked about again.
- A refresh that fails transiently serves each job's last known status for up to ``stale_limit_s``
  (logged); only after that does the ``TransientError`` reach the caller, who waits it out. A
  transient error never becomes a state.

Thread safety: every method may be called from several threads; one lock serializes refreshes, so
concurrent callers share one poll.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from tunepod import world
from tunepod.errors import JobError, TransientError
from tunepod.launch.job_state import JobState
from tunepod.launch.submission import Submission

logger = logging.getLogger(__name__)


class NativeStatus(Protocol):
    """What a backend's own status type must offer: its mapping onto tunepod's states."""

    @property
    def job_state(self) -> JobState: ...


@dataclass(frozen=True)
class TrackedJob:
    """What the cache knows of a followed job: where its files are, and its submission record."""

    job_dir: Path
    record: Submission | None = None


S = TypeVar("S", bound=NativeStatus)
Poll = Callable[[Mapping[str, TrackedJob]], Mapping[str, S]]


class StatusCache(Generic[S]):
    """The backend's view of every followed job, refreshed at most once per ``max_age_s``."""

    def __init__(self, poll: Poll[S], *, max_age_s: float, stale_limit_s: float = 300.0) -> None:
        self._poll = poll
        self.max_age_s = max_age_s
        self.stale_limit_s = stale_limit_s
        self._lock = world.lock()
        self._tracked: dict[str, TrackedJob] = {}
        self._live: dict[str, S] = {}
        self._final: dict[str, S] = {}
        self._fetched_at = -math.inf

    def track(self, job_id: str, job: TrackedJob) -> None:
        """Include ``job_id`` in every refresh until it ends (a known record is never forgotten)."""
        with self._lock:
            known = self._tracked.get(job_id)
            if known is None or job.record is not None:
                self._tracked[job_id] = job

    def status(self, job_id: str, *, max_age_s: float | None = None) -> S:
        """The status of ``job_id``, at most ``max_age_s`` (default: the cache's) seconds old."""
        limit = self.max_age_s if max_age_s is None else max_age_s
        with self._lock:
            if job_id not in self._tracked:
                raise JobError(f"job {job_id} is not followed by this launcher; attach to it first")
            if job_id in self._final:
                return self._final[job_id]
            if job_id in self._live and world.monotonic() - self._fetched_at < limit:
                return self._live[job_id]
            try:
                self._refresh()
            except TransientError as exc:
                return self._stale_or_raise(job_id, exc)
            found = self._final.get(job_id) or self._live.get(job_id)
            if found is None:
                raise JobError(f"the backend answered no status for job {job_id} (a launcher bug)")
            return found

    def _refresh(self) -> None:
        open_jobs = {job_id: rec for job_id, rec in self._tracked.items() if job_id not in self._final}
        polled = self._poll(open_jobs)
        live: dict[str, S] = {}
        for job_id in open_jobs:
            status = polled.get(job_id)
            if status is None:
                continue
            if status.job_state.is_terminal:
                self._final[job_id] = status
            else:
                live[job_id] = status
        self._live = live
        self._fetched_at = world.monotonic()

    def _stale_or_raise(self, job_id: str, exc: TransientError) -> S:
        last = self._live.get(job_id)
        if last is None or world.monotonic() - self._fetched_at > self.stale_limit_s:
            raise exc
        logger.warning("state refresh failed, using the last known state of job %s: %s", job_id, exc)
        return last
