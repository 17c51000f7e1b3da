"""Run jobs as sbatch jobs on a Slurm cluster (SageMaker HyperPod's Slurm orchestrator included).

Render, then execute: ``render_sbatch`` is a pure function from a ``JobSpec`` to the batch script
(golden-tested); ``SlurmLauncher.submit`` writes it to ``<job_dir>/job.sbatch`` and runs
``sbatch --parsable`` through a ``CommandRunner`` (here, or on the head node over ssh).

The script runs one task per node, and that task is ``torchrun`` with ``procs_per_node`` workers and
a c10d rendezvous on the first node of the allocation. Jobs are submitted with ``--requeue`` and
``--open-mode=append``: a requeued (or HyperPod auto-resumed) job starts again in the same job dir,
appends to the same logs and resumes from its own checkpoints.

State: a launcher follows all its jobs with ONE cache, refreshed at most once per
``spec.poll_cache_s`` by a single ``squeue`` call for every job it tracks (plus one
``scontrol show job`` per job when it leaves the queue, for its final state and exit code), so K
trials polling every half second cost one squeue call per period, not K.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import shlex
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tunepod.errors import JobError, TransientError, TunepodError
from tunepod.launch.base import JobSpec, JobState, Resources
from tunepod.launch.paths import JobPaths, tail_lines
from tunepod.launch.runner import CommandFailed, CommandRunner, LocalRunner, SshRunner
from tunepod.runtime.files import write_bytes_atomic
from tunepod.spec.models import SlurmLauncherSpec

logger = logging.getLogger(__name__)

HYPERPOD_MARKER = Path("/opt/sagemaker_cluster")
"""Present on the nodes of a SageMaker HyperPod cluster; its srun then understands --auto-resume."""
SCRIPT_NAME = "job.sbatch"
RDZV_BASE_PORT = 20000
RDZV_PORT_RANGE = 20000
_CANCEL_POLL_S = 0.2

# ------------------------------------------------------------------------------------------ states

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
        _warn_unknown_state(name)
        return JobState.RUNNING
    return mapped


@functools.cache
def _warn_unknown_state(name: str) -> None:
    # Cached: a job polled every second would otherwise repeat the warning every second.
    logger.warning("unknown Slurm job state %r, treated as RUNNING until it changes", name)


@dataclass(frozen=True)
class SlurmStatus:
    """What Slurm says about one job: its own state name, the reason, and the exit code once it ended."""

    state: str
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None

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


def parse_squeue(stdout: str) -> dict[str, SlurmStatus]:
    """Lines of ``squeue -h -o '%i|%T|%r'`` -> status per job id (the reason may hold spaces)."""
    statuses: dict[str, SlurmStatus] = {}
    for line in stdout.splitlines():
        job_id, state, reason = _fields(line, 3)
        if job_id.strip() and state.strip():
            statuses[job_id.strip()] = SlurmStatus(state.strip(), reason=reason.strip())
    return statuses


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


# ------------------------------------------------------------------------------------------ rendering


def detect_hyperpod(spec: SlurmLauncherSpec) -> bool:
    """``spec.hyperpod`` when set, else whether this machine is a HyperPod node."""
    return spec.hyperpod if spec.hyperpod is not None else HYPERPOD_MARKER.exists()


@dataclass(frozen=True)
class SlurmResources:
    """``Resources`` in Slurm's terms."""

    nodes: int
    procs_per_node: int
    gpus_per_node: int
    time_limit_min: float | None


def slurm_resources(resources: Resources, spec: SlurmLauncherSpec) -> SlurmResources:
    """Map the generic resources; ``instance_type`` has no Slurm meaning (see ``ignored_resources``)."""
    return SlurmResources(
        nodes=resources.num_nodes,
        procs_per_node=resources.procs_per_node,
        gpus_per_node=resources.gpus_per_node,
        time_limit_min=resources.timeout_min if resources.timeout_min is not None else spec.time_limit_min,
    )


def ignored_resources(resources: Resources) -> dict[str, str]:
    """What Slurm cannot honour in ``resources``, keyed by field."""
    if resources.instance_type is None:
        return {}
    return {
        "instance_type": f"resources.instance_type={resources.instance_type!r} ignored: Slurm picks nodes "
        "by partition; set the launcher's partition instead"
    }


