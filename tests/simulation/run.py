"""One seed, end to end: the machine room, the stores, the cluster, the orchestrators, the faults.

An *orchestrator* is a simulated process running what ``tunepod run`` runs for a tune step: the real
``Tuner`` over the real launcher (whose backend is simulated), the real leases, outbox and mirrors,
against the simulated Optuna database and MLflow store. A tune step that fails with a transient
error is retried in the same process, as Prefect's task retries do (twice); a process whose step
fails for good, or that is killed, is started again by the *operator* a little later, as a person or
a deployment would. In the seeds that draw them, *step workers* run the pipeline's train and
evaluate steps beside the tune step (``simulation.steps``), struck by the same faults and started
again by the same operator. Timed faults strike from the *chaos* process; faults at any yield point
(a crash, a stall, a clock jump) strike the process whose thread just ran, where it stopped, a lock
or a fence held or not (``_fault_at_yield_point``). The run ends once a ``tunepod run`` has returned
with the study done, the steps have run to their outcome, and no orchestrator or step worker is
left; or when an invariant breaks; or when the study fails to end ``settle_s`` after the faults
stopped. Each return or raise of ``Tuner.run()`` is shown to the referee
(``Referee.driver_returned``: the leases its process still renews).

The tune step's spec (``_settings``) follows the scenario: one objective or two, the configurations it
enqueues, its sampler, and ASHA's rungs and PBT's interval counted in the steps of one of the program's
sleeps, so that they scale with a program of thousands of steps.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import optuna

from simulation.backends import Machine
from simulation.choices import Choices
from simulation.cluster import Cluster, Program
from simulation.invariants import Referee, StudyFacts, Violation
from simulation.node_memory import MemoryTruth
from simulation.scenario import Scenario, TimedFault, scenario_of
from simulation.scheduler import Entropy, Host, Process, Scheduler, SimulationError, SimWorld, Task
from simulation.steps import Pipeline, StepSetup
from simulation.stores import FaultSwitch, MlflowTwin, OptunaDatabase, SimStorage, SimTracker
from simulation.trace import Trace
from tunepod import world
from tunepod.errors import is_transient
from tunepod.hpo import population
from tunepod.hpo.tuner import TuneContext, Tuner
from tunepod.launch.base import Launcher
from tunepod.outputs import Dataset
from tunepod.runtime import checkpoints
from tunepod.runtime.checkpoints import CheckpointInfo
from tunepod.spec.models import TuneSettings
from tunepod.tracking.outbox import TrackingOutbox

START = 1_800_000_000.0
STUDY = "sim"
METRIC = "score"
_STEP_RETRIES = 2
_MAX_STEPS = 400_000
_STALLS_S = ((0.05, 5.0), (5.0, 55.0), (61.0, 240.0))
"""An orchestrator's stalls at a yield point: a pause (a GC, a busy host), a long one within the lease
TTL (swapping, a hung NFS read), and one past it (a frozen VM, SIGSTOP), a third of them each."""
_JOB_STALL_S = (0.5, 30.0)
"""A job's stalls: a slow read of its data, a checkpoint on a busy filesystem."""


@dataclass
class Outcome:
    """What a seed's run came to."""

    scenario: Scenario
    violations: list[Violation]
    trace: Trace
    steps: int
    simulated_s: float
    orchestrators: int
    completed: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return not self.violations


optuna.logging.set_verbosity(optuna.logging.WARNING)
# Optuna warns when a step is reported twice (a retried report whose first answer was lost).
warnings.filterwarnings("ignore", category=UserWarning, module="optuna")


