"""The pipeline's train and evaluate steps, run beside the tune step in some seeds.

A *step worker* is a simulated process running what a Prefect worker runs for those steps of
``tunepod run``: the real ``tunepod.steps.train.run`` (its job driven by the real
``tunepod.steps.jobs.run_job``, whose lease is taken by ``acquire_or_follow``) and then, when the seed
has one, the real evaluation of the trained job's checkpoint (``tunepod.steps.evaluate._evaluate``,
what ``evaluate.run`` runs per candidate on a thread pool of its own; the simulation runs its one
candidate on the worker's thread). Each gets a real ``StepContext``'s parts: the seed's launcher,
tracker and outbox, and job dirs keyed by ``job_key`` under ``<root>/jobs/pipeline/<step>/``.

A step that fails is retried twice in the same process a few seconds later, as Prefect's task
retries do; a step that fails for good ends the worker's run (the steps after it do not run). A
worker is killed, stalled and crashed as the orchestrators are, and the operator starts a new one
once none is left and the steps have not yet run to their outcome in quiet times. Every return or
raise of a step is shown to the referee: its lease (``Referee.driver_returned``) and its outcome
(``Referee.step_ended``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from simulation.backends import Backend
from simulation.invariants import Referee
from simulation.scenario import Scenario
from simulation.scheduler import Host, Process, Scheduler
from simulation.stores import FaultSwitch, MlflowTwin, SimTracker
from tunepod import world
from tunepod.launch.base import Launcher
from tunepod.launch.paths import SharedRoot
from tunepod.outputs import Dataset, TrialSet
from tunepod.spec.models import EvaluateSettings, PipelineSpec, TrainSettings
from tunepod.steps import evaluate, train
from tunepod.tracking import MlflowTracker
from tunepod.tracking.outbox import TrackingOutbox

PIPELINE = "pipeline"
_STEP_RETRIES = 2
_RETRY_DELAY_S = 5.0
_FLUSH_TIMEOUT_S = 60.0


@dataclass
class SimStepContext:
    """``tunepod.steps.context.StepContext`` over the seed's world; it notes each step's job dir."""

    spec: PipelineSpec
    launcher: Launcher
    shared: SharedRoot
    tracker: MlflowTracker
    outbox: TrackingOutbox
    run_id: str
    jobs_root: Path
    on_job_dir: Callable[[Path], None]
    dirs: dict[str, Path] = field(default_factory=dict)

    def job_dir(self, step: str, key: str) -> Path:
        path = self.jobs_root / self.spec.name / step / key
        self.dirs[step] = path
        self.on_job_dir(path)
        return path


@dataclass
class StepSetup:
    """What the step workers share: the seed's world and the steps' settings."""

    scenario: Scenario
    sim: Scheduler
    referee: Referee
    backend: Backend
    mlflow: MlflowTwin
    switch: FaultSwitch
    root: Path
    hosts: list[Host]
    parent_run_id: str


class Pipeline:
    """The step workers of one seed (see the module docstring)."""

    def __init__(self, setup: StepSetup) -> None:
        self.setup = setup
        self.workers: list[Process] = []
        self.settled = False
        """A worker that started in quiet times ran the steps to their outcome."""
        self.spec = _spec(setup)
        self.dataset = Dataset(
            source="sim", path="/sim/data", num_files=0, num_bytes=0, copied_files=0, copied_bytes=0
        )

    @property
    def done(self) -> bool:
        return self.settled and not any(worker.alive for worker in self.workers)

    def start_worker(self, why: str) -> Process:
        setup = self.setup
        hosts = setup.hosts if setup.scenario.two_hosts else setup.hosts[:1]
        host = hosts[len(self.workers) % len(hosts)]
        process = setup.sim.start_process(f"step-worker-{len(self.workers) + 1}", host)
        self.workers.append(process)
        setup.sim.trace.event(
            setup.sim.now, "process", f"{process.name}: the steps {setup.scenario.steps} ({why})"
        )
        process.spawn("main", lambda: self._work(process))
        return process

    def operate(self) -> None:
        """The operator's look: a new worker once none is left and the steps are not settled."""
        if not self.settled and not any(worker.alive for worker in self.workers):
            self.start_worker("the operator runs it again")

    # ------------------------------------------------------------------------------ a worker

    def _work(self, process: Process) -> None:
        quiet_from_the_start = not self.setup.switch.on
        ctx = self._context()
        trained: TrialSet | None = None
        for step in self.setup.scenario.steps:
            outcome = self._with_retries(process, ctx, step, trained)
            if outcome is None:
                break
            trained = outcome if isinstance(outcome, TrialSet) else trained
        # As the tune step's: the steps' end is judged after a run wholly in quiet times.
        self.settled = self.settled or quiet_from_the_start
        self.setup.sim.exit(process, "its steps returned")

    def _with_retries(
        self, process: Process, ctx: SimStepContext, step: str, trained: TrialSet | None
    ) -> object | None:
        """The step's output, retried as Prefect retries a failed task; None once it failed for good."""
        sim = self.setup.sim
        for attempt in range(_STEP_RETRIES + 1):
            try:
                return self._step(process, ctx, step, trained)
            except Exception as exc:
                again = attempt < _STEP_RETRIES
                what = "is retried after" if again else "fails"
                sim.trace.event(sim.now, "process", f"{process.name}: the {step} step {what} {exc!r}"[:400])
                if again:
                    world.sleep(_RETRY_DELAY_S)
        return None

    def _step(self, process: Process, ctx: SimStepContext, step: str, trained: TrialSet | None) -> object:
        """One call of the step; its lease and outcome shown to the referee as it returns or raises."""
        referee = self.setup.referee
        ctx.dirs.pop(step, None)
        try:
            output = self._call(ctx, step, trained)
        except Exception as exc:
            referee.driver_returned(process, f"the {step} step")
            referee.step_ended(ctx.dirs.get(step), exc)
            raise
        referee.driver_returned(process, f"the {step} step")
        referee.step_ended(ctx.dirs.get(step), None)
        return output

    def _call(self, ctx: SimStepContext, step: str, trained: TrialSet | None) -> object:
        if step == "train":
            settings = self.spec.steps["train"].with_
            assert isinstance(settings, TrainSettings)
            return train.run(ctx, "train", settings, {"data": self.dataset})
        assert trained is not None, "the evaluate step follows the train step"
        settings = _evaluate_settings(self.setup)
        return evaluate._evaluate(ctx, "evaluate", settings, trained, trained.trials[0])

    def _context(self) -> SimStepContext:
        setup = self.setup
        return SimStepContext(
            spec=self.spec,
            launcher=setup.backend.launcher(),
            shared=SharedRoot(setup.root),
            tracker=cast(
                MlflowTracker, SimTracker(setup.sim, setup.mlflow, setup.scenario.mlflow, setup.switch)
            ),
            outbox=TrackingOutbox(threads=1, max_backoff_s=10.0),
            run_id=setup.parent_run_id,
            jobs_root=setup.root / "jobs",
            on_job_dir=setup.referee.step_job_dir,
        )