def format_time_limit(minutes: float) -> str:
    """``--time`` value: ``[D-]HH:MM:00``, rounded up to whole minutes (Slurm's resolution)."""
    total = max(1, math.ceil(minutes))
    days, rest = divmod(total, 24 * 60)
    hours, mins = divmod(rest, 60)
    clock = f"{hours:02d}:{mins:02d}:00"
    return f"{days}-{clock}" if days else clock


def format_mem(mem_gb: float) -> str:
    """``--mem`` value: whole gigabytes as ``NG``, anything else rounded up to megabytes."""
    return f"{int(mem_gb)}G" if float(mem_gb).is_integer() else f"{math.ceil(mem_gb * 1024)}M"


def sbatch_value(field: str, value: str) -> str:
    """``value`` as one argument of an ``#SBATCH`` line.

    sbatch reads these lines itself, not the shell: it groups characters in double quotes and takes
    the character after a backslash literally, so a value is double-quoted with ``\\`` and ``"``
    escaped. A newline cannot be written at all, so it is refused, naming ``field``.
    """
    if "\n" in value or "\r" in value:
        raise TunepodError(f"{field} {value!r} contains a line break, which an #SBATCH line cannot hold")
    if re.fullmatch(r"[A-Za-z0-9_./:=@+,-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_path(field: str, path: Path) -> str:
    """A path for ``--output``/``--error``, where sbatch expands ``%j``-style patterns: ``%`` is escaped."""
    return sbatch_value(field, str(path).replace("%", "%%"))


def sbatch_directives(job: JobSpec, spec: SlurmLauncherSpec) -> list[str]:
    """The ``#SBATCH`` options for ``job`` (without the ``#SBATCH`` prefix)."""
    res = slurm_resources(job.resources, spec)
    paths = JobPaths(job.job_dir)
    options = [
        f"--job-name={sbatch_value('job name', job.name)}",
        f"--nodes={res.nodes}",
        "--ntasks-per-node=1",
    ]
    if spec.cpus_per_node is not None:
        options.append(f"--cpus-per-task={spec.cpus_per_node}")
    if res.gpus_per_node > 0:
        options.append(f"--gpus-per-node={res.gpus_per_node}")
    if spec.mem_gb is not None:
        options.append(f"--mem={format_mem(spec.mem_gb)}")
    if res.time_limit_min is not None:
        options.append(f"--time={format_time_limit(res.time_limit_min)}")
    for flag, value in (("partition", spec.partition), ("account", spec.account), ("qos", spec.qos)):
        if value is not None:
            options.append(f"--{flag}={sbatch_value(flag, value)}")
    if spec.exclusive:
        options.append("--exclusive")
    options += [
        "--requeue",
        "--open-mode=append",
        f"--output={sbatch_path('job dir', paths.stdout)}",
        f"--error={sbatch_path('job dir', paths.stderr)}",
    ]
    return options


def job_environment(job: JobSpec, spec: SlurmLauncherSpec) -> dict[str, str]:
    """The variables the script exports: the launcher's ``env``, then the job's (which wins)."""
    env = {**spec.env, **job.env}
    for name in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise TunepodError(f"environment variable name {name!r} is not a valid shell name")
    return env


def torchrun_command(job: JobSpec, spec: SlurmLauncherSpec, *, hyperpod: bool) -> str:
    """The ``srun ... torchrun`` command (continued over lines): one torchrun per node, rendezvous on
    the first node."""
    res = slurm_resources(job.resources, spec)
    srun = ["srun", "--auto-resume=1"] if hyperpod else ["srun"]
    if spec.cpus_per_node is not None:
        # Slurm 22.05's srun no longer inherits --cpus-per-task from the batch job: without this the
        # torchrun task, and every worker it starts, would be bound to a single CPU.
        srun.append(f"--cpus-per-task={spec.cpus_per_node}")
    lines = [
        " ".join(srun),
        f"{shlex.quote(spec.python)} -m torch.distributed.run",
        f'--nnodes "$SLURM_NNODES" --nproc-per-node {res.procs_per_node}',
        '--rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:$rdzv_port"',
        shlex.join([str(job.entrypoint), *job.args]),
    ]
    return " \\\n  ".join(lines)


def render_sbatch(job: JobSpec, spec: SlurmLauncherSpec, *, hyperpod: bool) -> str:
    """The batch script that runs ``job`` (pure). Raises ``TunepodError`` for what it cannot express."""
    header = ["#!/bin/bash", *(f"#SBATCH {option}" for option in sbatch_directives(job, spec))]
    exports = [f"export {name}={shlex.quote(value)}" for name, value in job_environment(job, spec).items()]
    launch = [
        "# torchrun's c10d rendezvous is served from the first node; the port follows the job id so",
        "# that jobs sharing a node do not collide. No `| head -n 1`: under pipefail, a long node list",
        "# would kill scontrol with SIGPIPE, and the script with it.",
        'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "head_node=${nodes%%$'\\n'*}",
        f"rdzv_port=$(({RDZV_BASE_PORT} + SLURM_JOB_ID % {RDZV_PORT_RANGE}))",
        torchrun_command(job, spec, hyperpod=hyperpod),
    ]
    blocks = [header, ["set -euo pipefail"], exports, list(spec.setup), launch]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"


# ------------------------------------------------------------------------------------------ state cache


class SlurmStateCache:
    """Slurm's view of every job one launcher follows, refreshed at most once per ``max_age_s``.

    Thread safety: every method may be called from several threads; one lock serializes refreshes,
    so concurrent callers share one squeue call. A job's final status is kept for good: once Slurm
    says a job ended, it is never asked about again.

    A refresh that fails transiently (controller busy, ssh down) is logged and the last known status
    served instead, for up to ``stale_limit_s``; after that the ``TransientError`` reaches the caller.
    """

    def __init__(self, runner: CommandRunner, max_age_s: float, stale_limit_s: float = 300.0) -> None:
        self.runner = runner
        self.max_age_s = max_age_s
        self.stale_limit_s = stale_limit_s
        self._lock = threading.Lock()
        self._tracked: set[str] = set()
        self._live: dict[str, SlurmStatus] = {}
        self._final: dict[str, SlurmStatus] = {}
        self._fetched_at = -math.inf

    def track(self, job_id: str) -> None:
        """Include ``job_id`` in the next refresh."""
        with self._lock:
            self._tracked.add(job_id)

    def status(self, job_id: str, *, max_age_s: float | None = None) -> SlurmStatus:
        """The status of ``job_id``, at most ``max_age_s`` (default: the cache's) seconds old."""
        limit = self.max_age_s if max_age_s is None else max_age_s
        with self._lock:
            self._tracked.add(job_id)
            if job_id in self._final:
                return self._final[job_id]
            if job_id in self._live and time.monotonic() - self._fetched_at < limit:
                return self._live[job_id]
            try:
                self._refresh()
            except TransientError as exc:
                return self._stale_or_raise(job_id, exc)
            return self._final.get(job_id) or self._live[job_id]

    def _stale_or_raise(self, job_id: str, exc: TransientError) -> SlurmStatus:
        last = self._live.get(job_id)
        if last is None or time.monotonic() - self._fetched_at > self.stale_limit_s:
            raise exc
        logger.warning("slurm state refresh failed, using the last known state of job %s: %s", job_id, exc)
        return last

    def _refresh(self) -> None:
        open_ids = sorted(self._tracked - self._final.keys(), key=int)
        queued = self._squeue(open_ids)
        live: dict[str, SlurmStatus] = {}
        for job_id in open_ids:
            status = queued.get(job_id)
            if status is None or status.job_state.is_terminal:
                # Gone from the queue (or ended): scontrol has the exit code while Slurm remembers the
                # job (MinJobAge); sacct, where accounting runs, after that.
                status = self._scontrol(job_id) or status or self._sacct(job_id) or purged_status(job_id)
            if status.job_state.is_terminal:
                self._final[job_id] = status
            else:
                live[job_id] = status
        self._live = live
        self._fetched_at = time.monotonic()

    def _squeue(self, job_ids: Sequence[str]) -> dict[str, SlurmStatus]:
        if not job_ids:
            return {}
        argv = ["squeue", "-h", "-o", "%i|%T|%r", "-j", ",".join(job_ids)]
        try:
            return parse_squeue(self.runner.run(argv).stdout)
        except CommandFailed as exc:
            # squeue asked about one id it no longer knows fails instead of printing nothing.
            if isinstance(exc, TransientError) or "Invalid job id" not in exc.stderr:
                raise
            return {}

    def _scontrol(self, job_id: str) -> SlurmStatus | None:
        try:
            return parse_scontrol_job(self.runner.run(["scontrol", "show", "job", "-o", job_id]).stdout)
        except CommandFailed as exc:
            if isinstance(exc, TransientError) or "Invalid job id" not in exc.stderr:
                raise
            return None

    def _sacct(self, job_id: str) -> SlurmStatus | None:
        argv = ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Reason"]
        try:
            return parse_sacct(self.runner.run(argv).stdout)
        except CommandFailed as exc:
            if isinstance(exc, TransientError):
                raise
            # No accounting on this cluster (no slurmdbd), or no sacct at all: nothing more to learn.
            logger.debug("sacct could not tell the state of job %s: %s", job_id, exc)
            return None


# ------------------------------------------------------------------------------------------ jobs


class SlurmJob:
    """A job submitted to Slurm, followed through its launcher's shared state cache.

    Thread safety: every method may be called from several threads; concurrent ``cancel`` calls are
    serialized and all return once the job has ended.
    """

    def __init__(
        self,
        job_id: str,
        job_dir: Path,
        *,
        cache: SlurmStateCache,
        runner: CommandRunner,
        cancel_timeout_s: float,
    ) -> None:
        self.job_id = job_id
        self.job_dir = job_dir
        self._cache = cache
        self._runner = runner
        self._cancel_timeout_s = cancel_timeout_s
        self._paths = JobPaths(job_dir)
        self._cancel_lock = threading.Lock()

    def status(self) -> SlurmStatus:
        """Slurm's own view of the job (state name, reason, exit code), from the launcher's cache."""
        return self._cache.status(self.job_id)

    def state(self) -> JobState:
        """The mapped state; a job that failed after tunepod cancelled it counts as CANCELLED."""
        return self._mapped(self.status())

    @property
    def slurm_state(self) -> str:
        return self.status().state

    @property
    def reason(self) -> str:
        return self.status().reason

    @property
    def exit_code(self) -> int | None:
        return self.status().exit_code

    def cancel(self) -> None:
        """Mark the job cancelled, ``scancel`` it and wait until Slurm says it ended.

        Idempotent. A job that has already ended keeps its real outcome. Raises ``JobError`` when the
        job is still not over after ``cancel_timeout_s`` (a node that does not answer).
        """
        with self._cancel_lock:
            if self._cache.status(self.job_id, max_age_s=0).job_state.is_terminal:
                return
            write_bytes_atomic(self._paths.cancelled, f"cancelled at {_now()}\n".encode())
            self._scancel()
            self._wait_until_ended()

    def _wait_until_ended(self) -> None:
        deadline = time.monotonic() + self._cancel_timeout_s
        while True:
            # Asked past the launcher's cache period: a long poll_cache_s must not slow a cancel down.
            status = self._cache.status(self.job_id, max_age_s=_CANCEL_POLL_S)
            if status.job_state.is_terminal:
                return
            if time.monotonic() > deadline:
                raise JobError(
                    f"{status.describe(self.job_id)} {self._cancel_timeout_s:.0f}s after scancel; "
                    f"check its nodes (scontrol show job {self.job_id}); logs: {self._paths.stderr}"
                )
            time.sleep(_CANCEL_POLL_S)

    def logs(self, tail: int = 50) -> str:
        """The last ``tail`` lines of stderr, else stdout."""
        return tail_lines(self._paths.stderr, tail) or tail_lines(self._paths.stdout, tail)

    def describe(self) -> str:
        """Slurm's state, reason and exit code in one line: they explain a TIMEOUT or OUT_OF_MEMORY
        that the log cannot."""
        return self.status().describe(self.job_id)

    def _mapped(self, status: SlurmStatus) -> JobState:
        state = status.job_state
        if state is JobState.FAILED and self._paths.cancelled.exists():
            return JobState.CANCELLED
        return state

    def _scancel(self) -> None:
        try:
            self._runner.run(["scancel", self.job_id])
        except CommandFailed as exc:
            # It ended between our look and the scancel: the wait below sees the real outcome.
            if isinstance(exc, TransientError) or not re.search(
                r"already completing or completed|Invalid job id", exc.stderr
            ):
                raise


# ------------------------------------------------------------------------------------------ launcher


class SlurmLauncher:
    """Submits jobs with sbatch (here, or on ``spec.ssh`` over ssh) and follows them with one cache.

    ``spec.root`` must be the same path here and on the compute nodes: the orchestrator reads the
    logs, metrics and results the jobs write there. Thread safety: ``submit`` and ``attach`` may be
    called from several threads; see ``SlurmJob`` and ``SlurmStateCache`` for the handles.
    """

    kind = "slurm"

    def __init__(
        self, spec: SlurmLauncherSpec, runner: CommandRunner | None = None, *, cancel_timeout_s: float = 120.0
    ) -> None:
        self.spec = spec
        self.runner = runner or (SshRunner(spec.ssh, spec.ssh_options) if spec.ssh else LocalRunner())
        self.hyperpod = detect_hyperpod(spec)
        self.cancel_timeout_s = cancel_timeout_s
        self.cache = SlurmStateCache(self.runner, spec.poll_cache_s)
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()

    def submit(self, job: JobSpec) -> SlurmJob:
        """Write ``<job_dir>/job.sbatch``, sbatch it and record ``submission.json``.

        Resubmitting into a used job dir (resume after a crash) clears the previous outcome markers but
        keeps logs (appended to) and checkpoints. A transient sbatch failure (``TransientError``) may
        still have queued the job: check ``squeue -n <job name>`` before retrying by hand.
        """
        self._warn_ignored_resources(job)
        script = render_sbatch(job, self.spec, hyperpod=self.hyperpod)  # refuses bad input before any write
        paths = job.paths
        paths.job_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_if_running(paths)
        for stale in (paths.submission, paths.cancelled):
            stale.unlink(missing_ok=True)
        script_path = paths.job_dir / SCRIPT_NAME
        write_bytes_atomic(script_path, script.encode())
        job_id = self._sbatch(script_path, script)
        try:
            record = {"job_id": job_id, "name": job.name, "script": str(script_path), "submitted_at": _now()}
            write_bytes_atomic(paths.submission, json.dumps(record, indent=2).encode())
        except BaseException:
            # Without submission.json nobody could attach to this job again: do not leave it running.
            self.runner.run(["scancel", job_id])
            raise
        self.cache.track(job_id)
        return self._handle(job_id, paths.job_dir)

    def attach(self, job_id: str, job_dir: Path) -> SlurmJob:
        """A handle on a job submitted earlier, by this process or another (no Slurm call here)."""
        if not job_id.isdigit():
            raise JobError(f"{job_id!r} is not a slurm job id (expected digits, as sbatch --parsable prints)")
        recorded = _recorded_job_id(JobPaths(job_dir))
        if recorded is not None and recorded != job_id:
            raise JobError(
                f"cannot attach to slurm job {job_id}: {JobPaths(job_dir).submission} names job {recorded} "
                f"(the job dir was reused by a later submission); attach to {recorded} instead"
            )
        self.cache.track(job_id)
        return self._handle(job_id, job_dir)

    def _handle(self, job_id: str, job_dir: Path) -> SlurmJob:
        return SlurmJob(
            job_id, job_dir, cache=self.cache, runner=self.runner, cancel_timeout_s=self.cancel_timeout_s
        )

    def _sbatch(self, script_path: Path, script: str) -> str:
        if self.spec.ssh:
            # The head node may not see a file we just wrote yet (attribute caching on the shared
            # filesystem); stdin does not depend on it.
            done = self.runner.run(["sbatch", "--parsable"], input=script)
        else:
            done = self.runner.run(["sbatch", "--parsable", str(script_path)])
        return parse_job_id(done.stdout)

    def _refuse_if_running(self, paths: JobPaths) -> None:
        previous = _recorded_job_id(paths)
        if previous is None:
            return
        status = self.cache.status(previous, max_age_s=0)
        if not status.job_state.is_terminal:
            raise JobError(
                f"job dir {paths.job_dir} belongs to {status.describe(previous)}, which has not ended; "
                f"cancel it (scancel {previous}) or wait for it before submitting again into the same job dir"
            )

    def _warn_ignored_resources(self, job: JobSpec) -> None:
        for key, message in ignored_resources(job.resources).items():
            with self._warn_lock:
                if key in self._warned:
                    continue
                self._warned.add(key)
            logger.warning("slurm launcher: %s", message)


def _recorded_job_id(paths: JobPaths) -> str | None:
    """The job id in ``submission.json``, or None when there is none (or it is unreadable)."""
    try:
        job_id = json.loads(paths.submission.read_text())["job_id"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return str(job_id)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
