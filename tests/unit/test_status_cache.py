"""The launchers' status cache: one poll answers every followed job, an ended job is not asked about
again while the cache keeps it, and the cache keeps only the latest ended jobs, so its size does not
grow with the jobs a study has run. The backend here is the cache's poll hook answering from a table
of states (the launchers' own polls are tested against their engines elsewhere)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tunepod.launch.job_state import JobState
from tunepod.launch.status_cache import StatusCache, TrackedJob


@dataclass(frozen=True)
class Status:
    job_state: JobState


class Backend:
    """The poll hook: each job's state from ``states``; every poll's job ids, in order."""

    def __init__(self) -> None:
        self.states: dict[str, JobState] = {}
        self.polls: list[set[str]] = []

    def poll(self, jobs: Mapping[str, TrackedJob]) -> Mapping[str, Status]:
        self.polls.append(set(jobs))
        return {job_id: Status(self.states[job_id]) for job_id in jobs}


def tracked(job_id: str) -> TrackedJob:
    return TrackedJob(Path("/jobs") / job_id)


def test_jobs_in_flight_share_one_poll_and_an_ended_job_is_not_asked_again() -> None:
    backend = Backend()
    cache = StatusCache(backend.poll, max_age_s=60.0)
    backend.states |= {"a": JobState.RUNNING, "b": JobState.SUCCEEDED}
    for job_id in ("a", "b"):
        cache.track(job_id, tracked(job_id))
    assert cache.status("a", tracked("a")).job_state is JobState.RUNNING
    assert cache.status("b", tracked("b")).job_state is JobState.SUCCEEDED
    assert backend.polls == [{"a", "b"}]
    backend.states["a"] = JobState.FAILED
    assert cache.status("a", tracked("a"), max_age_s=0).job_state is JobState.FAILED
    assert backend.polls[1] == {"a"}, "the ended job b is pinned, never polled again"


def test_the_cache_keeps_only_the_latest_ended_jobs_and_follows_a_let_go_job_again() -> None:
    backend = Backend()
    cache = StatusCache(backend.poll, max_age_s=0.0, final_kept=3)
    for number in range(10):
        job_id = f"job-{number}"
        backend.states[job_id] = JobState.SUCCEEDED
        cache.track(job_id, tracked(job_id))
        assert cache.status(job_id, tracked(job_id)).job_state is JobState.SUCCEEDED
    assert len(cache) == 3, "ten jobs ended; the cache keeps the latest three"
    polls = len(backend.polls)
    assert cache.status("job-9", tracked("job-9")).job_state is JobState.SUCCEEDED
    assert len(backend.polls) == polls, "a kept job is answered from the cache"
    # A handle on a job the cache let go asks again: it is followed again and polled once.
    assert cache.status("job-0", tracked("job-0")).job_state is JobState.SUCCEEDED
    assert backend.polls[polls:] == [{"job-0"}]
    assert len(cache) == 3


def test_a_job_still_running_is_never_let_go_however_many_others_end() -> None:
    backend = Backend()
    cache = StatusCache(backend.poll, max_age_s=0.0, final_kept=2)
    backend.states["long"] = JobState.RUNNING
    cache.track("long", tracked("long"))
    for number in range(6):
        job_id = f"short-{number}"
        backend.states[job_id] = JobState.CANCELLED
        cache.track(job_id, tracked(job_id))
        cache.status(job_id, tracked(job_id))
    assert "long" in backend.polls[-1], "the running job is in every poll"
    assert len(cache) == 3, "the running job and the latest two that ended"
