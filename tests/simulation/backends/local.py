"""A simulated machine's processes behind the real ``LocalLauncher`` (its ``ProcessTable`` seam).

A job is what the launcher starts: the wrapper (``/bin/sh -c``, the rendered script) in a session of
its own; under it, in the wrapper's process group, the interpreter (one process) or torchrun's agent;
under the agent, the worker, in a session of its own (torch starts its workers so). The worker runs
the training program (``cluster.py``). As the kernel and those programs do:

- the wrapper ignores SIGTERM (its ``trap :``) and, once its command has exited, writes
  ``<exit code> <submission id>`` to the job dir's exit file, then exits with that code; SIGKILL ends
  it without a word;
- the agent, on SIGTERM, passes it to its worker and exits when the worker has; SIGKILLed, it is gone
  and its worker trains on, in its own session (what a killed agent leaves behind);
- the worker dies of SIGTERM (143) and of SIGKILL (137);
- a process that exited is a zombie until its parent reaps it (the orchestrator that started the
  wrapper reaps it; a wrapper whose orchestrator died is reaped by init at once); a reaped process's
  pid may be given to the next process (pids come from a small range), so a pid alone names no one;
- an exiting process's environment cannot be read (as ``/proc/<pid>/environ`` gives ESRCH);
- a fork+exec and a signal take a moment (the seed's ``Latency.syscall``: a loaded machine), the
  calling thread waiting with whatever it holds.

While faults are on, an agent may be SIGKILLed (the OOM killer, a person), leaving its worker behind,
and a wrapper may be SIGKILLed, leaving its command running without anyone to record its exit.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from signal import SIGKILL, SIGTERM, Signals

from simulation.backends import Machine, rate
from simulation.cluster import Cluster, JobRun
from simulation.invariants import Referee
from simulation.scheduler import Host, Process, Scheduler, SimEvent
from tunepod.launch.base import SUBMISSION_ID_ENV, Launcher
from tunepod.launch.local import LocalLauncher
from tunepod.launch.procfs import ProcessStat
from tunepod.runtime.files import write_bytes_atomic

_FIRST_PID = 300
_PIDS = 120
"""Pids come from [300, 420): small enough that pids are reused within a seed."""


@dataclass(frozen=True)
class LocalFaults:
    agent_killed_per_s: float = 0.0
    """Per running torchrun agent and second: SIGKILLed, its worker left training."""
    wrapper_killed_per_s: float = 0.0
    """Per running wrapper and second: SIGKILLed, its command left without anyone to record its exit."""


@dataclass(frozen=True)
class LocalSettings:
    faults: LocalFaults
    torchrun: bool
    """Jobs of two processes (torchrun and its worker) rather than one (the bare interpreter)."""
    kind: str = "local"
    strikes: bool = True
    """Whether a thread of the machine draws its faults each second. A quality run's machine has no
    faults, and its study spans hours of simulated time: no thread wakes for nothing there."""

    def describe(self) -> str:
        layout = "torchrun agent + worker" if self.torchrun else "one process"
        return f"local: {layout} per job, pids reused from a range of {_PIDS}, faults {self.faults}"

    def quiet(self) -> LocalSettings:
        return replace(self, faults=LocalFaults())

    def make(self, machine: Machine) -> LocalBackend:
        return LocalBackend(SimProcesses(machine, self))


def draw(random_: random.Random) -> LocalSettings:
    return LocalSettings(
        faults=LocalFaults(agent_killed_per_s=rate(random_, 0.01), wrapper_killed_per_s=rate(random_, 0.005)),
        torchrun=random_.random() < 0.5,
    )


class LocalBackend:
    """Each orchestrator's real ``LocalLauncher``, all on one simulated machine's process table."""

    def __init__(self, table: SimProcesses) -> None:
        self.table = table

    def launcher(self) -> Launcher:
        return LocalLauncher(
            self.table.root,
            cancel_grace_s=5.0,
            python="python3",
            direct_single_process=not self.table.settings.torchrun,
            processes=self.table,
        )

    def faults_stop(self) -> None:
        self.table.faults_on = False


@dataclass
class OsProcess:
    """One process of the simulated machine."""

    pid: int
    start_ticks: int
    pgid: int
    environ: bytes
    role: str
    """``wrapper``, ``agent`` or ``worker``."""
    job_dir: Path
    parent: Process | None
    """The simulated process that reaps it (the orchestrator that started a wrapper), if any."""
    exited: SimEvent
    exit_code: int | None = None
    zombie: bool = False
    exiting: bool = False
    child: OsProcess | None = field(default=None, repr=False)
    run: JobRun | None = field(default=None, repr=False)
    program: Process | None = field(default=None, repr=False)
    """The simulated process whose threads are this OS process's (wrapper and agent)."""

    @property
    def alive(self) -> bool:
        return self.exit_code is None


