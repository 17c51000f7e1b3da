"""A simulated Slurm controller behind the real ``SlurmLauncher``: it answers the very commands the
launcher runs (``sbatch --parsable``, ``squeue``, ``scontrol show job -o``, ``sacct``, ``scancel``)
with the text Slurm 22.05 prints, so the launcher's rendering and parsing run as they do on a cluster.

Modelled, as Slurm does it:

- ``sbatch`` reads the rendered script: ``#SBATCH --job-name``, ``--comment``, ``--output`` (the job
  dir), ``--time``, its ``export`` lines (the job's environment) and its ``EXIT`` trap, which bash runs
  when the script ends or is stopped by SIGTERM (a cancel, the time limit), not when its node dies;
  ids grow and never restart at 1;
- a job waits in the queue (PENDING) a little, then runs on one of the compute nodes, each with a
  clock of its own; it ends COMPLETED or FAILED with its exit code, TIMEOUT at its ``--time``;
- ``scancel``: PENDING -> CANCELLED at once; RUNNING -> COMPLETING (processes killed) -> CANCELLED;
- requeue (``--requeue``, a node failure or ``scontrol requeue`` while faults are on): the run is
  killed and the job waits again under the same id, ``Restarts`` + 1, a new ``StartTime``;
- an ended job stays in the controller's memory for ``MinJobAge`` seconds (``squeue --states=all``,
  ``scontrol``), then is purged; ``sacct`` answers only with accounting (slurmdbd), and lists
  comments only with ``AccountingStoreFlags=job_comment``;
- a command may fail as a busy controller does ("Socket timed out on send/recv operation"), before
  it takes effect, or after it (a lost ``sbatch`` reply: the job exists, the caller does not know).
"""

from __future__ import annotations

import random
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from simulation.backends import Machine, Outage, ServiceFaults, rate, service_faults
from simulation.cluster import Cluster, JobRun
from simulation.invariants import Referee
from simulation.scheduler import Host, Scheduler
from tunepod.launch.base import Launcher
from tunepod.launch.runner import CommandFailed, TransientCommandFailed, is_transient_failure
from tunepod.launch.slurm.launcher import SlurmLauncher
from tunepod.runtime.files import write_bytes_atomic
from tunepod.spec.models import SlurmLauncherSpec

_TIMED_OUT = "slurm_load_jobs error: Socket timed out on send/recv operation"
_INVALID = "slurm_load_jobs error: Invalid job id specified"
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}


@dataclass(frozen=True)
class SlurmFaults(ServiceFaults):
    """The controller's (a command unanswered; ``sbatch``/``scancel`` answers lost), and requeues."""

    requeue_per_s: float = 0.0
    """Per running job and second: a node failure or ``scontrol requeue``."""


@dataclass(frozen=True)
class SlurmSettings:
    """The simulated cluster's configuration and faults."""

    faults: SlurmFaults
    min_job_age_s: float
    accounting: bool
    comments_in_accounting: bool
    kind: str = "slurm"

    def describe(self) -> str:
        return (
            f"slurm: MinJobAge {self.min_job_age_s:.0f}s, accounting {self.accounting} "
            f"(comments {self.comments_in_accounting}), faults {self.faults}"
        )

    def quiet(self) -> SlurmSettings:
        return replace(self, faults=SlurmFaults())

    def make(self, machine: Machine) -> SlurmBackend:
        return SlurmBackend(Slurmctld(machine, self))


def draw(random_: random.Random) -> SlurmSettings:
    return SlurmSettings(
        faults=SlurmFaults(**service_faults(random_), requeue_per_s=rate(random_, 0.002)),
        min_job_age_s=random_.choice([30.0, 300.0]),
        accounting=random_.random() < 0.5,
        comments_in_accounting=random_.random() < 0.5,
    )


class SlurmBackend:
    """The real ``SlurmLauncher`` of each orchestrator, all reaching one simulated controller."""

    def __init__(self, ctld: Slurmctld) -> None:
        self.ctld = ctld

    def launcher(self) -> Launcher:
        sim, root = self.ctld.sim, self.ctld.root
        spec = SlurmLauncherSpec(kind="slurm", root=str(root), poll_cache_s=sim.choices.pick([0.0, 2.0]))
        return SlurmLauncher(spec, runner=SimSlurmRunner(self.ctld), cancel_timeout_s=120.0)

    def faults_stop(self) -> None:
        self.ctld.faults_on = False


