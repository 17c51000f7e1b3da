"""The bookkeeping records a launcher keeps in a job dir: the submission record and the cancel marker.

Each record has one writer (the launcher template in ``tunepod.launch.base``) and one reader (the
functions here), so its shape is defined once and checked on every read.

The submission record is written AHEAD of the backend call that creates the job: first as an
*intent* (the deterministic name the job will be created under, the attempt number and a random
submission id that the job carries), then completed with the backend's job id once the backend has
accepted it. A crash, a timeout or a lost reply between the two leaves an intent; whoever reads it
next looks the job up by that name and submission id before creating anything, so a job dir never
gets a second live job.

The cancel marker records that tunepod decided to stop the job, and why (pruned, timed out, ...),
before the stop is sent: a later reader knows why the job ended, or that it still has to be stopped.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunepod import world
from tunepod.errors import JobError
from tunepod.launch.paths import JobPaths
from tunepod.runtime.files import write_bytes_atomic

PRIVATE_FILE_MODE = 0o600
"""Files that hold a job's environment (tracking credentials, user secrets): owner only."""
PRIVATE_DIR_MODE = 0o700

STOP_GRACE_DETAIL = "stop_grace_s"
"""The key of ``Submission.details`` that holds the job's ``resources.stop_grace_s``."""

CancelReason = str
"""Why tunepod stopped a job: one of the launch layer's own (``TIMED_OUT``, ``HUNG``, ``CANCELLED``),
or a word its owner chose (a search policy's: "pruned", "paused", ...), handed back to the owner as
the job's ``Outcome.STOPPED``."""
TIMED_OUT: CancelReason = "timed_out"
"""Past its time limit."""
HUNG: CancelReason = "hung"
"""Its ranks stopped beating or progressing."""
CANCELLED: CancelReason = "cancelled"
"""Anything else: a person, a flow cancelled."""
LAUNCH_REASONS = frozenset({TIMED_OUT, HUNG, CANCELLED})


def now_iso() -> str:
    """The current UTC time as the records write it."""
    return datetime.fromtimestamp(world.time(), UTC).isoformat(timespec="milliseconds")


def new_submission_id() -> str:
    """A random id for one submission; the job carries it (environment, comment, annotation)."""
    return world.token_hex(8)


class Submission(BaseModel):
    """``<job_dir>/submission.json``: which backend job this job dir's current attempt is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(description="Launcher kind that wrote the record.")
    name: str = Field(description="Name the backend creates the job under; stable per job and attempt.")
    attempt: int = Field(
        ge=1, description="1 for the first submission into the job dir, +1 per resubmission."
    )
    submission_id: str = Field(description="Random id of this attempt, carried by the job itself.")
    job_id: str | None = Field(None, description="The backend's id; None while only the intent is known.")
    details: dict[str, Any] = Field(
        default_factory=dict,
        description="Facts about the job: the backend's own, and its stop grace (recorded with the intent).",
    )
    intent_at: str
    submitted_at: str | None = None

    @property
    def is_intent(self) -> bool:
        """True when the backend's acceptance was never recorded (see the module docstring)."""
        return self.job_id is None

    @property
    def stop_grace_s(self) -> float | None:
        """How long a stop gives the job's processes to save and exit (its ``resources.stop_grace_s``);
        None when the job sets none."""
        grace = self.details.get(STOP_GRACE_DETAIL)
        return None if grace is None else float(grace)

    def accepted(self, job_id: str, details: dict[str, Any]) -> Submission:
        """This intent, completed with the backend's id and facts."""
        return self.model_copy(
            update={"job_id": job_id, "details": {**self.details, **details}, "submitted_at": now_iso()}
        )


def read_submission(paths: JobPaths) -> Submission | None:
    """The job dir's submission record; None when there is none. ``JobError`` naming the file and the
    fix when it cannot be read (written by another tool, or an older tunepod)."""
    try:
        raw = paths.submission.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return Submission.model_validate_json(raw)
    except ValidationError as exc:
        raise JobError(
            f"{paths.submission} is not a submission record this tunepod can read ({exc.error_count()} "
            f"problems, first: {exc.errors()[0]['msg']}); fix: if no job of {paths.job_dir} runs any more, "
            "move the job dir aside and run again"
        ) from exc


def write_submission(paths: JobPaths, record: Submission) -> None:
    """Replace the job dir's submission record atomically (owner-only: it names the job's submission id)."""
    write_private(paths.submission, record.model_dump_json(indent=2).encode())


class CancelMarker(BaseModel):
    """``<job_dir>/cancelled``: tunepod decided to stop job ``job_id``, for ``reason``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    reason: CancelReason
    at: str


def read_cancel_marker(paths: JobPaths) -> CancelMarker | None:
    """The cancel marker; None when there is none. A marker tunepod cannot parse (an older format)
    still means the job was cancelled, for an unknown job id."""
    try:
        raw = paths.cancelled.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return CancelMarker.model_validate_json(raw)
    except ValidationError:
        return CancelMarker(job_id="", reason="cancelled", at="")


def write_cancel_marker(paths: JobPaths, job_id: str, reason: CancelReason) -> None:
    marker = CancelMarker(job_id=job_id, reason=reason, at=now_iso())
    write_bytes_atomic(paths.cancelled, marker.model_dump_json().encode())


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` atomically, readable by its owner only (it may hold a job's secrets)."""
    write_bytes_atomic(path, data, mode=PRIVATE_FILE_MODE)


def make_job_dir(job_dir: Path, *, private: bool) -> None:
    """Create ``job_dir`` (and its parents): owner-only when ``private``, for backends whose jobs run
    as the user who submits them (local, Slurm); with the umask's mode otherwise, for containers that
    may write as another user (HyperPod EKS, SageMaker), where the private files inside still are 0600.

    An existing folder keeps its mode: an operator who opened it up for another user meant it.
    """
    if job_dir.is_dir():
        return
    job_dir.mkdir(parents=True, exist_ok=True)
    if private:
        job_dir.chmod(PRIVATE_DIR_MODE)