def run_seed(seed: int, *, scenario: Scenario | None = None, keep: Path | None = None) -> Outcome:
    """Run ``seed`` (or ``scenario``) once; ``keep``: leave its files there instead of deleting them."""
    scenario = scenario or scenario_of(seed)
    root = Path(keep) if keep is not None else _fresh_root(scenario.seed)
    try:
        return _Run(scenario, root).run()
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def _fresh_root(seed: int) -> Path:
    """The seed's folder, the same path at each run of the seed in this process: the steps' job dirs
    are keyed by what their jobs read (an evaluation, its checkpoint's path), and their names are in
    the trace, which a replay compares."""
    root = Path(scratch() or tempfile.gettempdir()) / f"tunepod-sim-{os.getpid()}-{seed}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def scratch() -> str | None:
    """A memory-backed folder where there is one: a seed writes hundreds of small durable files."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


class _Run:
    def __init__(self, scenario: Scenario, root: Path) -> None:
        self.scenario = scenario
        self.root = root
        self.trace = Trace(START)
        self.sim = Scheduler(Choices(scenario.seed), self.trace, start_time=START, latency=scenario.latency)
        self.world = SimWorld(self.sim, Entropy(scenario.seed))
        self.switch = FaultSwitch()
        self.database = OptunaDatabase()
        self.mlflow = MlflowTwin()
        self.cluster = Cluster(self.sim, scenario.program, scenario.jobs, memory=MemoryTruth(root / "shm"))
        self.settings = _settings(scenario)
        self.jobs_dir = root / "jobs" / STUDY
        self.referee = Referee(
            self.sim,
            self.cluster,
            self.database,
            self.mlflow,
            StudyFacts(
                STUDY,
                self.jobs_dir,
                scenario.num_trials,
                ("x",),
                METRIC,
                scenario.timeout_s,
                scenario.hang_timeout_s,
                scenario.max_restarts,
                scenario.startup_timeout_s,
                objectives=tuple(metric for metric, _ in scenario.objectives),
                enqueue=tuple({"x": x} for x in scenario.enqueue),
                pruner=self.settings.pruner,
            ),
        )
        self.database.on_told = self.referee.told
        self.database.on_asha = self.referee.asha_state_written
        self.sim.on_thread_death = self._thread_died
        self.sim.after_step = self._fault_at_yield_point
        self.orchestrator_hosts = [
            Host(f"orchestrator-host-{n}", f"boot-o{n}", f"pid:[o{n}]") for n in range(2)
        ]
        nodes = tuple(
            Host(f"node-{n}", f"boot-node-{n}", f"pid:[node-{n}]", skew_s=self.sim.choices.uniform(-2, 2))
            for n in range(2)
        )
        machine = Machine(self.sim, self.cluster, self.referee, root, nodes, self.orchestrator_hosts[0])
        self.backend = scenario.backend.make(machine)
        self.orchestrators: list[Process] = []
        self.pipeline: Pipeline | None = None
        self.completed = False
        self.notes: list[str] = []
        self.parent_run_id = ""
        self._job_processes: set[Process] = set()
        self._runs_seen = 0

    # ------------------------------------------------------------------------------ the run

    def run(self) -> Outcome:
        with (
            world.installed(self.world),
            _sim_files(self.sim, self._disk_full),
            _copies_refereed(self.referee),
            logs_into(self.trace, self.sim, self.root),
        ):
            try:
                self._loop()
            except SimulationError as exc:
                self.referee.violated("the simulation runs", str(exc))
            finally:
                self.world.torn_down = True
                self.sim.teardown()
        return Outcome(
            self.scenario,
            self.referee.violations,
            self.trace,
            self.sim.steps,
            self.sim.now - START,
            len(self.orchestrators),
            self.completed,
            self.notes,
        )

    def _loop(self) -> None:
        scenario = self.scenario
        self.parent_run_id = self.mlflow.new_id("pipeline-run-")
        self._start_orchestrator("first run")
        if scenario.steps:
            self.pipeline = self._pipeline()
            self.pipeline.start_worker("first run")
        helper = self.sim.start_process("operator", Host("operator", "boot-operator", "pid:[operator]"))
        helper.spawn("operator", self._operate)
        helper.spawn("chaos", lambda: self._strike(scenario.timed))
        deadline = START + scenario.fault_phase_s + scenario.settle_s
        while not self.referee.violations:
            if self.sim.now >= START + scenario.fault_phase_s and self.switch.on:
                self._faults_stop()
            if self._done():
                self.referee.settled()
                return
            if self.sim.now > deadline:
                self.referee.violated(
                    "liveness",
                    f"the study did not end {scenario.settle_s:.0f}s after the faults stopped "
                    f"({self._state()})",
                )
                return
            if self.sim.steps > _MAX_STEPS:
                self.referee.violated("liveness", f"{_MAX_STEPS} steps without an end ({self._state()})")
                return
            if not self.sim.step():
                self.referee.violated("liveness", f"every thread waits forever ({self._state()})")
                return

    def _done(self) -> bool:
        steps_done = self.pipeline is None or self.pipeline.done
        return self.completed and steps_done and not any(p.alive for p in self.orchestrators)

    def _drivers(self) -> list[Process]:
        """The processes that drive jobs: the orchestrators, and the step workers."""
        return self.orchestrators + (self.pipeline.workers if self.pipeline is not None else [])

    def _pipeline(self) -> Pipeline:
        setup = StepSetup(
            self.scenario,
            self.sim,
            self.referee,
            self.backend,
            self.mlflow,
            self.switch,
            self.root,
            self.orchestrator_hosts,
            self.parent_run_id,
        )
        return Pipeline(setup)

    def _faults_stop(self) -> None:
        self.switch.on = False
        self.cluster.faults_on = False
        self.backend.faults_stop()
        self.trace.event(self.sim.now, "fault", "faults stop")

    def _state(self) -> str:
        storage = self.database.storage
        try:
            trials = storage.get_all_trials(storage.get_study_id_from_name(STUDY), deepcopy=False)
        except KeyError:
            trials = []
        states = ", ".join(f"{t.number}:{t.state.name}" for t in trials)
        alive = [p.name for p in self._drivers() if p.alive]
        steps = "" if self.pipeline is None else f"; steps settled: {self.pipeline.settled}"
        return f"trials {states or 'none'}; orchestrators alive {alive}{steps}"

    # ------------------------------------------------------------------------------ orchestrators

    def _start_orchestrator(self, why: str) -> Process:
        hosts = self.orchestrator_hosts if self.scenario.two_hosts else self.orchestrator_hosts[:1]
        host = hosts[len(self.orchestrators) % len(hosts)]
        process = self.sim.start_process(f"orchestrator-{len(self.orchestrators) + 1}", host)
        self.orchestrators.append(process)
        self.trace.event(self.sim.now, "process", f"{process.name}: tunepod run ({why})")
        process.spawn("main", lambda: self._tunepod_run(process))
        return process

    def _tunepod_run(self, process: Process) -> None:
        ctx = self._context()
        quiet_from_the_start = not self.switch.on
        for attempt in range(_STEP_RETRIES + 1):
            try:
                self._tune(process, ctx)
            except Exception as exc:
                if is_transient(exc) and attempt < _STEP_RETRIES:
                    self.trace.event(
                        self.sim.now, "process", f"{process.name}: the tune step is retried after {exc!r}"
                    )
                    world.sleep(5.0)
                    continue
                failed = without_random_names(f"{process.name}: tunepod run fails: {exc!r}")
                self.trace.event(self.sim.now, "process", failed[:400])
                break
            else:
                # While faults strike, MLflow may be left behind, to be caught up by the next run (as
                # the run's own error says): the study's end is judged after a run wholly in quiet times.
                self.completed = quiet_from_the_start
                self.trace.event(self.sim.now, "process", f"{process.name}: tunepod run completes")
                break
        self._exit(process)

    def _tune(self, process: Process, ctx: TuneContext) -> None:
        """``Tuner.run()``, its return or raise shown to the referee (its leases)."""
        try:
            Tuner(ctx).run()
        except Exception:
            self.referee.driver_returned(process, "Tuner.run()")
            raise
        self.referee.driver_returned(process, "Tuner.run()")

    def _exit(self, process: Process) -> None:
        self.sim.exit(process, "tunepod run returned")

    def _context(self) -> TuneContext:
        scenario = self.scenario
        launcher = self.backend.launcher()
        return tune_context(
            self.settings,
            launcher,
            self.root,
            SimTracker(self.sim, self.mlflow, scenario.mlflow, self.switch),
            SimStorage(
                self.sim,
                self.database,
                write_faults=scenario.optuna_writes,
                read_faults=scenario.optuna_reads,
                switch=self.switch,
                crash_after_write=scenario.crash_after_write,
                lost_pause_answers=scenario.lost_pause_answers,
            ),
            self.parent_run_id,
        )

    def _operate(self) -> None:
        """Start ``tunepod run`` again once no orchestrator is left and the study is not done."""
        while True:
            world.sleep(30.0)
            if not self.completed and not any(p.alive for p in self.orchestrators):
                self._start_orchestrator("the operator runs it again")
            if self.pipeline is not None:
                self.pipeline.operate()

    def _strike(self, timed: tuple[TimedFault, ...]) -> None:
        for fault in timed:
            world.sleep(max(0.0, START + fault.at - self.sim.now))
            alive = [p for p in self._drivers() if p.alive]
            if fault.kind == "second_orchestrator":
                self._start_orchestrator("a second run beside the first")
            elif fault.kind == "clock_jump":
                host = self.sim.choices.pick(self.orchestrator_hosts)
                host.skew_s += fault.seconds
                self.trace.event(
                    self.sim.now, "fault", f"the clock of {host.name} jumps {fault.seconds:+.0f}s"
                )
            elif alive and fault.kind == "kill":
                self.sim.crash(self.sim.choices.pick(alive), "SIGKILL")
            elif alive and fault.kind == "stall":
                self.sim.stall(self.sim.choices.pick(alive), fault.seconds)

    def _disk_full(self) -> bool:
        """Whether this orchestrator's write meets a full disk (the jobs' filesystem stays usable)."""
        process = self.sim.process
        return (
            self.switch.on
            and process in self._drivers()
            and self.sim.choices.chance(self.scenario.disk_full_per_write)
        )

    def _fault_at_yield_point(self, task: Task) -> None:
        """A fault anywhere, while faults are on: the orchestrator that just ran is killed, stalled,
        or its host's clock jumps, where its thread stopped (inside a lock or a lease's fence, or in
        the middle of a call that takes time); a job's training process that just ran may stall."""
        process = task.process
        if not (self.switch.on and process.alive):
            return
        if process in self._drivers():
            self._orchestrator_fault(task)
        elif self._is_job(process) and self.sim.choices.chance(self.scenario.job_stall_per_step):
            self.sim.stall(process, self.sim.choices.uniform(*_JOB_STALL_S), f" at {task.waiting_for}")

    def _orchestrator_fault(self, task: Task) -> None:
        process, scenario, choices = task.process, self.scenario, self.sim.choices
        where = f"{task.name} at {task.waiting_for}"
        if choices.chance(scenario.crash_per_step):
            self.sim.crash(process, f"SIGKILL while {where}")
        elif choices.chance(scenario.stall_per_step):
            self.sim.stall(process, choices.uniform(*choices.pick(_STALLS_S)), f" while {where}")
        elif choices.chance(scenario.clock_jump_per_step):
            jump = choices.pick((-1, 1)) * choices.uniform(1.0, 300.0)
            process.host.skew_s += jump
            self.trace.event(
                self.sim.now, "fault", f"the clock of {process.host.name} jumps {jump:+.0f}s while {where}"
            )

    def _is_job(self, process: Process) -> bool:
        """Whether ``process`` runs a job's training program (the cluster's runs only ever grow)."""
        runs = self.cluster.runs
        while self._runs_seen < len(runs):
            self._job_processes.add(runs[self._runs_seen].process)
            self._runs_seen += 1
        return process in self._job_processes

    def _thread_died(self, task: object, exc: BaseException) -> None:
        self.referee.violated("no thread dies", f"{task} died: {type(exc).__name__}: {exc}")


