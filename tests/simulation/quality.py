"""A study's tuning quality, measured by running the real ``Tuner`` in simulated time.

    trace = run_quality_study(settings, curve, seed=0, num_parallel=4)
    hit = trace.first_reaching(lambda value: value >= 0.974)

What a search policy gains (how soon a study reaches a target, for how much training) depends on
which parameters its sampler draws, which jobs its policy stops, pauses or resumes, and when: all of
that is the tuner's, so it is measured on the tuner itself, never on a copy. The study is ``settings``
(its sampler, pruner, ASHA or PBT policy and seed) run by the real ``Tuner`` over the real
``LocalLauncher`` as the lifecycle simulation runs it (``simulation.run``), on one simulated machine
of ``num_parallel`` slots. Only the training is a model: each trial's job trains the steps of a
``CurveModel`` for its parameters, each step taking the curve's time, reporting and checkpointing
every step (a paused or stopped job resumes after its last report: no step is trained twice), after
the curve's start-up and before its exit (or, stopped, between its stop signal and its exit).

The world is quiet and quick: no fault, one orchestrator, no clock skew. A call to Optuna, MLflow or
the machine's kernel takes no time (``scheduler.Latency``'s defaults): a study on a local database
answers in milliseconds, against training steps of seconds, and what a job costs around its
training is the curve's ``startup_s``, ``exit_s`` and ``stop_s``, measured on real jobs. The tuner's
polls, leases and outbox run as they ship (``poll_s`` is the spec's): a decision lands at the first
poll after the report that prompts it. The lifecycle simulation's referee watches the jobs as they
are created and stopped, and a violation fails the run.

Left out, behind switches the lifecycle simulation keeps on: the machine's fault thread, the jobs'
heartbeats between steps, yield points at clock readings, and the looks that could see nothing new
(*lazy polls*, ``scheduler``): a driver's look at its job is skipped until its job reports or ends,
and the tuner's loop's until a trial is created or written. One thing a skipped look did is lost: it
refreshed the launcher's status cache, which every driver shares, so a stopped job's end may be seen
up to the launcher's cancel poll (50 ms here) later. With the drivers' ties broken alike and that
poll shortened, lazy and every-look traces agree for no pruner, median, Hyperband, ASHA and PBT.
A run-time limit needs every look (``every_poll``, taken whenever the spec sets
``resources.timeout_min``), and a step longer than ``train.hang_timeout_s`` (or a start-up longer
than ``train.startup_timeout_s``) is refused without it: the real tuner would stop that job as hung.

The run stops once the tuner returns (the study is done), or once the budget is spent:
``budget_steps`` steps trained by all jobs together, or ``budget_s`` simulated seconds; reports past
the budget are not counted. ``stop`` ends it after the first report it holds for (a benchmark's
target reached).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from simulation.backends import Machine
from simulation.backends.local import LocalFaults, LocalSettings
from simulation.choices import Choices
from simulation.cluster import Cluster, CurveModel, JobFaults, JobRun, Program
from simulation.invariants import Referee, StudyFacts
from simulation.run import START, logs_into, scratch, tune_context
from simulation.scheduler import Entropy, Host, Scheduler, SimulationError, SimWorld, Task
from simulation.stores import Faults, FaultSwitch, MlflowTwin, OptunaDatabase, SimStorage, SimTracker
from simulation.trace import Trace
from tunepod import world
from tunepod.hpo.asha import is_paused
from tunepod.hpo.endings import ending_of
from tunepod.hpo.tuner import OUTCOME, Tuner
from tunepod.spec.models import TrainJob, TuneSettings

__all__ = ["CurveModel", "JobSpan", "QualityTrace", "TraceReport", "outcome_of", "run_quality_study"]


@dataclass(frozen=True)
class TraceReport:
    """One report of a trial's job, as the job appended it."""

    at_s: float
    """Simulated seconds since the study started."""
    trial: int
    step: int
    value: float
    steps_trained: int
    """Steps trained by all the study's jobs up to this report, this one included."""


@dataclass(frozen=True)
class JobSpan:
    """One run of a trial's job, from its process's start to its end (None: still running when the
    run stopped), and the step it started training at (None: it never reached its training)."""

    trial: int
    started_s: float
    ended_s: float | None
    first_step: int | None