def _resources(scenario: Scenario) -> dict[str, object]:
    resources: dict[str, object] = {"num_nodes": scenario.num_nodes}
    if scenario.timeout_s is not None:
        resources["timeout_min"] = scenario.timeout_s / 60
    return resources


def _spec(setup: StepSetup) -> PipelineSpec:
    """The pipeline's spec: its train step as the tune step's trials train (entrypoint, resources,
    restarts, hang and start-up timeouts), with fixed parameters. The entrypoints are written here:
    ``job_key`` hashes them."""
    scenario = setup.scenario
    entrypoint = setup.root / "train.py"
    entrypoint.write_text("# the simulated training program (simulation.cluster)\n")
    (setup.root / "evaluate.py").write_text("# the simulated evaluation (simulation.cluster)\n")
    train_job = {
        "entrypoint": str(entrypoint),
        "resources": _resources(scenario),
        "max_restarts": scenario.max_restarts,
        "hang_timeout_s": scenario.hang_timeout_s,
        "startup_timeout_s": scenario.startup_timeout_s,
    }
    return PipelineSpec.model_validate(
        {
            "name": PIPELINE,
            "tracking": {"experiment": "sim", "flush_timeout_s": _FLUSH_TIMEOUT_S},
            "steps": {
                "train": {
                    "uses": "train",
                    "with": {"train": train_job, "params": {"x": 0.5}, "metric": "score"},
                }
            },
        }
    )


def _evaluate_settings(setup: StepSetup) -> EvaluateSettings:
    return EvaluateSettings.model_validate(
        {
            "entrypoint": str(setup.root / "evaluate.py"),
            "metric": "score",
            "num_parallel": 1,
            "resources": _resources(setup.scenario),
        }
    )