@dataclass
class SlurmJob:
    job_id: str
    name: str
    comment: str
    job_dir: Path
    env: dict[str, str]
    time_limit_s: float | None
    submitted_at: float
    start_after: float
    state: str = "PENDING"
    reason: str = "Priority"
    exit_code: int = 0
    signal: int = 0
    restarts: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    exit_file: Path | None = None
    exit_fields: tuple[str, ...] = ()
    """Where the script's EXIT trap records how it ended (None: the script has no such trap)."""
    run: JobRun | None = field(default=None, repr=False)


class Slurmctld:
    """The controller and its nodes; see the module docstring."""

    def __init__(self, machine: Machine, settings: SlurmSettings) -> None:
        self.sim: Scheduler = machine.sim
        self.cluster: Cluster = machine.cluster
        self.referee: Referee = machine.referee
        self.root = machine.root
        self.nodes: list[Host] = list(machine.nodes)
        self.min_job_age_s = settings.min_job_age_s
        self.accounting = settings.accounting
        self.comments_in_accounting = settings.comments_in_accounting
        self.faults = settings.faults
        self.faults_on = True
        self.outage = Outage()
        sim = self.sim
        self.memory: dict[str, SlurmJob] = {}
        self.accounted: dict[str, SlurmJob] = {}
        self._next_id = 1000 + sim.choices.integer(0, 5000)
        controller = sim.start_process("slurmctld", Host("head", "boot-head", "pid:[head]"))
        controller.spawn("control", self._control)

    # ------------------------------------------------------------------------------ the controller

    def _control(self) -> None:
        while True:
            self.sim.sleep(1.0)
            for job in list(self.memory.values()):
                self._tick(job)

    def _tick(self, job: SlurmJob) -> None:
        now = self.sim.now
        if job.state == "PENDING" and now >= job.start_after:
            self._start(job)
        elif job.state == "RUNNING" and self._over_time(job):
            self._end_run(job, "TIMEOUT", "TimeLimit", exit_code=0, signal=15)
        elif job.state == "RUNNING" and self.faults_on and self.sim.choices.chance(self.faults.requeue_per_s):
            self._requeue(job)
        elif job.state == "COMPLETING" and now >= (job.ended_at or now):
            job.state = "CANCELLED"
        elif job.state in _ENDED and job.ended_at is not None and now - job.ended_at > self.min_job_age_s:
            del self.memory[job.job_id]
            self.sim.trace.event(now, "job", f"slurm purges job {job.job_id} (MinJobAge)")

    def _over_time(self, job: SlurmJob) -> bool:
        limit, started = job.time_limit_s, job.started_at
        return limit is not None and started is not None and self.sim.now - started >= limit

    def _start(self, job: SlurmJob) -> None:
        job.state, job.reason, job.started_at = "RUNNING", "None", self.sim.now
        node = self.sim.choices.pick(self.nodes)
        job.run = self.cluster.start(
            job.job_dir, job.job_id, job.env, node, lambda run: self._exited(job, run)
        )
        self.referee.job_started(job.job_dir)

    def _exited(self, job: SlurmJob, run: JobRun) -> None:
        if job.run is not run:
            return
        code = run.exit_code or 0
        job.state, job.reason = ("COMPLETED", "None") if code == 0 else ("FAILED", "NonZeroExitCode")
        job.exit_code, job.ended_at, job.run = code, self.sim.now, None
        self._trap(job, code)

    def _trap(self, job: SlurmJob, code: int) -> None:
        """The batch script's EXIT trap, as bash runs it: its printf's arguments, each ``"$code"`` or a
        variable of the job's environment (Slurm's own included), joined by spaces."""
        if job.exit_file is None:
            return
        values = {**job.env, "SLURM_JOB_ID": job.job_id, "code": str(code)}
        fields = [values.get(name, "") for name in job.exit_fields]
        write_bytes_atomic(job.exit_file, (" ".join(fields) + "\n").encode())

    def _end_run(self, job: SlurmJob, state: str, reason: str, *, exit_code: int, signal: int) -> None:
        if job.run is not None:
            self.cluster.kill(job.run, f"slurm {state}")
            self._trap(job, 128 + signal)
        job.state, job.reason, job.exit_code, job.signal = state, reason, exit_code, signal
        job.ended_at, job.run = self.sim.now, None

    def _requeue(self, job: SlurmJob) -> None:
        self.sim.trace.event(self.sim.now, "fault", f"slurm requeues job {job.job_id} (node failure)")
        if job.run is not None:
            self.cluster.kill(job.run, "requeued")
        job.run, job.state, job.reason = None, "PENDING", "BeginTime"
        job.restarts += 1
        job.start_after = self.sim.now + self.sim.choices.uniform(5.0, 60.0)

    # ------------------------------------------------------------------------------ the commands

    def run_command(self, argv: Sequence[str], stdin: str | None) -> tuple[int, str, str]:
        command = argv[0]
        if command == "sbatch":
            return self._sbatch(argv, stdin)
        if command == "squeue":
            return self._squeue(argv)
        if command == "scontrol":
            return self._scontrol(argv)
        if command == "sacct":
            return self._sacct(argv)
        if command == "scancel":
            return self._scancel(argv)
        return 127, "", f"{command}: command not found"

    def _sbatch(self, argv: Sequence[str], stdin: str | None) -> tuple[int, str, str]:
        script = stdin if stdin is not None else Path(argv[-1]).read_text()
        options = _sbatch_options(script)
        job_dir = Path(options["output"]).parent
        live = [job for job in self.memory.values() if job.job_dir == job_dir and job.state not in _ENDED]
        self.referee.job_created(job_dir, [job.job_id for job in live])
        self._next_id += 1
        job = SlurmJob(
            job_id=str(self._next_id),
            name=options.get("job-name", "sbatch"),
            comment=options.get("comment", ""),
            job_dir=job_dir,
            env=_exports(script),
            time_limit_s=_time_limit_s(options.get("time")),
            exit_file=_exit_file(script),
            exit_fields=_exit_fields(script),
            submitted_at=self.sim.now,
            start_after=self.sim.now + self.sim.choices.uniform(0.0, 20.0),
        )
        self.memory[job.job_id] = job
        self.accounted[job.job_id] = job
        self.cluster.created[job_dir] = self.cluster.created.get(job_dir, 0) + 1
        self.sim.trace.event(
            self.sim.now, "job", f"sbatch: job {job.job_id} ({job_dir.name}) queued by {self.sim.process}"
        )
        return 0, f"{job.job_id}\n", ""

    def _squeue(self, argv: Sequence[str]) -> tuple[int, str, str]:
        fields = argv[argv.index("-o") + 1].split("|")
        if "-j" in argv:
            ids = argv[argv.index("-j") + 1].split(",")
            known = [self.memory[i] for i in ids if i in self.memory]
            if not known and len(ids) == 1:
                return 1, "", _INVALID
            listed = known
        else:
            listed = [job for job in self.memory.values() if _named(job, argv)]
            if "--states=all" not in argv:
                listed = [job for job in listed if job.state not in _ENDED]
        return 0, "".join("|".join(_field(job, f) for f in fields) + "\n" for job in listed), ""

    def _scontrol(self, argv: Sequence[str]) -> tuple[int, str, str]:
        job = self.memory.get(argv[-1])
        if job is None:
            return 1, "", _INVALID
        start = _iso(job.started_at) if job.started_at is not None else "Unknown"
        line = (
            f"JobId={job.job_id} JobName={job.name} UserId=tunepod(1000) GroupId=tunepod(1000) "
            f"Priority=4294901757 JobState={job.state} Reason={job.reason} Dependency=(null) Requeue=1 "
            f"Restarts={job.restarts} BatchFlag=1 ExitCode={job.exit_code}:{job.signal} StartTime={start} "
            f"Comment={job.comment or '(null)'}\n"
        )
        return 0, line, ""

    def _sacct(self, argv: Sequence[str]) -> tuple[int, str, str]:
        if not self.accounting:
            return 1, "", "sacct: error: Slurm accounting storage is disabled"
        fields = argv[argv.index("-o") + 1].split(",")
        if "-j" in argv:
            job = self.accounted.get(argv[argv.index("-j") + 1])
            listed = [job] if job is not None else []
        else:
            listed = [job for job in self.accounted.values() if _named(job, argv)]
        lines = "".join("|".join(self._accounted_field(job, f) for f in fields) + "\n" for job in listed)
        return 0, lines, ""

    def _accounted_field(self, job: SlurmJob, name: str) -> str:
        if name == "State":
            return job.state
        if name == "ExitCode":
            return f"{job.exit_code}:{job.signal}"
        if name == "Reason":
            return job.reason
        if name == "JobIDRaw":
            return job.job_id
        if name == "Comment":
            return job.comment if self.comments_in_accounting else ""
        if name == "JobName":
            return job.name
        raise AssertionError(f"sacct field {name} is not simulated")

    def _scancel(self, argv: Sequence[str]) -> tuple[int, str, str]:
        job = self.memory.get(argv[-1])
        if job is None:
            return 1, "", f"scancel: error: Kill job error on job id {argv[-1]}: Invalid job id specified"
        if job.state in _ENDED or job.state == "COMPLETING":
            return (
                1,
                "",
                f"scancel: error: Kill job error on job id {job.job_id}: "
                "Job/step already completing or completed",
            )
        self.referee.stop_requested(job.job_dir, job.job_id)
        self.sim.trace.event(self.sim.now, "job", f"scancel {job.job_id} by {self.sim.process}")
        if job.state == "PENDING":
            job.state, job.reason, job.ended_at = "CANCELLED", "None", self.sim.now
            return 0, "", ""
        if job.run is not None:
            self.cluster.kill(job.run, "scancel")
            self._trap(job, 143)
        job.run, job.state, job.exit_code, job.signal = None, "COMPLETING", 0, 15
        job.ended_at = self.sim.now + self.sim.choices.uniform(0.5, 3.0)
        return 0, "", ""


