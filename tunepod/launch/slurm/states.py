"""What Slurm says about jobs, read into tunepod's terms (pure): the state table, ``SlurmStatus`` and
the parsers of ``sbatch``, ``squeue``, ``scontrol`` and ``sacct`` output.

The parsers are written against the output of Slurm 22.05 (the local test cluster's); every format
string they expect is stated next to them and used by ``commands.py``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tunepod.errors import JobError
from tunepod.launch.job_state import JobState, warn_unknown_state

logger = logging.getLogger(__name__)

SLURM_STATES: Mapping[str, JobState] = {
    # Waiting for resources or a start time; no process of the job runs.
    "PENDING": JobState.PENDING,
    # Nodes are allocated but still booting or being configured; the script has not started.
    "CONFIGURING": JobState.PENDING,
    # Being put back in the queue (a node failed, --requeue, scontrol requeue); it will run again.
    "REQUEUED": JobState.PENDING,
    # Requeued and held: it runs again only after `scontrol release`; the reason says why.
    "REQUEUE_HOLD": JobState.PENDING,
    # Requeued by a federation sibling; it waits in the queue again.
    "REQUEUE_FED": JobState.PENDING,
    # Held because its reservation was deleted; it waits for `scontrol release`.
    "RESV_DEL_HOLD": JobState.PENDING,
    # Ended with an exit code the site marks special (e.g. for a restart) and held for `scontrol release`:
    # Slurm has not finished with it, so neither do we; the caller's timeout bounds the wait.
    "SPECIAL_EXIT": JobState.PENDING,
    # Preempted. We always pass --requeue, so Slurm puts it back in the queue and it resumes from its
    # checkpoints. Caveat: on a partition with PreemptMode=CANCEL it never runs again; it then stays
    # PENDING until Slurm purges it (MinJobAge), and is FAILED after that, as an unknown job.
    "PREEMPTED": JobState.PENDING,
    # The allocation is changing size; the job's processes keep running.
    "RESIZING": JobState.RUNNING,
    # Suspended (SIGSTOP by the scheduler, e.g. gang scheduling): it holds its allocation and resumes.
    "SUSPENDED": JobState.RUNNING,
    # Stopped by a SIGSTOP sent to it; it keeps its allocation and continues on SIGCONT.
    "STOPPED": JobState.RUNNING,
    "RUNNING": JobState.RUNNING,
    # The script has ended but processes are still being cleaned up (or an epilog runs): not over yet,
    # so that cancel() returns only once nothing of the job is left.
    "COMPLETING": JobState.RUNNING,
    # Burst buffer stage-out after the script ended.
    "STAGE_OUT": JobState.RUNNING,
    # Slurm is delivering a signal to the job (e.g. --signal before its time limit).
    "SIGNALING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    # Withdrawn here because another cluster of the federation started it; tunepod does not follow a
    # job across clusters, so from here it is lost.
    "REVOKED": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
}


def map_slurm_state(slurm_state: str) -> JobState:
    """Slurm's state name (``CANCELLED by 1000`` and ``RUNNING+`` forms too) -> ``JobState``.

    An unknown name (a newer Slurm) is logged and read as RUNNING: the job is then followed until a
    known state (or the caller's timeout) ends it, rather than crashing the orchestrator.
    """
    name = slurm_state.strip().split(" ", 1)[0].rstrip("+").upper()
    mapped = SLURM_STATES.get(name)
    if mapped is None:
        warn_unknown_state("Slurm job", name, JobState.RUNNING)
        return JobState.RUNNING
    return mapped


@dataclass(frozen=True)
class SlurmStatus:
    """What Slurm says about one job: its own state name, the reason, and the exit code once it ended."""

    state: str
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    node_count: int | None = None
    """How many nodes it holds now (squeue's), None where not told: a job under ``--no-kill`` holds
    fewer than it asked for once it lost one."""
    batch_host: str = ""
    """The node its batch script runs on (squeue's), "" where not told."""
    nodelist: str = ""
    """Its nodes as a Slurm hostlist (``n[1-2]``), "" where not told."""
    start_time: str = ""
    """When its current run started (squeue's, for a running job), "" where not told: a job Slurm
    requeued starts anew when it runs again, so this tells its runs apart where no look saw it
    queued between them."""

    @property
    def job_state(self) -> JobState:
        return map_slurm_state(self.state)

    def describe(self, job_id: str) -> str:
        """One line for an error message: ``slurm job 12 FAILED (reason NonZeroExitCode, exit code 1)``."""
        details = [f"reason {self.reason}"] if self.reason and self.reason != "None" else []
        if self.signal:
            details.append(f"killed by signal {self.signal}")
        elif self.exit_code is not None:
            details.append(f"exit code {self.exit_code}")
        suffix = f" ({', '.join(details)})" if details else ""
        return f"slurm job {job_id} {self.state}{suffix}"


def purged_status(job_id: str) -> SlurmStatus:
    """The status of a job Slurm no longer knows (or never knew)."""
    return SlurmStatus(
        "FAILED",
        reason=f"slurm no longer knows job {job_id}: it ended more than MinJobAge ago and was purged "
        "(its outcome is lost), or the id is wrong; see the job's logs",
    )


@dataclass(frozen=True)
class ListedJob:
    """One job of a listing by name: what ``find`` needs to tell this attempt's job from another's."""

    job_id: str
    comment: str
    name: str


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """Slurm's ``EXIT:SIGNAL`` (``1:0``, ``0:9``) -> (exit code, signal)."""
    exit_text, _, signal_text = text.strip().partition(":")
    try:
        return int(exit_text), int(signal_text or 0)
    except ValueError:
        return None, None


def _fields(line: str, count: int) -> list[str]:
    """``line`` split on ``|`` into exactly ``count`` fields; the last keeps any further ``|``."""
    parts = line.split("|", count - 1)
    return parts + [""] * (count - len(parts))


SQUEUE_FIELDS = "%i|%T|%D|%B|%N|%S|%r"
"""squeue's job id, state, node count, batch host, node list, start time and reason (last: it may
hold spaces)."""


def parse_squeue(stdout: str) -> dict[str, SlurmStatus]:
    """Lines of ``squeue -h -o SQUEUE_FIELDS`` -> status per job id."""
    statuses: dict[str, SlurmStatus] = {}
    for line in stdout.splitlines():
        job_id, state, node_count, batch_host, nodelist, start_time, reason = _fields(line, 7)
        if job_id.strip() and state.strip():
            statuses[job_id.strip()] = SlurmStatus(
                state.strip(),
                reason=reason.strip(),
                node_count=int(node_count) if node_count.strip().isdigit() else None,
                batch_host=batch_host.strip() if batch_host.strip() != "n/a" else "",
                nodelist=nodelist.strip(),
                start_time=start_time.strip() if start_time.strip() not in ("N/A", "Unknown") else "",
            )
    return statuses


def parse_job_listing(stdout: str) -> list[ListedJob]:
    """Lines of ``squeue -h -o '%i|%k|%j'`` or ``sacct -n -P -o JobIDRaw,Comment,JobName`` -> jobs.

    The name comes last because it is the one field a user may fill with ``|``. Slurm prints
    ``(null)`` for a job without a comment; it is read as no comment.
    """
    listed: list[ListedJob] = []
    for line in stdout.splitlines():
        job_id, comment, name = _fields(line, 3)
        if job_id.strip():
            listed.append(ListedJob(job_id.strip(), "" if comment == "(null)" else comment, name))
    return listed


def parse_scontrol_job(stdout: str) -> SlurmStatus | None:
    """``scontrol show job -o <id>`` -> its status, or None when the output names no job state.

    Fields are read after ``UserId=``: the job name comes before it and may itself contain ``Key=``.
    """
    start = stdout.find(" UserId=")
    fields = stdout[start:] if start >= 0 else stdout

    def field(key: str) -> str | None:
        match = re.search(rf"(?:^|\s){key}=(\S*)", fields)
        return match.group(1) if match else None

    state = field("JobState")
    if not state:
        return None
    exit_code, signal = parse_exit_code(field("ExitCode") or "")
    return SlurmStatus(state, reason=field("Reason") or "", exit_code=exit_code, signal=signal)


def parse_sacct(stdout: str) -> SlurmStatus | None:
    """First line of ``sacct -n -P -X -o State,ExitCode,Reason`` -> status, or None when empty."""
    for line in stdout.splitlines():
        state, exit_text, reason = _fields(line, 3)
        if state.strip():
            exit_code, signal = parse_exit_code(exit_text)
            return SlurmStatus(state.strip(), reason=reason.strip(), exit_code=exit_code, signal=signal)
    return None


def parse_job_id(sbatch_stdout: str) -> str:
    """``sbatch --parsable`` prints ``<id>`` or ``<id>;<cluster>``; returns the id."""
    job_id = sbatch_stdout.strip().splitlines()[-1].split(";", 1)[0].strip() if sbatch_stdout.strip() else ""
    if not job_id.isdigit():
        raise JobError(f"sbatch --parsable printed {sbatch_stdout.strip()!r}, not a job id")
    return job_id
