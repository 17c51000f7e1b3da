"""A launcher of one stand-in job, the parts of ``Launcher`` a ``JobDriver`` uses: for the driver's
tests whose job behaves as no real backend can be made to on cue (``test_pending_job.py``,
``test_in_place_restart.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from tunepod.launch.base import JobSpec, Rendered

J = TypeVar("J")


class OneJobBackend(Generic[J]):
    """Each submission makes a new job with ``make(job_dir)``; attaching, and the job dir's record,
    give the newest."""

    private_job_dirs = False
    job_writes_job_dir = True

    def __init__(self, kind: str, make: Callable[[Path], J]) -> None:
        self.kind = kind
        self._make = make
        self.jobs: list[J] = []

    def submit(self, job: JobSpec) -> J:
        self.jobs.append(self._make(job.job_dir))
        return self.jobs[-1]

    def attach(self, job_id: str, job_dir: Path) -> J:
        return self.jobs[-1]

    def recorded(self, job_dir: Path) -> J | None:
        return self.jobs[-1] if self.jobs else None

    def render(self, job: JobSpec, attempt: int, variant: int = 0) -> Rendered:
        return Rendered(name=job.name, payload="")
