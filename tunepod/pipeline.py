"""A pipeline run: the spec, its DAG, the launcher, and the MLflow parent run its steps share.

``flows/pipeline.py`` walks the DAG with Prefect and calls ``PipelineRun.run_step`` for each step;
nothing here knows about Prefect, so the same run can be driven by any orchestrator (or a test).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from tunepod import watch
from tunepod.dag import Dag, build_dag
from tunepod.launch.base import Launcher
from tunepod.launch.factory import make_launcher
from tunepod.launch.paths import SharedRoot
from tunepod.metrics import PipelineMetrics, open_pipeline_metrics
from tunepod.outputs import Evaluation, Registration, StepOutput, TrialRecord, TrialSet
from tunepod.spec.loader import dump_spec, load_spec, shown_override, spec_hash
from tunepod.spec.models import PipelineSpec
from tunepod.steps import run_step
from tunepod.stores import redacted
from tunepod.tracking import MlflowTracker
from tunepod.tracking import tags as tag_names
from tunepod.tracking.outbox import TrackingOutbox, sync_threads_for

if TYPE_CHECKING:
    from tunepod.hpo.tuner import TrialSubmitter

log = logging.getLogger(__name__)

SUMMARY_ROWS = 100
"""A tune step's trials in a run's summary (printed, returned by the flow, published to Prefect as
its trial table): every trial up to this many, else the best this many. Prefect refuses an event
past 1.5 MB, and a table artifact's event carries the table; every trial of a study is in MLflow
(``<step>/trials.json`` on the pipeline run, and one run per trial)."""


@dataclass
class PipelineRun:
    """One run of one spec. Thread safe: steps running concurrently share it read-only."""

    spec: PipelineSpec
    source: str
    dag: Dag
    launcher: Launcher
    shared: SharedRoot
    tracker: MlflowTracker
    outbox: TrackingOutbox
    """Where jobs' records wait for MLflow (see ``tunepod.tracking.outbox``); closed by finish."""
    run_id: str
    metrics: PipelineMetrics | None = None
    """The run's Prometheus side (the /metrics endpoint when the spec asks for one); closed by finish."""

    @classmethod
    def start(
        cls,
        spec_path: str | Path,
        overrides: list[str] | None = None,
        *,
        tags: Mapping[str, str] | None = None,
    ) -> PipelineRun:
        """Validate the spec, then open the MLflow parent run (nothing starts for an invalid spec)."""
        spec = load_spec(spec_path, overrides or [])
        dag = build_dag(spec)
        tracker = MlflowTracker(spec.tracking.uri, spec.tracking.experiment)
        run_id = tracker.start_run(
            spec.name,
            tags={
                tag_names.PIPELINE: spec.name,
                tag_names.SPEC: str(spec_path),
                tag_names.SPEC_HASH: spec_hash(spec),
                # An override may set a store URI or a credential: the tag, like every value MLflow
                # shows, holds neither.
                tag_names.OVERRIDES: redacted(
                    " ".join(map(shown_override, overrides or [])),
                    *spec.store_uris(),
                    values=spec.secret_values(),
                ),
                tag_names.GIT_SHA: _git_sha(),
                **(tags or {}),
            },
        )
        tracker.log_text(run_id, dump_spec(spec), "spec.yaml")
        shared = SharedRoot(Path(spec.launcher.root))
        metrics = open_pipeline_metrics(spec.metrics, pipeline=spec.name, run_id=run_id)
        launcher = make_launcher(spec.launcher)
        outbox = TrackingOutbox(threads=sync_threads_for(spec.tracking.uri))
        return cls(spec, str(spec_path), dag, launcher, shared, tracker, outbox, run_id, metrics)

    def run_step(
        self, name: str, inputs: Mapping[str, StepOutput], *, submit_trial: TrialSubmitter | None = None
    ) -> StepOutput:
        """Run step ``name`` with the outputs of the steps it needs (keyed by step name)."""
        uses = self.spec.steps[name].uses
        log.info("step %s (%s) starting", name, uses)
        watch.step_started(name, uses)
        ok = False
        try:
            with watch.in_step(name):
                output = run_step(self, name, inputs, submit_trial=submit_trial)
            ok = True
            return output
        finally:
            watch.step_ended(name, ok)

    def job_dir(self, step: str, key: str) -> Path:
        """The job dir of one job of ``step`` (an evaluation, a train run): keyed by what the job is,
        so that a retry or a rerun of the step finds the job again (``tunepod.steps.jobs``)."""
        return self.shared.jobs_dir(self.spec.name, step, key)

    def finish(self, ok: bool) -> None:
        """End the pipeline run: what jobs reported reaches MLflow first (bounded), then the run ends."""
        try:
            self.outbox.flush(self.spec.tracking.flush_timeout_s)
            self.tracker.end_run(self.run_id, "FINISHED" if ok else "FAILED")
        finally:
            self.outbox.close()
            if self.metrics is not None:
                self.metrics.close()

    def summary(self, outputs: Mapping[str, StepOutput]) -> PipelineSummary:
        return PipelineSummary.of(self, outputs)


