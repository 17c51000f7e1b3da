"""The quality run (``simulation.quality``): the real tuner on a known curve, in simulated time. Its
trace accounts for every step trained once, keeps to the study's slots, shows ASHA's pauses and
promotions, stops at a budget, and replays exactly from its seed; skipping the looks that could see
nothing new changes nothing where no two jobs tie."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
from simulation.quality import JobSpan, QualityTrace, run_quality_study

from tunepod.spec.models import TuneSettings

NUM_STEPS = 6


@dataclass(frozen=True)
class Rising:
    """Rises to ``x`` over the steps; a step of a trial with a higher ``x`` takes longer, so that no
    two jobs report at one instant."""

    num_steps: int = NUM_STEPS
    startup_s: float = 2.0
    exit_s: float = 0.5
    stop_s: float = 0.3

    def value(self, params: Mapping[str, Any], step: int) -> float:
        return float(params["x"]) * (1.0 - 0.5 ** (step + 1))

    def step_s(self, params: Mapping[str, Any], step: int) -> float:
        return 1.0 + float(params["x"])


def study(pruner: dict[str, object], *, num_trials: int = 8) -> TuneSettings:
    return TuneSettings.model_validate(
        {
            "train": {"entrypoint": "train.py", "resources": {"num_nodes": 1}},
            "study": {
                "name": "quality",
                "storage": "journal://unused.log",
                "metric": "acc",
                "direction": "maximize",
            },
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "num_trials": num_trials,
            "num_parallel": 2,
            "sampler": "random",
            "seed": 0,
            "pruner": pruner,
        }
    )


ASHA = {"kind": "asha", "min_resource": 2, "reduction_factor": 2, "max_resource": NUM_STEPS}


@pytest.fixture(scope="module")
def asha_trace() -> QualityTrace:
    return run_quality_study(study(ASHA), Rising(), seed=3, num_parallel=2)


def most_at_once(jobs: tuple[JobSpan, ...], end_s: float) -> int:
    moments = sorted({job.started_s for job in jobs})
    return max(
        sum(job.started_s <= moment < (job.ended_s if job.ended_s is not None else end_s) for job in jobs)
        for moment in moments
    )


def test_the_trace_counts_every_step_once_in_time_order(asha_trace: QualityTrace) -> None:
    reports = asha_trace.reports
    assert asha_trace.ended_by == "study" and len(asha_trace.outcomes) == 8
    assert [r.steps_trained for r in reports] == list(range(1, len(reports) + 1))
    assert [r.at_s for r in reports] == sorted(r.at_s for r in reports)
    assert len({(r.trial, r.step) for r in reports}) == len(reports), "a step was trained twice"
    assert asha_trace.simulated_s >= reports[-1].at_s
    completed = [n for n, outcome in asha_trace.outcomes.items() if outcome == "COMPLETE"]
    assert completed
    for number in completed:
        steps = [r.step for r in reports if r.trial == number]
        assert steps == list(range(NUM_STEPS)), f"trial {number} reported {steps}"


def test_no_more_jobs_run_at_once_than_the_study_allows(asha_trace: QualityTrace) -> None:
    assert most_at_once(asha_trace.jobs, asha_trace.simulated_s) == 2
    for report in asha_trace.reports:
        spans = [j for j in asha_trace.jobs if j.trial == report.trial and j.started_s < report.at_s]
        assert any(j.ended_s is None or report.at_s <= j.ended_s for j in spans), f"{report} outside its jobs"


def test_asha_pauses_a_trial_and_promotes_it_where_it_stopped(asha_trace: QualityTrace) -> None:
    resumed = {job.trial for job in asha_trace.jobs if job.first_step}
    assert resumed, "no trial was paused and resumed"
    for number in resumed:
        runs = [job for job in asha_trace.jobs if job.trial == number]
        steps = [r for r in asha_trace.reports if r.trial == number]
        assert [r.step for r in steps] == list(range(len(steps))), "a resumed trial redid or skipped a step"
        for before, after in pairwise(runs):
            assert before.ended_s is not None and after.started_s > before.ended_s
            trained_before = [r.step for r in steps if r.at_s <= before.ended_s]
            assert after.first_step == max(trained_before) + 1


def test_a_budget_of_steps_ends_the_count() -> None:
    trace = run_quality_study(study({"kind": "none"}), Rising(), seed=1, num_parallel=2, budget_steps=15)
    assert trace.ended_by == "budget" and trace.steps_trained == 15 and len(trace.reports) == 15
    assert trace.simulated_s == trace.reports[-1].at_s
    assert "RUNNING" in trace.outcomes.values()


def test_a_seed_gives_one_trace(asha_trace: QualityTrace) -> None:
    again = run_quality_study(study(ASHA), Rising(), seed=3, num_parallel=2)
    assert again == asha_trace


@pytest.mark.parametrize("pruner", [ASHA, {"kind": "median", "warmup_steps": 1}])
def test_skipping_the_looks_that_see_nothing_new_changes_nothing(pruner: dict[str, object]) -> None:
    # One job at a time: no two drivers look at one instant, whose order the scheduler draws.
    settings = study(pruner, num_trials=5)
    lazy = run_quality_study(settings, Rising(), seed=2, num_parallel=1)
    every = run_quality_study(settings, Rising(), seed=2, num_parallel=1, every_poll=True)
    assert lazy == every
