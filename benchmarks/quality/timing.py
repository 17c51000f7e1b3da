"""Time to target, read from what a study left on disk.

* The reports: every trial's ``metrics.jsonl`` in its job dir (``<root>/jobs/<study>/trial-N/``), one
  line per ``ctx.report`` with the wall-clock ``time`` of the job's rank 0 when it reported
  (``tunepod.runtime.metrics``). A report, not the trial's end, is the moment the target is reached:
  the job checkpoints the model of that epoch, so a pruned or still running trial that reported it
  has already produced such a model.
* The study's start: the ``datetime_start`` of its first trial in Optuna's storage (the moment the
  tuner asked Optuna for it, before its job was submitted); its end, for a study that never reached
  the target, the last ``datetime_complete`` (the whole budget's wall time, a censored value).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tunepod.runtime.metrics import Report, read_reports

Direction = Literal["maximize", "minimize"]


@dataclass(frozen=True)
class Goal:
    """Reach ``target`` of ``metric``: at least it when maximizing, at most it when minimizing."""

    metric: str
    direction: Direction
    target: float

    def reached_by(self, value: float) -> bool:
        return value >= self.target if self.direction == "maximize" else value <= self.target

    def describe(self) -> str:
        return f"{self.metric} {'>=' if self.direction == 'maximize' else '<='} {self.target:g}"


@dataclass(frozen=True)
class Hit:
    """The first report that reached the goal."""

    trial: int
    step: int
    value: float
    time: float
    """Seconds since the epoch, the report's own ``time``."""


def trial_reports(jobs_dir: Path) -> dict[int, list[Report]]:
    """Every trial's reports, keyed by trial number, from ``jobs_dir/trial-N/metrics.jsonl``.

    Folders the tuner set aside (``trial-N.stale-T``, a job it found from an earlier run) are left
    out: their reports belong to no trial of this run.
    """
    reports = {}
    for job_dir in jobs_dir.glob("trial-*"):
        number = job_dir.name.removeprefix("trial-")
        if number.isdigit():
            reports[int(number)] = read_reports(job_dir / "metrics.jsonl")
    return reports


def first_hit(reports: dict[int, list[Report]], goal: Goal) -> Hit | None:
    """The earliest report, over every trial, whose ``goal.metric`` reaches the target."""
    hits = [
        Hit(trial, report.step, report.metrics[goal.metric], report.time)
        for trial, trial_reports_ in reports.items()
        for report in trial_reports_
        if goal.metric in report.metrics and goal.reached_by(report.metrics[goal.metric])
    ]
    return min(hits, key=lambda hit: hit.time, default=None)


def best_value(reports: dict[int, list[Report]], goal: Goal) -> float:
    """The best value of ``goal.metric`` any trial reported (NaN when none did)."""
    values = [r.metrics[goal.metric] for rs in reports.values() for r in rs if goal.metric in r.metrics]
    if not values:
        return math.nan
    return max(values) if goal.direction == "maximize" else min(values)


@dataclass(frozen=True)
class StudySpan:
    """When a study's trials began and ended, from Optuna's storage (seconds since the epoch)."""

    start: float
    end: float | None
    """The last trial's completion; None while a trial is unfinished (a study stopped at its target)."""
    trial_starts: dict[int, float]
    pruned: int
    """Trials stopped early: PRUNED, or paused by ASHA (RUNNING) when the study was stopped."""


def study_span(storage: str, study_name: str) -> StudySpan:
    """Read the study from its storage URL as the spec names it (``journal://...``, ``sqlite:///...``)."""
    import optuna

    from tunepod.hpo.asha import is_paused
    from tunepod.hpo.study import make_storage

    study = optuna.load_study(study_name=study_name, storage=make_storage(storage))
    trials = study.get_trials(deepcopy=False)
    if not trials:
        raise ValueError(f"study {study_name!r} in {storage} holds no trial")
    starts = {t.number: t.datetime_start.timestamp() for t in trials if t.datetime_start is not None}
    completes = [t.datetime_complete for t in trials]
    end = None if any(c is None for c in completes) else max(c.timestamp() for c in completes if c)
    # Under ASHA a trial stopped at a rung stays RUNNING while paused: it counts as stopped early too.
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED or is_paused(t) for t in trials)
    return StudySpan(min(starts.values()), end, starts, pruned)


def trials_started_by(starts: Iterable[float], moment: float) -> int:
    """How many trials the study had started by ``moment``."""
    return sum(start <= moment for start in starts)