class TrialRow(BaseModel):
    number: int
    outcome: str
    """How the trial ended (``TrialRecord.ending``): EXPLOITED apart from PRUNED."""
    value: float | None
    params: dict[str, object]
    run_id: str | None
    values: dict[str, float] = {}
    pareto_front: bool | None = None
    """Whether it is on a multi-objective study's Pareto front; None where that is not known yet."""
    feasible: bool | None = None

    @classmethod
    def of(cls, trial: TrialRecord, pareto_front: bool | None = None) -> TrialRow:
        return cls(
            number=trial.number,
            outcome=trial.ending or trial.outcome,
            value=trial.value,
            params=trial.params,
            run_id=trial.run_id,
            values=trial.values,
            pareto_front=pareto_front,
            feasible=trial.feasible,
        )

    def table_row(self, objectives: Sequence[str]) -> dict[str, object]:
        """One row of a trial table (the live one of a tune step, the final one of a pipeline): every
        objective's value (and the front's mark, once known) in a multi-objective study, the
        objective's value otherwise, whether it met the constraints (if any), then the parameters."""
        values: dict[str, object] = {"value": self.value}
        if objectives:
            values = {m: self.values.get(m) for m in objectives}
            if self.pareto_front is not None:
                values["pareto_front"] = self.pareto_front
        if self.feasible is not None:
            values["feasible"] = self.feasible
        params = {k: str(v) for k, v in self.params.items()}
        return {"trial": self.number, "outcome": self.outcome, **values, **params}


class LiveTable:
    """The rows of the ``size`` trials that ended last (a trial's newer row replaces its older one),
    and how many trials have finished, counted as rows come (a trial paused, then pruned, counts
    once): what a live view publishes, bounded whatever the study's size."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._latest: OrderedDict[int, dict[str, object]] = OrderedDict()
        self._finished: set[int] = set()
        self._seen: set[int] = set()

    def put(self, number: int, row: dict[str, object], *, finished: bool) -> None:
        """Trial ``number``'s newest row; ``finished``: it ended for good (not paused, not errored)."""
        self._latest.pop(number, None)
        self._latest[number] = row
        if len(self._latest) > self._size:
            self._latest.popitem(last=False)
        self._seen.add(number)
        if finished:
            self._finished.add(number)

    def rows(self) -> list[dict[str, object]]:
        """The latest rows, by trial number."""
        return [self._latest[n] for n in sorted(self._latest)]

    @property
    def num_rows(self) -> int:
        return len(self._latest)

    @property
    def num_seen(self) -> int:
        """Trials with a row, shown or not."""
        return len(self._seen)

    @property
    def num_finished(self) -> int:
        return len(self._finished)


