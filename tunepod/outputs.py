"""The typed values steps hand to the steps that need them.

They are plain pydantic models, so Prefect can pass them between tasks and a later process can read
them back from JSON.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

TrialOutcome = Literal["COMPLETE", "PRUNED", "FAIL", "PAUSED"]
"""PAUSED: a trial ASHA stopped after its checkpoint, RUNNING in Optuna until promoted or pruned."""
TrialEnding = Literal["COMPLETE", "PRUNED", "FAIL", "PAUSED", "EXPLOITED"]
"""How a trial ended, told apart where the outcome is one: EXPLOITED is PBT's PRUNED."""


class FsxImport(BaseModel):
    """How a dataset came into FSx for Lustre: the association and the import task that linked it."""

    file_system_id: str
    file_system_path: str = Field(description="The dataset's folder inside the file system.")
    association_id: str
    import_task_id: str
    num_imported_files: int = Field(description="Files whose metadata the import task brought in.")
    num_failed_files: int
    num_preloaded_files: int | None = Field(None, description="Files restored by the preload job, if run.")


class Dataset(BaseModel):
    """A dataset staged onto the shared filesystem (output of ``stage``).

    For an FSx target, ``copied_files`` counts the files the import task brought in and
    ``copied_bytes`` is 0: FSx imports metadata, and file contents load on first read (or preload).
    """

    source: str
    path: str = Field(description="Absolute path on the shared filesystem.")
    num_files: int
    num_bytes: int
    copied_files: int
    copied_bytes: int
    fsx: FsxImport | None = Field(None, description="Set when the target is fsx://<file-system-id>/.")


class TrialRecord(BaseModel):
    """One finished training job: a tune trial or a train step's single run."""

    number: int
    outcome: TrialOutcome
    params: dict[str, object]
    value: float | None = Field(None, description="The (primary) objective's value.")
    values: dict[str, float] = Field(
        default_factory=dict, description="Every objective's value, by metric (multi-objective studies)."
    )
    last_step: int | None = None
    run_id: str | None = Field(None, description="The trial's MLflow child run.")
    job_id: str | None = None
    job_dir: str
    checkpoint_dir: str
    model_id: str | None = Field(None, description="MLflow logged model of the final checkpoint.")
    error: str | None = None
    feasible: bool | None = Field(
        None, description="A completed trial of a study with constraints: whether it met them all."
    )
    ending: TrialEnding | None = Field(None, description="How it ended, where that says more than outcome.")
    why: str = Field("", description="Why it ended so, and at which step, for people (tunepod.hpo.endings).")


class Goal(BaseModel):
    """One objective of a study: a metric and which way is better."""

    metric: str
    direction: Literal["maximize", "minimize"]

    def sign(self) -> float:
        """Multiply a value by it and smaller is better."""
        return -1.0 if self.direction == "maximize" else 1.0


class TrialSet(BaseModel):
    """The trials of a ``tune`` step (or the single run of a ``train`` step) with their data.

    ``metric`` and ``direction`` are the primary objective; ``objectives`` lists every objective of a
    multi-objective study (empty for one objective).
    """

    step: str
    study: str | None
    metric: str
    direction: Literal["maximize", "minimize"]
    dataset: Dataset
    trials: list[TrialRecord]
    objectives: list[Goal] = Field(default_factory=list)

    def completed(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.outcome == "COMPLETE"]

    def eligible(self) -> list[TrialRecord]:
        """The completed trials that met the study's constraints: the only ones ranked, evaluated,
        trained from or registered."""
        return [t for t in self.completed() if t.feasible is not False]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def best(self, k: int = 1) -> list[TrialRecord]:
        """The ``k`` best eligible trials, best first (ties by trial number; no value sorts last).

        With several objectives "best" is the Pareto front first, ordered by the primary objective,
        then the dominated trials by the primary objective: the steps downstream (evaluate's
        ``top_k``, a train step's best parameters) take the front's trials before any other.
        """
        primary = Goal(metric=self.metric, direction=self.direction)
        front = {t.number for t in self.pareto_front()} if self.multi_objective else set()

        def rank(t: TrialRecord) -> tuple[bool, bool, float, int]:
            return (t.number not in front, t.value is None, primary.sign() * (t.value or 0.0), t.number)

        return sorted(self.eligible(), key=rank)[:k]

    def pareto_front(self) -> list[TrialRecord]:
        """The eligible trials no other eligible trial dominates (better or equal in every
        objective, better in one), by trial number. One objective: the best trials (ties kept)."""
        goals = self.objectives or [Goal(metric=self.metric, direction=self.direction)]
        # Signed so that smaller is better in every objective; trials missing a value stay off the front.
        scored = [(t, tuple(g.sign() * self.value_of(t, g.metric) for g in goals)) for t in self.eligible()]
        scored = [(t, v) for t, v in scored if all(math.isfinite(x) for x in v)]

        def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
            return all(x <= y for x, y in zip(a, b, strict=True)) and a != b

        return [t for t, v in scored if not any(dominates(w, v) for _, w in scored)]

    def value_of(self, trial: TrialRecord, metric: str) -> float:
        """``trial``'s value of objective ``metric`` (NaN when it has none)."""
        if metric in trial.values:
            return trial.values[metric]
        if metric == self.metric and trial.value is not None:
            return trial.value
        return math.nan

    def count(self, outcome: TrialOutcome) -> int:
        return sum(1 for t in self.trials if t.outcome == outcome)


class Candidate(BaseModel):
    """One evaluated checkpoint."""

    trial: TrialRecord
    value: float
    eval_job_dir: str


class Evaluation(BaseModel):
    """Output of ``evaluate``: the candidates, best first."""

    step: str
    metric: str
    direction: Literal["maximize", "minimize"]
    candidates: list[Candidate]

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


class Registration(BaseModel):
    """Output of ``register``: the version created and whether the alias moved to it."""

    model: str
    version: str
    alias: str
    alias_moved: bool
    previous_version: str | None
    previous_value: float | None
    value: float
    metric: str


class ExportedCheckpoint(BaseModel):
    """One trial's checkpoint folder, exported to S3."""

    trial: int
    run_id: str | None = Field(None, description="The trial's MLflow run.")
    checkpoint_dir: str = Field(description="The folder on the file system.")
    s3_uri: str = Field(description="Where its files are in S3 (a prefix ending in /).")


class Export(BaseModel):
    """Output of ``export``: the checkpoints now in S3, and the FSx tasks that put them there."""

    step: str
    file_system_id: str
    association_id: str
    s3_prefix: str
    checkpoints: list[ExportedCheckpoint]
    export_task_ids: list[str] = Field(description="One export task per 100 folders (FSx's limit).")
    num_exported_files: int = Field(description="New or changed files the export tasks wrote to S3.")
    release_task_ids: list[str] = Field(default_factory=list, description="Empty unless release: true.")
    num_released_files: int | None = None


StepOutput = Dataset | TrialSet | Evaluation | Registration | Export
