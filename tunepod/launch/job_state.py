"""``JobState``: the lifecycle every backend maps its own states onto."""

from __future__ import annotations

import functools
import logging
from enum import StrEnum

logger = logging.getLogger(__name__)


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


@functools.cache
def warn_unknown_state(backend: str, name: str, treated_as: JobState) -> None:
    """Log once per process that ``backend`` reported a state ``name`` tunepod does not know.

    Cached: a job polled every second would otherwise repeat the warning every second. An unknown
    state (a newer backend) is mapped to ``treated_as`` until a known one follows.
    """
    logger.warning("unknown %s state %r, treated as %s until it changes", backend, name, treated_as.value)