@dataclass(frozen=True)
class QualityTrace:
    """What a quality run saw: every report in time order, every job run, and each trial's outcome."""

    reports: tuple[TraceReport, ...]
    jobs: tuple[JobSpan, ...]
    outcomes: Mapping[int, str]
    """Trial number -> COMPLETE, PRUNED, EXPLOITED (PBT), PAUSED (ASHA), FAIL, or RUNNING (the run
    stopped while it trained): ``outcome_of`` its trial."""
    params: Mapping[int, Mapping[str, Any]]
    """Trial number -> the parameters it was asked with."""
    simulated_s: float
    """Seconds from the study's start to its end, or to where the budget or ``stop`` ended it."""
    ended_by: str
    """``study`` (the tuner returned), ``budget`` or ``stop``."""

    @property
    def steps_trained(self) -> int:
        return self.reports[-1].steps_trained if self.reports else 0

    def count(self, *outcomes: str) -> int:
        """How many trials ended (by the end of the run) as one of ``outcomes``."""
        return sum(outcome in outcomes for outcome in self.outcomes.values())

    def first_reaching(self, reached: Callable[[float], bool]) -> TraceReport | None:
        """The first report whose value ``reached`` holds for (a target), if any."""
        return next((report for report in self.reports if reached(report.value)), None)


def run_quality_study(
    settings: TuneSettings,
    workload: CurveModel,
    *,
    seed: int,
    num_parallel: int,
    budget_steps: int | None = None,
    budget_s: float | None = None,
    stop: Callable[[TraceReport], bool] | None = None,
    every_poll: bool = False,
) -> QualityTrace:
    """Run ``settings``' study, ``num_parallel`` trials at a time, each training ``workload``.
    ``seed`` is the study's (it replaces ``settings.seed``) and the scheduler's: one seed, one trace.
    See the module docstring for the budgets, ``stop`` and ``every_poll``."""
    study = settings.with_num_parallel(num_parallel).model_copy(update={"seed": seed})
    every_poll = every_poll or study.train.resources.timeout_min is not None
    curve = workload if every_poll else _WithinLimits(workload, study.train)
    root = Path(tempfile.mkdtemp(prefix=f"tunepod-quality-{seed}-", dir=scratch()))
    try:
        run = _QualityRun(study, curve, seed, root, _Budget(budget_steps, budget_s, stop))
        run.sim.lazy_polls = not every_poll
        return run.run()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class _WithinLimits:
    """``curve``, refusing what lazy polls would not see as the real tuner does: a start-up or a step
    its watchdog would stop as hung (each look in between would have found it idle longer)."""

    curve: CurveModel
    train: TrainJob

    @property
    def num_steps(self) -> int:
        return self.curve.num_steps

    @property
    def startup_s(self) -> float:
        limit = self.train.startup_timeout_s
        if limit is not None and self.curve.startup_s >= limit:
            raise ValueError(
                _past_limit(f"a start-up of {self.curve.startup_s:g} s", "startup_timeout_s", limit)
            )
        return self.curve.startup_s

    @property
    def exit_s(self) -> float:
        return self.curve.exit_s

    @property
    def stop_s(self) -> float:
        return self.curve.stop_s

    def value(self, params: Mapping[str, Any], step: int) -> float:
        return self.curve.value(params, step)

    def step_s(self, params: Mapping[str, Any], step: int) -> float:
        seconds = self.curve.step_s(params, step)
        limit = self.train.hang_timeout_s
        if limit is not None and seconds >= limit:
            raise ValueError(
                _past_limit(f"step {step} of {dict(params)} takes {seconds:g} s", "hang_timeout_s", limit)
            )
        return seconds


def _past_limit(what: str, setting: str, limit: float) -> str:
    return (
        f"{what}, past train.{setting} ({limit:g} s): the tuner stops such a job as hung; fix: raise "
        f"train.{setting}, or pass every_poll=True to see the tuner stop it (every look simulated)"
    )


@dataclass(frozen=True)
class _Budget:
    steps: int | None
    seconds: float | None
    stop: Callable[[TraceReport], bool] | None


@dataclass
class _Tally:
    """The reports counted so far; once counting has ended, why and when."""

    reports: list[TraceReport] = field(default_factory=list)
    ended_by: str = ""
    ended_at_s: float = 0.0

    def end(self, why: str, at_s: float) -> None:
        if not self.ended_by:
            self.ended_by, self.ended_at_s = why, at_s


