"""The Slurm client commands the launcher runs, and how each one's failures are read.

Every command goes through a ``CommandRunner`` (here, or on the head node over ssh). A failure a
retry can fix arrives as ``TransientError`` and is passed on as is; the few "failures" that are
answers (asked about a job id Slurm has forgotten, no accounting on this cluster) become empty
results here, so the launcher never has to look at stderr.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

from tunepod.errors import TransientError
from tunepod.launch.runner import CommandFailed, CommandRunner
from tunepod.launch.slurm.nodes import SINFO_NODES_FORMAT, NodeListing, parse_sinfo_nodes
from tunepod.launch.slurm.states import (
    SQUEUE_FIELDS,
    ListedJob,
    SlurmStatus,
    parse_job_id,
    parse_job_listing,
    parse_sacct,
    parse_scontrol_job,
    parse_squeue,
)

logger = logging.getLogger(__name__)

_UNKNOWN_JOB = r"Invalid job id"
_ALREADY_ENDED = r"already completing or completed|Invalid job id"
# sacct -S is read in the head node's local time, which tunepod does not know: starting a day early
# covers every time zone, and the comment, not the time, picks the job.
_ACCOUNTING_MARGIN = timedelta(days=1)


def _is_answer(exc: CommandFailed, pattern: str) -> bool:
    """Whether a failed command's stderr is a definite answer (``pattern``) rather than an outage."""
    return not isinstance(exc, TransientError) and re.search(pattern, exc.stderr) is not None


def _name_filter(name: str) -> list[str]:
    # squeue and sacct read --name as a comma-separated list, so a name holding a comma cannot be
    # asked for: list the user's own jobs instead (the caller matches the name exactly either way).
    return ["--me"] if "," in name else [f"--name={name}"]


class SlurmCommands:
    """sbatch, squeue, scontrol, sacct, sinfo and scancel through ``runner``.

    Thread safety: stateless; safe from several threads as far as ``runner`` is (every runner is).
    Every method raises ``TransientError`` when Slurm (or ssh) did not answer, and ``CommandFailed``
    for any other failure of the command.
    """

    def __init__(self, runner: CommandRunner) -> None:
        self.runner = runner

    def sbatch(self, script: str, script_path: Path | None) -> str:
        """Queue ``script`` (from ``script_path`` when given, else on stdin); returns the job id."""
        if script_path is None:
            done = self.runner.run(["sbatch", "--parsable"], input=script)
        else:
            done = self.runner.run(["sbatch", "--parsable", str(script_path)])
        return parse_job_id(done.stdout)

    def queued(self, job_ids: Sequence[str]) -> dict[str, SlurmStatus]:
        """The status of each of ``job_ids`` still in the queue, in one squeue call."""
        if not job_ids:
            return {}
        argv = ["squeue", "-h", "-o", SQUEUE_FIELDS, "-j", ",".join(job_ids)]
        try:
            return parse_squeue(self.runner.run(argv).stdout)
        except CommandFailed as exc:
            # squeue asked about a single id it no longer knows fails instead of printing nothing.
            if _is_answer(exc, _UNKNOWN_JOB):
                return {}
            raise

    def requeue(self, job_id: str, nodes: int) -> None:
        """Put a running job back in the queue, asking for ``nodes`` nodes again: Slurm keeps the
        count a job shrank to when it lost nodes under ``--no-kill``, and would start it on those."""
        self.runner.run(["scontrol", "requeue", job_id])
        self.runner.run(["scontrol", "update", f"JobId={job_id}", f"NumNodes={nodes}"])

    def remembered(self, job_id: str) -> SlurmStatus | None:
        """The status of a job that left the queue, with its exit code, while Slurm keeps it in memory
        (MinJobAge); None once it is purged."""
        try:
            return parse_scontrol_job(self.runner.run(["scontrol", "show", "job", "-o", job_id]).stdout)
        except CommandFailed as exc:
            if _is_answer(exc, _UNKNOWN_JOB):
                return None
            raise

    def accounted(self, job_id: str) -> SlurmStatus | None:
        """The status the accounting database keeps of a job; None without accounting (no slurmdbd)."""
        argv = ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Reason"]
        try:
            return parse_sacct(self.runner.run(argv).stdout)
        except CommandFailed as exc:
            if isinstance(exc, TransientError):
                raise
            logger.debug("sacct could not tell the state of job %s: %s", job_id, exc)
            return None

    def named(self, name: str) -> list[ListedJob]:
        """Every job named ``name`` that the controller still knows: queued, running, or ended less
        than MinJobAge ago (``squeue --states=all`` lists those too)."""
        argv = ["squeue", "-h", "--states=all", *_name_filter(name), "-o", "%i|%k|%j"]
        return [job for job in parse_job_listing(self.runner.run(argv).stdout) if job.name == name]

    def accounted_named(self, name: str, since: datetime) -> list[ListedJob]:
        """Every job named ``name`` submitted from about ``since`` on that the accounting database
        keeps; empty without accounting. Comments are there only with AccountingStoreFlags=job_comment."""
        start = (since - _ACCOUNTING_MARGIN).strftime("%Y-%m-%dT%H:%M:%S")
        argv = ["sacct", "-n", "-P", "-X", *_name_filter(name), "-S", start, "-o", "JobIDRaw,Comment,JobName"]
        try:
            listed = parse_job_listing(self.runner.run(argv).stdout)
        except CommandFailed as exc:
            if isinstance(exc, TransientError):
                raise
            logger.debug("sacct could not list the jobs named %r: %s", name, exc)
            return []
        return [job for job in listed if job.name == name]

    def nodes(self) -> list[NodeListing]:
        """Every node of every partition, with its state (one ``sinfo`` call)."""
        return parse_sinfo_nodes(self.runner.run(["sinfo", "-h", "-N", "-o", SINFO_NODES_FORMAT]).stdout)

    def scancel(self, job_id: str, *, signal: str | None = None) -> None:
        """Ask Slurm to end ``job_id``; with ``signal``, only send it that signal, to the tasks of its
        steps (not to the batch script, which would end the job and have its steps killed). A job that
        has already ended (or was purged) is no error."""
        try:
            self.runner.run(["scancel", *([f"--signal={signal}"] if signal else []), job_id])
        except CommandFailed as exc:
            # It ended between our look and the scancel: the caller's wait sees the real outcome.
            if not _is_answer(exc, _ALREADY_ENDED):
                raise