class SimSlurmRunner:
    """The ``CommandRunner`` an orchestrator's ``SlurmLauncher`` uses: the simulated controller, with
    latency and faults."""

    def __init__(self, ctld: Slurmctld) -> None:
        self.ctld = ctld

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        sim, faults = self.ctld.sim, self.ctld.faults
        sim.pause(f"slurm {argv[0]}")
        sim.sleep(sim.choices.uniform(0.01, 0.3))
        if self.ctld.faults_on and (self.ctld.outage.on(sim) or sim.choices.chance(faults.transient)):
            sim.trace.event(sim.now, "fault", f"{sim.process}: {argv[0]} times out")
            raise TransientCommandFailed(argv, 1, _TIMED_OUT)
        code, stdout, stderr = self.ctld.run_command(argv, input)
        if (
            code == 0
            and argv[0] in ("sbatch", "scancel")
            and self.ctld.faults_on
            and sim.choices.chance(faults.lost_reply)
        ):
            sim.trace.event(sim.now, "fault", f"{sim.process}: {argv[0]} took effect; its reply is lost")
            self.ctld.outage.begins(sim, faults)
            raise TransientCommandFailed(argv, 1, _TIMED_OUT)
        if code != 0:
            if is_transient_failure(code, stderr):
                raise TransientCommandFailed(argv, code, stderr)
            raise CommandFailed(argv, code, stderr)
        return subprocess.CompletedProcess(list(argv), 0, stdout, stderr)


