"""``JobState``: the lifecycle every backend maps its own states onto."""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """The lifecycle every backend maps its own states onto."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