class _QualityRun:
    def __init__(
        self, settings: TuneSettings, curve: CurveModel, seed: int, root: Path, budget: _Budget
    ) -> None:
        self.settings = settings
        self.budget = budget
        self.root = root
        self.trace = Trace(START)
        self.sim = Scheduler(Choices(seed), self.trace, start_time=START)
        self.sim.on_thread_death = self._thread_died
        self.world = SimWorld(self.sim, Entropy(seed), clock_yields=False)
        self.database = OptunaDatabase()
        self.mlflow = MlflowTwin()
        program = Program(
            steps=curve.num_steps,
            step_s=0.0,  # each step takes the curve's time
            writes_result=False,  # a trial's value is its last report's
            metrics=(settings.study.primary.metric,),
        )
        self.cluster = Cluster(
            self.sim,
            program,
            JobFaults(),
            faults_on=False,
            curve=curve,
            on_report=self._reported,
            heartbeats=False,
        )
        self.referee = self._referee()
        self.host = Host("orchestrator-host", "boot-o", "pid:[o]")
        machine = Machine(self.sim, self.cluster, self.referee, root, (), self.host)
        self.backend = LocalSettings(LocalFaults(), torchrun=False, strikes=False).make(machine)
        self.tally = _Tally()
        self.died: BaseException | None = None

    def _referee(self) -> Referee:
        settings, train = self.settings, self.settings.train
        facts = StudyFacts(
            study=settings.study.name,
            jobs_dir=self.root / "jobs" / settings.study.name,
            num_trials=settings.num_trials,
            params=tuple(settings.space),
            metric=settings.study.primary.metric,
            timeout_s=None if train.resources.timeout_min is None else train.resources.timeout_min * 60,
            hang_timeout_s=train.hang_timeout_s,
            max_restarts=train.max_restarts,
            startup_timeout_s=train.startup_timeout_s,
            pruner=settings.pruner,
        )
        return Referee(self.sim, self.cluster, self.database, self.mlflow, facts)

    def run(self) -> QualityTrace:
        with world.installed(self.world), logs_into(self.trace, self.sim, self.root):
            try:
                self.sim.start_process("orchestrator", self.host).spawn("main", self._tune)
                self._loop()
                return self._traced()
            finally:
                self.world.torn_down = True
                self.sim.teardown()

    def _loop(self) -> None:
        seconds = self.budget.seconds
        while not self.tally.ended_by:
            if not self.sim.step():
                raise SimulationError(
                    f"every thread waits forever; the last events:\n{self.trace.render(last=30)}"
                )
            if self.died is not None:
                raise self.died  # a curve past the spec's limits (``_WithinLimits``), or a bug
            if self.referee.violations:
                violation = self.referee.violations[0]
                raise SimulationError(f"the quality run broke {violation.invariant}: {violation.detail}")
            if seconds is not None and self.sim.now - START > seconds:
                self.tally.end("budget", seconds)

    def _tune(self) -> None:
        quiet = FaultSwitch(on=False)
        tracker = SimTracker(self.sim, self.mlflow, Faults(), quiet)
        storage = SimStorage(
            self.sim, self.database, write_faults=Faults(), read_faults=Faults(), switch=quiet
        )
        launcher = self.backend.launcher()
        Tuner(tune_context(self.settings, launcher, self.root, tracker, storage, "quality-run")).run()
        self.tally.end("study", self.sim.now - START)

    def _reported(self, run: JobRun, step: int, metrics: Mapping[str, float]) -> None:
        tally, budget = self.tally, self.budget
        at_s = self.sim.now - START
        if tally.ended_by or (budget.seconds is not None and at_s > budget.seconds):
            return
        value = metrics[self.settings.study.primary.metric]
        report = TraceReport(at_s, _trial_of(run), step, value, len(tally.reports) + 1)
        tally.reports.append(report)
        if budget.steps is not None and report.steps_trained >= budget.steps:
            tally.end("budget", at_s)
        elif budget.stop is not None and budget.stop(report):
            tally.end("stop", at_s)

    def _traced(self) -> QualityTrace:
        jobs = tuple(
            JobSpan(
                _trial_of(run),
                run.started_at - START,
                None if run.ended_at is None else run.ended_at - START,
                run.first_step,
            )
            for run in self.cluster.runs
        )
        storage = self.database.storage
        trials = storage.get_all_trials(storage.get_study_id_from_name(self.settings.study.name))
        outcomes = {trial.number: outcome_of(trial) for trial in trials}
        params = {trial.number: dict(trial.params) for trial in trials}
        tally = self.tally
        return QualityTrace(tuple(tally.reports), jobs, outcomes, params, tally.ended_at_s, tally.ended_by)

    def _thread_died(self, task: Task, exc: BaseException) -> None:
        self.died = exc


def outcome_of(trial: FrozenTrial) -> str:
    """How a trial stands, in the words of ``QualityTrace.outcomes`` (a real study's trial too)."""
    if is_paused(trial):
        return "PAUSED"
    if trial.state not in OUTCOME:
        return trial.state.name
    return ending_of(trial, OUTCOME[trial.state])


def _trial_of(run: JobRun) -> int:
    """The trial number of a run, from its job dir (``<jobs>/<study>/trial-<n>``)."""
    return int(run.job_dir.name.removeprefix("trial-"))