# ---------------------------------------------------------------------------------- the text


def _sbatch_options(script: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for line in script.splitlines():
        if not line.startswith("#SBATCH "):
            continue
        for word in shlex.split(line[len("#SBATCH ") :]):
            key, _, value = word.lstrip("-").partition("=")
            options[key] = value
    return options


def _exports(script: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in script.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            env[name] = shlex.split(value)[0] if value else ""
    return env


def _exit_fields(script: str) -> tuple[str, ...]:
    """The variables the EXIT trap's printf writes, in order (``"$code" "${X:-}"`` -> code, X)."""
    trap = next(
        (line for line in script.splitlines() if line.startswith("trap ") and line.endswith(" EXIT")), ""
    )
    printed = trap.partition("printf ")[2].partition(">")[0]
    return tuple(re.findall(r'"\$\{?(\w+)(?::-)?\}?"', printed))


def _exit_file(script: str) -> Path | None:
    """The file the script's EXIT trap writes, when it has one."""
    assigned = [line for line in script.splitlines() if line.startswith("tunepod_exit=")]
    has_trap = any(line.startswith("trap ") and line.endswith(" EXIT") for line in script.splitlines())
    return Path(shlex.split(assigned[0].partition("=")[2])[0]) if assigned and has_trap else None


def _time_limit_s(text: str | None) -> float | None:
    if not text:
        return None
    days, _, clock = text.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60.0 + seconds


def _named(job: SlurmJob, argv: Sequence[str]) -> bool:
    names = [arg[len("--name=") :] for arg in argv if arg.startswith("--name=")]
    return not names or job.name in names[0].split(",")


def _field(job: SlurmJob, code: str) -> str:
    return {
        "%i": job.job_id,
        "%T": job.state,
        "%r": job.reason,
        "%k": job.comment or "(null)",
        "%j": job.name,
    }[code]


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S")
