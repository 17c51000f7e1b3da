"""Run jobs as local ``torchrun`` processes: the launcher for a laptop, CI and a single machine.

Each job is ``/bin/sh -c WRAPPER`` around ``python -m torch.distributed.run --standalone ...``, or
around the bare interpreter for a job of one process (``render.py``), started in a session of its own
so that it outlives the orchestrator. A job's id is ``local-<submission id>``: every process of the
job inherits that id (``processes.py``), which is how ``find`` and ``stop`` reach them all, even after
the wrapper is gone. The wrapper's pid and start time, recorded at submit, make the common "is it
still running" question one ``/proc/<pid>/stat`` read.

A job is not over while any process of its submission lives, wrapper or not: torchrun's workers run
in sessions of their own and outlive an agent that was killed, and a script may leave a child behind
in a session of its own (``setsid``, a double fork). Ending such a job early would let the driver start
its next attempt beside them, two writers of one checkpoint folder. So, once the wrapper is gone:

- with its exit code recorded, the job is RUNNING while such leftovers live. Nothing would ever
  collect them, so the poll that sees them stops them, as ``stop`` does: SIGTERM at once, SIGKILL
  once the job's grace (``resources.stop_grace_s``, else ``cancel_grace_s``) has passed, each sent by
  a poll (never waited for inside one). Then the recorded exit code is the outcome, and ``describe``
  says how many leftovers were stopped. Only a job without its wrapper costs a pass over ``/proc``
  (one per poll, however many such jobs it asks about), until it has ended (then it is never polled
  again);
- without an exit code (the wrapper itself was killed, maybe by hand while torchrun trains on), the
  job runs until its last process exits, and nothing is stopped unless someone cancels the job.

``Resources.timeout_min`` is not enforced here: the caller enforces it by cancelling the job
(``tunepod.launch.drive``), the same way for every backend that has no limit of its own.

Processes are reached through a ``ProcessTable`` (``processes.py``): ``/proc`` and the kernel by
default, simulated processes in the simulation of the tuning loop.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tunepod import world
from tunepod.errors import JobError, StopUnfinished
from tunepod.launch.base import SUBMISSION_ID_ENV, Accepted, Job, JobSpec, JobState, LauncherBase, Rendered
from tunepod.launch.contract import memory_folder
from tunepod.launch.exit_code import read_exit_code, temp_exit_file
from tunepod.launch.local.processes import (
    LinuxProcesses,
    ProcessTable,
    SubmissionProcesses,
    carries_submission,
    is_same_process,
    submission_processes,
)
from tunepod.launch.local.render import job_argv, wrapper_argv
from tunepod.launch.paths import JobPaths, file_logs
from tunepod.launch.procfs import ProcessStat
from tunepod.launch.slots import Slots, counted, divided
from tunepod.launch.status_cache import TrackedJob
from tunepod.launch.submission import Submission, read_submission
from tunepod.runtime.memory_store import remove_folder
from tunepod.spec.resources import Resources

logger = logging.getLogger(__name__)

JOB_ID_PREFIX = "local-"
MEMORY_FOLDER_DETAIL = "memory_folder"
"""The submission detail naming the job's memory folder (its checkpoint tiers'), removed once it ends."""
_JOB_ID = re.compile(r"^local-(?P<submission>[0-9a-f]{16})$")
_POLL_S = 0.05
# After SIGKILL the kernel only has to tear processes down; a job still there after this long is stuck
# in uninterruptible sleep (a hung filesystem), which the caller must hear about.
_AFTER_KILL_WAIT_S = 10.0


def parse_job_id(job_id: str) -> str:
    """``local-<submission id>`` -> the submission id; ``JobError`` for anything else."""
    match = _JOB_ID.match(job_id)
    if match is None:
        raise JobError(f"{job_id!r} is not a local job id (expected local-<16 hex digits>)")
    return match["submission"]


@dataclass
class _Sweep:
    """Stopping what a job left running after its wrapper recorded the exit code (see the module
    docstring)."""

    job_id: str
    grace_s: float
    table: ProcessTable
    started_at: float = field(default_factory=world.monotonic)
    """When the first SIGTERM went out: the grace counts from it."""
    signalled: dict[int, int] = field(default_factory=dict)
    """Every leftover process signalled so far: pid -> start ticks."""
    killing: bool = False

    def still_alive(self, found: list[tuple[int, ProcessStat]]) -> list[int]:
        """The leftovers that live: those the scan ``found``, and those signalled earlier that have not
        finished exiting (an exiting process's environment, which the scan reads, goes first)."""
        exiting = [pid for pid, ticks in self.signalled.items() if is_same_process(self.table, pid, ticks)]
        return sorted({pid for pid, _ in found} | set(exiting))

    def advance(self, found: list[tuple[int, ProcessStat]]) -> None:
        """SIGTERM to each leftover not signalled yet; SIGKILL to all once the grace has passed."""
        pids = [pid for pid, _ in found]
        if world.monotonic() - self.started_at < self.grace_s:
            self._terminate([pid for pid in pids if pid not in self.signalled])
        else:
            self._kill(pids)
        self.signalled.update((pid, stat.start_ticks) for pid, stat in found)

    def _terminate(self, pids: list[int]) -> None:
        if pids:
            logger.warning("local job %s left processes %s running; stopping them", self.job_id, pids)
        _signal(self.table, pids, signal.SIGTERM)

    def _kill(self, pids: list[int]) -> None:
        if not self.killing:
            logger.warning(
                "leftover processes %s of local job %s ignored SIGTERM for %.1fs; sending SIGKILL",
                pids,
                self.job_id,
                self.grace_s,
            )
            self.killing = True
        _signal(self.table, pids, signal.SIGKILL)


@dataclass(frozen=True)
class LocalStatus:
    """What this machine says about a local job."""

    running: bool
    exit_code: int | None
    """The command's exit code; None while it runs or when the wrapper itself was killed."""
    leftovers: int = 0
    """Processes the job left behind after its wrapper recorded ``exit_code``: those still being
    stopped while ``running``, those the launcher stopped once it has ended."""

    @property
    def job_state(self) -> JobState:
        if self.running:
            return JobState.RUNNING
        return JobState.SUCCEEDED if self.exit_code == 0 else JobState.FAILED

    def describe(self, job_id: str) -> str:
        if self.running and self.exit_code is not None:
            return f"local job {job_id}: exit code {self.exit_code}; stopping {_processes(self.leftovers)}"
        if self.running:
            return f"local job {job_id} (running)"
        if self.exit_code is None:
            return f"local job {job_id}: no exit code (the job's wrapper was killed)"
        if self.leftovers:
            return f"local job {job_id}: exit code {self.exit_code}; {_processes(self.leftovers)} stopped"
        return f"local job {job_id}: exit code {self.exit_code}"


class LocalJob(Job[LocalStatus]):
    """A local job; adds what only a local job has: its pids and exit code."""

    launcher: LocalLauncher

    @property
    def submission_id(self) -> str:
        return parse_job_id(self.job_id)

    @property
    def exit_code(self) -> int | None:
        return read_exit_code(self.paths, self.submission_id)

    def idle(self, seconds: float) -> None:
        """Up to ``seconds``, returning as soon as the job's wrapper exits (it writes the exit code
        first)."""
        wrapper = _wrapper(self.record)
        if wrapper is None:  # no wrapper to wait on: only the next poll can tell
            world.sleep(seconds)
        else:
            self.launcher.processes.wait(*wrapper, seconds)

    def pids(self) -> list[int]:
        """The live processes of this job: the wrapper, torchrun, its workers and their children."""
        table = self.launcher.processes
        wrapper = _wrapper(self.record)
        # The process group only counts while its leader is our wrapper: once the leader is gone, the
        # group id could name a stranger's group after pid reuse. The submission id never can.
        pgid = wrapper[0] if wrapper is not None and is_same_process(table, *wrapper) else None
        submission_id = self.submission_id
        return sorted(
            pid
            for pid, stat in table.live()
            if stat.pgid == pgid or carries_submission(table, pid, submission_id)
        )


class LocalLauncher(LauncherBase[LocalStatus]):
    """Starts jobs as ``torchrun --standalone`` process trees on this machine.

    ``root`` stands in for the shared filesystem (``fsx:///x`` resolves to ``root/x``). Resources a
    single machine cannot honour are logged once per launcher, not per job.
    """

    kind = "local"
    stop_hint = "cancel it (kill the processes that carry TUNEPOD_SUBMISSION_ID of {job_id})"

    def __init__(
        self,
        root: Path,
        cancel_grace_s: float = 10.0,
        python: str = sys.executable,
        *,
        direct_single_process: bool = True,
        processes: ProcessTable | None = None,
    ) -> None:
        # No cache: reading /proc is cheaper than any bookkeeping around it.
        super().__init__(poll_cache_s=0.0, cancel_timeout_s=_AFTER_KILL_WAIT_S, cancel_poll_s=_POLL_S)
        self.root = root
        self.cancel_grace_s = cancel_grace_s
        self.python = python
        self.direct_single_process = direct_single_process
        self.processes: ProcessTable = processes if processes is not None else LinuxProcesses()
        self._sweeps: dict[str, _Sweep] = {}
        self._sweeps_lock = world.lock()

    # ------------------------------------------------------------------------------------ hooks

    def render(self, job: JobSpec, attempt: int, variant: int = 0) -> Rendered:
        submission_id = job.env[SUBMISSION_ID_ENV]
        command = job_argv(job, self.python, direct_single_process=self.direct_single_process)
        argv = wrapper_argv(job.paths, command, submission_id)
        return Rendered(name=f"{JOB_ID_PREFIX}{submission_id}", payload=argv)

    def send(self, job: JobSpec, rendered: Rendered, intent: Submission) -> Accepted:
        paths = job.paths
        # A session of its own: the job outlives the orchestrator and a terminal's Ctrl-C.
        pid = self.processes.start(rendered.payload, {**os.environ, **job.env}, paths.stdout, paths.stderr)
        # The wrapper is our unreaped child, so its pid cannot be reused while we read its stat.
        stat = self.processes.stat(pid)
        details: dict[str, object] = {"argv": rendered.payload}
        folder = memory_folder(job.env)
        if folder is not None:
            details[MEMORY_FOLDER_DETAIL] = str(folder)
        if stat is not None:
            details |= {"pid": pid, "start_ticks": stat.start_ticks}
        return Accepted(rendered.name, details)

    def find(self, intent: Submission, job_dir: Path) -> Accepted | None:
        """The job's wrapper (or, with the wrapper gone, any of its processes, or its exit file)."""
        processes = submission_processes(self.processes, intent.submission_id)
        leaders = [(pid, stat) for pid, stat in processes if stat.pgid == pid]
        if leaders:
            pid, stat = leaders[0]
            return Accepted(intent.name, {"pid": pid, "start_ticks": stat.start_ticks})
        if processes or read_exit_code(JobPaths(job_dir), intent.submission_id) is not None:
            return Accepted(intent.name)
        return None

    def poll(self, jobs: Mapping[str, TrackedJob]) -> dict[str, LocalStatus]:
        self.processes.reap()
        processes = SubmissionProcesses(self.processes, (parse_job_id(job_id) for job_id in jobs))
        return {job_id: self._status(job_id, job, processes) for job_id, job in jobs.items()}

    def stop(self, job: Job[LocalStatus]) -> None:
        """SIGTERM every process of the job, SIGKILL what is left after its ``resources.stop_grace_s``
        (the launcher's ``cancel_grace_s`` when the job sets none)."""
        assert isinstance(job, LocalJob)
        grace_s = self._grace_s(job.record)
        _signal(self.processes, job.pids(), signal.SIGTERM)
        if self._wait_until_gone(job, grace_s):
            return
        logger.warning("job %s ignored SIGTERM for %.1fs; sending SIGKILL", job.job_id, grace_s)
        _signal(self.processes, job.pids(), signal.SIGKILL)
        if not self._wait_until_gone(job, _AFTER_KILL_WAIT_S):
            state = f"local job {job.job_id} still has processes {job.pids()}"
            raise StopUnfinished(
                f"{state} {_AFTER_KILL_WAIT_S:g}s after SIGKILL (stuck in the kernel, e.g. on a hung "
                f"filesystem); job dir: {job.job_dir}",
                job_id=job.job_id,
                state=state,
            )

    def read_logs(self, job: Job[LocalStatus], tail: int) -> str:
        return file_logs(job.paths, tail)

    def ignored_settings(self, job: JobSpec) -> dict[str, str]:
        return ignored_resources(job)

    def stale_outcome_files(self, paths: JobPaths) -> list[Path]:
        return [paths.exit_code, Path(temp_exit_file(paths))]

    def check_job_id(self, job_id: str) -> None:
        parse_job_id(job_id)

    def make_job(self, job_id: str, job_dir: Path, record: Submission | None) -> LocalJob:
        return LocalJob(self, job_id, job_dir, record)

    def trial_slots(self, resources: Resources) -> Slots:
        """``num_parallel: auto``: this machine's CPUs (those this process may run on: a container's or
        taskset's limit) per trial's processes; every process of a local job runs here, whatever its
        ``num_nodes``."""
        cpus = len(os.sched_getaffinity(0))
        return divided(cpus, counted(cpus, "CPU"), resources.procs_per_node, "process")

    # ------------------------------------------------------------------------------------ internals

    def _status(self, job_id: str, job: TrackedJob, processes: SubmissionProcesses) -> LocalStatus:
        submission_id = parse_job_id(job_id)
        wrapper = _wrapper(job.record)
        if wrapper is not None and is_same_process(self.processes, *wrapper):
            return LocalStatus(running=True, exit_code=None)
        # No wrapper (any more): the job lives while any of its processes does.
        code = read_exit_code(JobPaths(job.job_dir), submission_id)
        found = processes.of(submission_id)
        if code is None:  # the wrapper was killed: its command may still be training
            status = LocalStatus(running=bool(found), exit_code=None)
        else:
            status = self._sweep_leftovers(job_id, job.record, code, found)
        if not status.running:
            _remove_memory_folder(job)
        return status

    def _sweep_leftovers(
        self, job_id: str, record: Submission | None, code: int, found: list[tuple[int, ProcessStat]]
    ) -> LocalStatus:
        """The status of a job whose wrapper exited with ``code``: RUNNING while processes of it
        remain (``found`` by the scan, or signalled and still exiting), which are signalled here,
        SIGTERM then SIGKILL after the grace; ended (with ``code``) once they are all gone."""
        with self._sweeps_lock:
            sweep = self._sweeps.get(job_id)
            alive = sweep.still_alive(found) if sweep else [pid for pid, _ in found]
            if not alive:
                self._sweeps.pop(job_id, None)
                stopped = len(sweep.signalled) if sweep else 0
                return LocalStatus(running=False, exit_code=code, leftovers=stopped)
            if sweep is None:
                sweep = self._sweeps[job_id] = _Sweep(job_id, self._grace_s(record), self.processes)
            sweep.advance(found)
            return LocalStatus(running=True, exit_code=code, leftovers=len(alive))

    def _grace_s(self, record: Submission | None) -> float:
        """How long the job's processes get between SIGTERM and SIGKILL."""
        grace_s = record.stop_grace_s if record is not None else None
        return self.cancel_grace_s if grace_s is None else grace_s

    def _wait_until_gone(self, job: LocalJob, timeout_s: float) -> bool:
        deadline = world.monotonic() + timeout_s
        while True:
            self.processes.reap()
            if not job.pids():
                return True
            if world.monotonic() >= deadline:
                return False
            world.sleep(_POLL_S)


def _remove_memory_folder(job: TrackedJob) -> None:
    """Once a local job with checkpoint tiers has ended, remove its memory folder, which only
    ``ctx.finish`` removes otherwise: a killed, failed or cancelled job would leave it in /dev/shm for
    good. No restore from it can come: a local job is never requeued, and every new attempt (a
    restart, a resume after a pause) is a new job that restores from the shared folder, whose newest
    step is at most a few steps older. Only while the job dir still belongs to this job: the folder is
    the same for every attempt of a trial, and a newer attempt's must stay."""
    record = job.record
    folder = record.details.get(MEMORY_FOLDER_DETAIL) if record is not None else None
    if record is None or not folder or not Path(folder).exists():
        return
    try:
        current = read_submission(JobPaths(job.job_dir))
    except JobError:  # an unreadable record: not this job's to judge; the next poll asks again
        return
    if current is None or current.submission_id != record.submission_id:
        return
    remove_folder(Path(folder))
    logger.info("removed the memory folder %s of ended local job %s", folder, job.job_dir)


def _wrapper(record: Submission | None) -> tuple[int, int] | None:
    """(pid, start ticks) of the job's wrapper, when the submission recorded them."""
    if record is None or "pid" not in record.details or "start_ticks" not in record.details:
        return None
    return int(record.details["pid"]), int(record.details["start_ticks"])


def _signal(table: ProcessTable, pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        table.signal(pid, signum)


def _processes(count: int) -> str:
    return f"{count} leftover process" + ("" if count == 1 else "es")


def ignored_resources(job: JobSpec) -> dict[str, str]:
    """What a single machine cannot honour in ``job.resources``, keyed by field."""
    res = job.resources
    ignored: dict[str, str] = {}
    if res.num_nodes > 1:
        ignored["num_nodes"] = (
            f"resources.num_nodes={res.num_nodes} ignored: every process runs on this machine "
            f"({res.procs_per_node} in all, torchrun --standalone)"
        )
    gpus_here = _count_nvidia_gpus()
    if res.gpus_per_node > gpus_here:
        ignored["gpus_per_node"] = (
            f"resources.gpus_per_node={res.gpus_per_node} but this machine has {gpus_here} NVIDIA GPU(s); "
            "the job sees only what is here (CPU if none)"
        )
    if res.instance_type is not None:
        ignored["instance_type"] = (
            f"resources.instance_type={res.instance_type!r} ignored: jobs run on this machine"
        )
    return ignored


def _count_nvidia_gpus() -> int:
    # /dev/nvidiaN exists per GPU when the driver is loaded; cheaper than importing torch to ask CUDA.
    return sum(1 for dev in Path("/dev").glob("nvidia*") if dev.name[len("nvidia") :].isdigit())