def tune_context(
    settings: TuneSettings,
    launcher: Launcher,
    root: Path,
    tracker: SimTracker,
    storage: SimStorage,
    parent_run_id: str,
) -> TuneContext:
    """What ``tunepod run`` gives a tune step: ``settings``' study on ``launcher``, its trials' job
    dirs under ``root``, tracked and stored in the simulated MLflow and Optuna."""
    return TuneContext(
        step="search",
        settings=settings,
        launcher=launcher,
        dataset=Dataset(
            source="sim",
            path=str(root / "data"),
            num_files=0,
            num_bytes=0,
            copied_files=0,
            copied_bytes=0,
        ),
        jobs_dir=root / "jobs" / settings.study.name,
        tracker=tracker,
        outbox=TrackingOutbox(threads=1, max_backoff_s=10.0),
        parent_run_id=parent_run_id,
        pipeline="sim",
        flush_timeout_s=60.0,
        storage=storage,
    )


def _rung_at_a_sleeps_end(program: Program) -> int:
    """The units of the first sleep-ending report past step 1,000 (the last sleep's if none is):
    where Optuna, told only some steps there, may last have been told a step before it."""
    sleeps = range(1, program.sleeps)
    ends = [k * program.sleep_steps - program.stride for k in sleeps]
    return next((end for end in ends if end >= 1000), ends[-1]) + 1


