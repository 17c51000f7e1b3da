"""One generic, batched cache of what a backend says about the jobs a launcher follows.

Every backend answers many jobs' states with one call (one ``squeue`` for every Slurm job, one LIST
per namespace for HyperPod EKS) or at least one call per period per job (DescribeTrainingJob), so K
trials polling twice a second cost one backend call per period, not 2K per second.

Contract:

- ``poll(jobs)`` is the backend's hook: given the open jobs (id -> its job dir and record) it
  returns a status for EVERY one of them (a job the backend no longer knows gets the backend's own
  "gone" status, never a missing key). It raises ``TransientError`` when the backend did not answer.
- A status whose ``job_state`` is terminal is pinned: that job is never asked about again while the
  cache keeps it. It keeps the latest ``final_kept`` ended jobs, so its size does not grow with the
  number of jobs a study has run; a handle that asks about a job let go since is followed again (one
  more poll, which answers the job's end from the backend or the job dir's records).
- A refresh that fails transiently serves each job's last known status for up to ``stale_limit_s``
  (logged); only after that does the ``TransientError`` reach the caller, who waits it out. A
  transient error never becomes a state.

Thread safety: every method may be called from several threads; one lock serializes refreshes, so
concurrent callers share one poll.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from tunepod import world
from tunepod.errors import JobError, TransientError
from tunepod.launch.job_state import JobState
from tunepod.launch.submission import Submission

logger = logging.getLogger(__name__)

FINAL_KEPT = 1024
"""Ended jobs whose status the cache keeps: far more than a launcher has in flight, so a driver that
reads its job's end twice finds it here, and few enough that a study of any size costs the same."""


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

    def __init__(
        self, poll: Poll[S], *, max_age_s: float, stale_limit_s: float = 300.0, final_kept: int = FINAL_KEPT
    ) -> None:
        self._poll = poll
        self.max_age_s = max_age_s
        self.stale_limit_s = stale_limit_s
        self.final_kept = final_kept
        self._lock = world.lock()
        self._tracked: dict[str, TrackedJob] = {}
        self._live: dict[str, S] = {}
        self._final: OrderedDict[str, S] = OrderedDict()  # oldest first
        self._fetched_at = -math.inf

    def __len__(self) -> int:
        """Jobs followed or kept: those not ended, and the latest ``final_kept`` that ended."""
        with self._lock:
            return len(self._tracked)

    def track(self, job_id: str, job: TrackedJob) -> None:
        """Include ``job_id`` in every refresh until it ends (a known record is never forgotten)."""
        with self._lock:
            self._track(job_id, job)

    def _track(self, job_id: str, job: TrackedJob) -> None:
        known = self._tracked.get(job_id)
        if known is None or job.record is not None:
            self._tracked[job_id] = job

    def status(self, job_id: str, job: TrackedJob, *, max_age_s: float | None = None) -> S:
        """The status of ``job_id`` (``job``: where it is, to follow it again if the cache let it go), at
        most ``max_age_s`` (default: the cache's) seconds old."""
        limit = self.max_age_s if max_age_s is None else max_age_s
        with self._lock:
            if job_id not in self._tracked:
                self._track(job_id, job)
            if job_id in self._final:
                self._final.move_to_end(job_id)
                return self._final[job_id]
            if job_id in self._live and world.monotonic() - self._fetched_at < limit:
                return self._live[job_id]
            try:
                polled = self._refresh()
            except TransientError as exc:
                return self._stale_or_raise(job_id, exc)
            found = polled.get(job_id)
            if found is None:
                raise JobError(f"the backend answered no status for job {job_id} (a launcher bug)")
            return found

    def _refresh(self) -> Mapping[str, S]:
        open_jobs = {job_id: rec for job_id, rec in self._tracked.items() if job_id not in self._final}
        polled = self._poll(open_jobs)
        live: dict[str, S] = {}
        for job_id in open_jobs:
            status = polled.get(job_id)
            if status is None:
                continue
            if status.job_state.is_terminal:
                self._pin(job_id, status)
            else:
                live[job_id] = status
        self._live = live
        self._fetched_at = world.monotonic()
        return polled

    def _pin(self, job_id: str, status: S) -> None:
        self._final[job_id] = status
        while len(self._final) > self.final_kept:
            ended, _ = self._final.popitem(last=False)
            del self._tracked[ended]

    def _stale_or_raise(self, job_id: str, exc: TransientError) -> S:
        last = self._live.get(job_id)
        if last is None or world.monotonic() - self._fetched_at > self.stale_limit_s:
            raise exc
        logger.warning("state refresh failed, using the last known state of job %s: %s", job_id, exc)
        return last