class SimProcesses:
    """The simulated machine's process table: ``tunepod.launch.local.ProcessTable``."""

    def __init__(self, machine: Machine, settings: LocalSettings) -> None:
        self.sim: Scheduler = machine.sim
        self.cluster: Cluster = machine.cluster
        self.referee: Referee = machine.referee
        self.root = machine.root
        self.settings = settings
        self.faults_on = True
        self.host: Host = machine.orchestrator_host
        self.table: dict[int, OsProcess] = {}
        self._next_pid = _FIRST_PID
        if settings.strikes:
            chaos = self.sim.start_process("oom-killer", Host("kernel", "boot-kernel", "pid:[kernel]"))
            chaos.spawn("kill", self._faults)

    # ------------------------------------------------------------------------------ the table

    def start(self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path) -> int:
        self.sim.takes("fork+exec", self.sim.latency.syscall)
        job_dir = Path(argv[5]).parent  # the wrapper's exit_final argument (local/render.py)
        live = sorted({f"local-{_submission(p.environ)}" for p in self._job_processes(job_dir)})
        self.referee.job_created(job_dir, live)
        submission = env[SUBMISSION_ID_ENV]
        wrapper = self._spawn("wrapper", job_dir, env, pgid=None, parent=self.sim.process)
        wrapper.program = self.sim.start_process(f"sh {submission[:6]}", self.host)
        command = list(argv[7:])
        wrapper.program.spawn(
            "sh", lambda: self._wrapper(wrapper, command, env, Path(argv[4]), Path(argv[5]))
        )
        self.sim.trace.event(
            self.sim.now, "job", f"local job {submission} started by {self.sim.process} (pid {wrapper.pid})"
        )
        return wrapper.pid

    def stat(self, pid: int) -> ProcessStat | None:
        self.sim.pause("stat")
        process = self.table.get(pid)
        if process is None:
            return None
        return ProcessStat(
            state="Z" if process.zombie else "S", pgid=process.pgid, start_ticks=process.start_ticks
        )

    def live(self) -> Iterator[tuple[int, ProcessStat]]:
        self.sim.pause("scan /proc")
        for process in list(self.table.values()):
            if process.alive:
                yield process.pid, ProcessStat(state="S", pgid=process.pgid, start_ticks=process.start_ticks)

    def environ(self, pid: int) -> bytes | None:
        process = self.table.get(pid)
        return process.environ if process is not None and process.alive and not process.exiting else None

    def signal(self, pid: int, signum: Signals) -> None:
        self.sim.takes(f"kill -{signum.name}", self.sim.latency.syscall)
        process = self.table.get(pid)
        if process is None or not process.alive:
            return
        # A stop of a job whose wrapper lives is a cancel; once it has recorded its exit, the signals
        # are the launcher's sweep of what the job left behind.
        wrapper = self._wrapper_of(process.job_dir)
        if wrapper is not None and wrapper.alive:
            self.referee.stop_requested(process.job_dir, f"local-{_submission(process.environ)}")
        self._deliver(process, signum)

    def wait(self, pid: int, start_ticks: int, seconds: float) -> None:
        process = self.table.get(pid)
        if process is None or process.start_ticks != start_ticks or not process.alive:
            self.sim.sleep(seconds)
        else:
            # A driver idling between two looks at its job, which read the job's dir.
            process.exited.poll_wait(seconds, (str(process.job_dir),))

    def reap(self) -> None:
        me = self.sim.process
        for process in list(self.table.values()):
            if process.zombie and (
                process.parent is me or process.parent is None or not process.parent.alive
            ):
                del self.table[process.pid]

    # ------------------------------------------------------------------------------ the programs

    def _wrapper(
        self, wrapper: OsProcess, command: list[str], env: Mapping[str, str], temp: Path, final: Path
    ) -> None:
        torchrun = "torch.distributed.run" in command
        child = self._spawn(
            "agent" if torchrun else "worker", wrapper.job_dir, env, pgid=wrapper.pgid, parent=None
        )
        wrapper.child = child
        if torchrun:
            self._agent(child, env)
        else:
            self._worker(child, env)
        child.exited.wait()
        code = child.exit_code if child.exit_code is not None else 1
        submission = env[SUBMISSION_ID_ENV]
        write_bytes_atomic(temp, f"{code} {submission}\n".encode())
        temp.replace(final)
        self._exit(wrapper, code)

    def _agent(self, agent: OsProcess, env: Mapping[str, str]) -> None:
        agent.program = self.sim.start_process(f"torchrun {agent.pid}", self.host)
        worker = self._spawn("worker", agent.job_dir, env, pgid=None, parent=None)
        agent.child = worker
        self._worker(worker, env)

        def supervise() -> None:
            worker.exited.wait()
            if agent.alive:
                self._exit(agent, worker.exit_code if worker.exit_code is not None else 1)

        agent.program.spawn("agent", supervise)

    def _worker(self, worker: OsProcess, env: Mapping[str, str]) -> None:
        job_id = f"local-{env[SUBMISSION_ID_ENV]}"

        def exited(run: JobRun) -> None:
            self._exit(worker, run.exit_code if run.exit_code is not None else 1)

        worker.run = self.cluster.start(worker.job_dir, job_id, env, self.host, exited)
        self.referee.job_started(worker.job_dir)

    def _deliver(self, process: OsProcess, signum: Signals) -> None:
        if signum is SIGKILL:
            self._die(process, 128 + SIGKILL, "SIGKILL")
        elif process.role == "worker":
            self._terminate(process)
        elif process.role == "agent" and process.child is not None:
            self._deliver(process.child, signum)  # torchrun passes it on, and exits after its worker
        # the wrapper traps SIGTERM (``trap :``) and records its command's exit

    def _terminate(self, worker: OsProcess) -> None:
        """SIGTERM: the worker dies of it (143), at once, or after a quality run's curve's ``stop_s``
        (the script saving, the interpreter tearing down) with its training over meanwhile."""
        curve = self.cluster.curve
        if curve is None or curve.stop_s <= 0:
            self._die(worker, 128 + SIGTERM, "SIGTERM")
            return
        if worker.run is not None:
            self.cluster.kill(worker.run, "SIGTERM")
            worker.run.exit_code = 128 + SIGTERM
        worker.exiting = True
        teardown = self.sim.start_process(f"teardown {worker.pid}", self.host)
        teardown.spawn("exit", lambda: self._exit_after(worker, 128 + SIGTERM, curve.stop_s))

    def _exit_after(self, process: OsProcess, code: int, seconds: float) -> None:
        self.sim.sleep(seconds)
        self._exit(process, code)

    def _die(self, process: OsProcess, code: int, how: str) -> None:
        if process.role in ("wrapper", "agent"):
            # The worker's own exit code now reaches no one (the agent passed it to the wrapper, which
            # recorded it): it is knowable only from a result file.
            for orphan in self._job_processes(process.job_dir):
                if orphan.run is not None:
                    orphan.run.exit_unrecorded = True
        if process.run is not None:
            self.cluster.kill(process.run, how)
            process.run.exit_code = code
        if process.program is not None:
            self.sim.crash(process.program, how)
        self._exit(process, code)

    def _exit(self, process: OsProcess, code: int) -> None:
        if not process.alive:
            return
        process.exit_code = code
        process.zombie = True
        process.exiting = False
        process.exited.set()
        if process.role != "wrapper":  # reaped by its own parent at once (the shell, torchrun)
            self.table.pop(process.pid, None)

    def _spawn(
        self, role: str, job_dir: Path, env: Mapping[str, str], *, pgid: int | None, parent: Process | None
    ) -> OsProcess:
        pid = self._free_pid()
        environ = b"".join(f"{name}={value}\0".encode() for name, value in env.items())
        process = OsProcess(
            pid=pid,
            start_ticks=int(self.sim.now * 100) + pid,
            pgid=pid if pgid is None else pgid,
            environ=environ,
            role=role,
            job_dir=job_dir,
            parent=parent,
            exited=SimEvent(self.sim),
        )
        self.table[pid] = process
        return process

    def _free_pid(self) -> int:
        for _ in range(_PIDS):
            pid = self._next_pid
            self._next_pid = _FIRST_PID + (self._next_pid - _FIRST_PID + 1) % _PIDS
            if pid not in self.table:
                return pid
        raise AssertionError("the simulated machine ran out of pids")

    # ------------------------------------------------------------------------------ helpers, faults

    def _job_processes(self, job_dir: Path) -> list[OsProcess]:
        return [p for p in self.table.values() if p.job_dir == job_dir and p.alive]

    def _wrapper_of(self, job_dir: Path) -> OsProcess | None:
        wrappers = [p for p in self.table.values() if p.job_dir == job_dir and p.role == "wrapper"]
        return wrappers[-1] if wrappers else None

    def _faults(self) -> None:
        faults = self.settings.faults
        while True:
            self.sim.sleep(1.0)
            if not self.faults_on:
                continue
            for process in list(self.table.values()):
                if not process.alive:
                    continue
                odds = faults.agent_killed_per_s if process.role == "agent" else 0.0
                if process.role == "wrapper":
                    odds = faults.wrapper_killed_per_s
                if self.sim.choices.chance(odds):
                    self.sim.trace.event(
                        self.sim.now,
                        "fault",
                        f"the {process.role} of {process.job_dir.name} (pid {process.pid}) is SIGKILLed",
                    )
                    self._deliver(process, SIGKILL)


def _submission(environ: bytes) -> str:
    for entry in environ.split(b"\0"):
        name, _, value = entry.partition(b"=")
        if name == SUBMISSION_ID_ENV.encode():
            return value.decode()
    return ""