def _settings(scenario: Scenario) -> TuneSettings:
    program = scenario.program
    pruner: dict[str, object] = {"kind": scenario.pruner}
    if scenario.pruner == "threshold":
        pruner["lower"] = 0.2
    if scenario.pruner == "median":
        pruner["warmup_steps"] = 1
    if scenario.pruner == "asha" and scenario.rungs_mid_sleep:
        pruner |= {"min_resource": _rung_at_a_sleeps_end(program), "reduction_factor": 3}
        pruner["max_resource"] = program.steps
    elif scenario.pruner == "asha":  # rungs at 1, 2 and 4 sleeps' steps, below a whole run
        pruner |= {"min_resource": program.sleep_steps, "reduction_factor": 2, "max_resource": program.steps}
    pbt = None
    if scenario.pruner == "pbt":  # a decision at every sleep below a whole run, the bottom half exploited
        pruner = {"kind": "none"}
        pbt = {
            "population": scenario.num_trials,
            "interval": program.sleep_steps,
            "quantile": 0.5,
            "max_resource": program.steps,
        }
    resources: dict[str, object] = {"num_nodes": scenario.num_nodes}
    if scenario.min_nodes is not None:
        resources["min_nodes"] = scenario.min_nodes
    if scenario.timeout_s is not None:
        resources["timeout_min"] = scenario.timeout_s / 60
    tiers = scenario.checkpoint_tiers
    tiers_spec = None if tiers is None else {"memory_every_steps": tiers[0], "shared_every_steps": tiers[1]}
    return TuneSettings.model_validate(
        {
            "train": {
                "entrypoint": "train.py",
                "resources": resources,
                "max_restarts": scenario.max_restarts,
                "hang_timeout_s": scenario.hang_timeout_s,
                "startup_timeout_s": scenario.startup_timeout_s,
                "checkpoints": tiers_spec,
            },
            "study": _study(scenario),
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "num_trials": scenario.num_trials,
            "num_parallel": scenario.num_parallel,
            "sampler": scenario.sampler,
            "seed": scenario.seed,
            "pruner": pruner,
            "pbt": pbt,
            "enqueue": [{"x": x} for x in scenario.enqueue],
            "poll_s": scenario.poll_s,
        }
    )