class PipelineSummary(BaseModel):
    """What a finished run hands back to its caller (the CLI prints it; the flow returns it)."""

    pipeline: str
    run_id: str
    tracking_uri: str
    """Shown ``redacted``: the summary is printed and returned by the flow."""
    experiment_id: str
    mlflow_ui_command: str
    """How to serve the MLflow UI over a local store (empty when the tracking URI is a server)."""
    run_url: str
    trials: list[TrialRow]
    """Every trial of each tune step, or its ``SUMMARY_ROWS`` best when it has more."""
    num_trials: int = 0
    """Every trial of every tune step, shown in ``trials`` or not."""
    metric: str | None = None
    objectives: list[str] = Field(default_factory=list, description="A multi-objective study's metrics.")
    num_completed: int = 0
    num_pruned: int = 0
    num_failed: int = 0
    best: TrialRow | None = None
    evaluation: dict[str, float] = {}
    registration: Registration | None = None

    def trials_left_out(self) -> str | None:
        """What the summary's table leaves out, and where every trial is; None when it shows all."""
        if len(self.trials) >= self.num_trials:
            return None
        return (
            f"showing the {len(self.trials)} best of {self.num_trials:,} trials; every trial is in MLflow "
            "(<step>/trials.json on the pipeline run, and a run per trial)"
        )

    @classmethod
    def of(cls, run: PipelineRun, outputs: Mapping[str, StepOutput]) -> PipelineSummary:
        trial_sets = [o for o in outputs.values() if isinstance(o, TrialSet)]
        trials = [t for ts in trial_sets for t in ts.trials]
        front = {(ts.step, t.number) for ts in trial_sets if ts.multi_objective for t in ts.pareto_front()}
        rows = [
            TrialRow.of(t, pareto_front=(ts.step, t.number) in front if ts.multi_objective else None)
            for ts in trial_sets
            for t in shown_trials(ts)
        ]
        best = trial_sets[0].best(1) if trial_sets else []
        evaluations = [o for o in outputs.values() if isinstance(o, Evaluation)]
        registrations = [o for o in outputs.values() if isinstance(o, Registration)]
        return cls(
            pipeline=run.spec.name,
            run_id=run.run_id,
            tracking_uri=redacted(run.tracker.tracking_uri),
            experiment_id=run.tracker.experiment_id,
            mlflow_ui_command=_ui_command(run.tracker.tracking_uri),
            run_url=run.tracker.run_url(run.run_id, run.spec.tracking.browse_url),
            trials=rows,
            num_trials=len(trials),
            metric=trial_sets[0].metric if trial_sets else None,
            objectives=[g.metric for g in trial_sets[0].objectives] if trial_sets else [],
            num_completed=sum(1 for t in trials if t.outcome == "COMPLETE"),
            num_pruned=sum(1 for t in trials if t.outcome == "PRUNED"),
            num_failed=sum(1 for t in trials if t.outcome == "FAIL"),
            best=next((r for r in rows if best and r.number == best[0].number), None),
            evaluation={f"trial-{c.trial.number}": c.value for e in evaluations for c in e.candidates},
            registration=registrations[0] if registrations else None,
        )


def shown_trials(trials: TrialSet) -> list[TrialRecord]:
    """The trials a summary shows: all of them, in order, up to ``SUMMARY_ROWS``; else the best."""
    return trials.trials if len(trials.trials) <= SUMMARY_ROWS else trials.best(SUMMARY_ROWS)


def _ui_command(tracking_uri: str) -> str:
    """The command that serves the MLflow UI over a local store; empty for a tracking server, which
    serves its UI itself. A database store's password shows as ``***``, to be typed in its place: the
    command is printed, and published as a Prefect artifact."""
    if tracking_uri.startswith(("http://", "https://")):
        return ""
    return f"{_mlflow_cli()} ui --backend-store-uri {redacted(tracking_uri)}"


def _mlflow_cli() -> str:
    """``mlflow`` as the user can type it: the one beside this interpreter when it is not on PATH."""
    beside = Path(sys.executable).parent / "mlflow"
    if shutil.which("mlflow") == str(beside) or not beside.exists():
        return "mlflow"
    return str(beside)


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()
