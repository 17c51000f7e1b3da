"""The exit-code file: how a job tells its job dir how its command ended, for any reader, any time.

A job's wrapper (the local launcher's shell, the Slurm batch script's ``EXIT`` trap) writes
``<exit code> <submission id> [<backend job id>]`` to ``JobPaths.exit_code`` (temp file, then rename)
once its command has exited. So the outcome can be read long after the backend forgot the job (Slurm
purges an ended job after ``MinJobAge``; without accounting nothing else remembers it), by an
orchestrator that restarted and was never the parent of the job; the submission id says which
attempt it belongs to, and the job id (Slurm's) which job, when only the submission's intent was
recorded before the job ran and was forgotten.
"""

from __future__ import annotations

from typing import NamedTuple

from tunepod.launch.paths import JobPaths


class ExitRecord(NamedTuple):
    code: int
    submission_id: str | None
    job_id: str | None = None


def parse_exit_file(text: str) -> ExitRecord | None:
    """``"<code> <submission id> [<job id>]"`` (or an older bare ``"<code>"``) -> its fields; None if
    unreadable."""
    parts = text.split()
    try:
        code = int(parts[0])
    except (IndexError, ValueError):
        return None
    return ExitRecord(code, *parts[1:3])


def read_exit_code(paths: JobPaths, submission_id: str) -> int | None:
    """The exit code the wrapper of ``submission_id`` recorded; None if it has not (or another did)."""
    try:
        parsed = parse_exit_file(paths.exit_code.read_text())
    except FileNotFoundError:
        return None
    if parsed is None or parsed[1] not in (None, submission_id):
        return None
    return parsed[0]


def recorded_job_id(paths: JobPaths, submission_id: str) -> str | None:
    """The backend job id the wrapper of ``submission_id`` recorded with its exit; None if none did."""
    try:
        parsed = parse_exit_file(paths.exit_code.read_text())
    except FileNotFoundError:
        return None
    return parsed.job_id if parsed is not None and parsed.submission_id == submission_id else None


def temp_exit_file(paths: JobPaths) -> str:
    """Where a wrapper writes the exit code before renaming it into place."""
    return str(paths.exit_code.with_name(paths.exit_code.name + ".tmp"))