def _study(scenario: Scenario) -> dict[str, object]:
    """The study spec: one objective as ``metric`` and ``direction``, several as ``objectives``."""
    study: dict[str, object] = {
        "name": STUDY,
        "storage": "journal://unused-the-simulation-passes-its-own.log",
    }
    if len(scenario.objectives) == 1:
        (metric, direction), *_ = scenario.objectives
        return study | {"metric": metric, "direction": direction}
    return study | {"objectives": [{"metric": m, "direction": d} for m, d in scenario.objectives]}


@contextmanager
def _sim_files(sim: Scheduler, full: Callable[[], bool]) -> Iterator[None]:
    """Every atomic record write (``tunepod.runtime.files.write_bytes_atomic``, which starts with a
    temporary file) becomes a yield point that takes time (``Latency.write``): a fault may strike just
    before any record is written, or while it is; and
    when ``full()`` says so, the filesystem is full (ENOSPC) for that write. Only the simulation's
    own OS thread (where all its greenlets run) meets it: a real thread of the same process (another
    test's, under pytest) writes as usual."""
    real = tempfile.mkstemp
    simulation_thread = threading.get_ident()

    def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        if sim.current is not None and threading.get_ident() == simulation_thread:
            sim.takes("write", sim.latency.write)
            if full():
                sim.trace.event(sim.now, "fault", f"{sim.process}: a write fails, the disk is full")
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(*args, **kwargs)

    with mock.patch.object(tempfile, "mkstemp", mkstemp):
        yield


