"""The exceptions tunepod raises, split by what the caller should do about them.

``TransientError`` is the only family a retry can fix (a flaky filesystem, a locked SQLite file, a
scheduler that did not answer). Everything else is a statement about the user's input or a job's
outcome, and retrying it would only repeat the failure.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass


class TunepodError(Exception):
    """Base class of every error tunepod raises on purpose."""


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a pipeline spec: where it is, what is wrong, and how to fix it."""

    path: str
    message: str
    fix: str = ""
    line: int | None = None

    def render(self, source: str) -> str:
        where = f"{source}:{self.line}" if self.line is not None else source
        text = f"{where}: {self.path or '<root>'}: {self.message}"
        return f"{text}\n    fix: {self.fix}" if self.fix else text


class SpecError(TunepodError):
    """A spec that must not run. Carries every issue found, not just the first."""

    def __init__(self, source: str, issues: list[SpecIssue]) -> None:
        self.source = source
        self.issues = issues
        count = f"{len(issues)} error{'s' if len(issues) != 1 else ''}"
        body = "\n".join(issue.render(source) for issue in issues)
        super().__init__(f"invalid pipeline spec {source} ({count}):\n{body}")


class DiskFullError(TunepodError):
    """A write failed because its filesystem is full (ENOSPC) or the user's quota is spent (EDQUOT).

    Not transient: retrying repeats the failure until someone frees space. The message names the
    path, the free space on its mount and what to change; the write it interrupted left nothing half
    written (see ``tunepod.runtime.files.disk_full_explained``).
    """


class StoreError(TunepodError):
    """A study storage or tracking store that could not be opened. The message names the store with
    its secrets hidden (``tunepod.stores.redacted``), the driver's reason (likewise) and the fix."""


class JobError(TunepodError):
    """A training or evaluation job ended badly; the message is a runbook (ids, state, log tail)."""


class StopUnfinished(JobError):
    """A job tunepod stopped is still not over when the wait for its end runs out (a node stuck in
    COMPLETING, a process stuck in the kernel, a finalizer that hangs). Not the job's outcome: the stop
    was sent and the cancel marker stays, so calling ``cancel`` again sends it again and waits anew.
    ``job_id`` is the backend's id and ``state`` one line on how the backend sees the job now."""

    def __init__(self, message: str, *, job_id: str, state: str) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.state = state


class TransientError(TunepodError):
    """A failure worth retrying as is: the same call may succeed a moment later."""


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the failed step could help. Used as Prefect's ``retry_condition_fn``."""
    if isinstance(exc, TransientError | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return True
    # SQLAlchemy wraps sqlite's "database is locked" (MLflow, Optuna RDB storage); match it by text
    # so this module does not import SQLAlchemy.
    return type(exc).__name__ == "OperationalError" and "database is locked" in str(exc)