@contextmanager
def _copies_refereed(referee: Referee) -> Iterator[None]:
    """Every checkpoint copy PBT makes (``copy_newest_checkpoint`` as ``tunepod.hpo.population``
    calls it) that raises ``shutil.Error`` is shown to the referee as it raises
    (``Referee.copy_failed``), before its caller reaches a yield point. Only on the simulation's own
    OS thread, as ``_sim_files``."""
    real = checkpoints.copy_newest_checkpoint
    simulation_thread = threading.get_ident()

    def copy(
        source_dir: Path, into_dir: Path, attempts: int = 3, *, before: int | None = None
    ) -> CheckpointInfo | None:
        try:
            return real(source_dir, into_dir, attempts, before=before)
        except shutil.Error as failed:
            if threading.get_ident() == simulation_thread:
                referee.copy_failed(failed)
            raise

    with mock.patch.object(population, "copy_newest_checkpoint", copy):
        yield


class _TraceHandler(logging.Handler):
    """The orchestrators' warnings and errors, into the trace; the seed's folder named ``<root>`` so
    that two runs of a seed tell the same story."""

    def __init__(self, trace: Trace, sim: Scheduler, root: Path) -> None:
        super().__init__(logging.WARNING)
        self.trace = trace
        self.sim = sim
        self.root = str(root)

    def emit(self, record: logging.LogRecord) -> None:
        who = self.sim.current.process.name if self.sim.current is not None else "-"
        text = f"{who}: {record.levelname} {record.getMessage()}".replace(self.root, "<root>")
        self.trace.event(self.sim.now, "log", without_random_names(text)[:600])


_HIDDEN_STEP_FOLDER = re.compile(r"(\.(?:tmp|trash)-step-\S*?-)[0-9a-f]{8}")
"""A checkpoint save's or copy's hidden folder, whose name ends in random hex (``tunepod.runtime``
draws it from ``secrets``, not from the world: a job's runtime has none)."""


def without_random_names(text: str) -> str:
    """``text`` with the random part of each hidden checkpoint folder's name as ``<random>``, so that
    two runs of a seed tell the same story where an error names one (a copy that failed)."""
    return _HIDDEN_STEP_FOLDER.sub(r"\1<random>", text)


@contextmanager
def logs_into(trace: Trace, sim: Scheduler, root: Path) -> Iterator[None]:
    logger = logging.getLogger("tunepod")
    handler = _TraceHandler(trace, sim, root)
    before = (logger.propagate, logger.level)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate, _ = before
        logger.setLevel(before[1])


def describe(outcome: Outcome) -> str:
    """A failing seed's story: its scenario, what broke, and the trace up to there."""
    lines = [outcome.scenario.describe()]
    lines += [f"VIOLATION at {v.at - START:.2f}s: {v.invariant}: {v.detail}" for v in outcome.violations]
    lines.append("trace (faults, processes, jobs, stores, logs):")
    lines.append(outcome.trace.render(last=400))
    return "\n".join(lines)
