"""The LCBench harness's accounting (benchmarks/lcbench/simulator.py) and its metrics (metrics.py).

The simulator is what makes arms comparable: every arm's epochs are counted the same way, placed on
the same clock and limited to the same number of workers, so these check it against the surrogate's
own epoch times with the random arm and with hand-made schedulers.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from benchmarks.lcbench.baselines import RandomSearch, random_search
from benchmarks.lcbench.metrics import RunSummary, overall, per_instance, ranks_of, summarize
from benchmarks.lcbench.problem import Budget, Problem, Reference, Trace, make_problem
from benchmarks.lcbench.simulator import Job, simulate

INSTANCE = "3945"


@pytest.fixture(scope="module")
def problem() -> Problem:
    return make_problem(INSTANCE)


class Watched:
    """A scheduler wrapped to record which job reported each epoch, in the order the simulator said."""

    def __init__(self, inner: RandomSearch) -> None:
        self.inner = inner
        self.reports: list[tuple[Job, int]] = []

    def next_job(self) -> Job | None:
        return self.inner.next_job()

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        self.reports.append((job, epoch))
        return self.inner.on_epoch(job, epoch, value)


def test_random_search_spends_exactly_its_budget_in_time_order(problem: Problem) -> None:
    budget = Budget(total_epochs=7 * 52 + 11, n_workers=3, startup_s=5.0)
    trace = random_search(problem, 0, budget)
    assert len(trace.value) == budget.total_epochs
    assert list(trace.epochs) == list(range(1, budget.total_epochs + 1))
    assert np.all(np.diff(trace.time_s) >= 0)
    assert trace.end_s == trace.time_s[-1]
    # 7 full trials' worth on 3 workers: 7 or 8 trials finished or cut, 3 of them in flight at the end.
    assert 8 <= trace.num_trials == trace.num_jobs <= 10


def test_each_epoch_ends_at_its_jobs_start_plus_start_up_plus_the_surrogates_time(problem: Problem) -> None:
    budget = Budget(total_epochs=6 * 52, n_workers=3, startup_s=7.0)
    watched = Watched(RandomSearch(problem, seed=3))
    trace = simulate(problem, budget, watched)
    # The last recorded epoch spends the budget and is never reported to the scheduler.
    assert len(watched.reports) == len(trace.value) - 1
    ends: dict[int, list[float]] = defaultdict(list)
    for (job, epoch), time_s in zip(watched.reports, trace.time_s, strict=False):
        assert epoch == job.first_epoch + len(ends[job.trial])
        ends[job.trial].append(float(time_s))
    intervals = []
    for trial, times in ends.items():
        config = next(job.config for job, _ in watched.reports if job.trial == trial)
        cumulative = problem.curve(config).time_s[: len(times)]
        start = times[0] - budget.startup_s - cumulative[0]
        assert times == pytest.approx(list(start + budget.startup_s + cumulative), abs=1e-6)
        intervals.append((start, times[-1]))
    # A new job starts when another ends, never more than n_workers at once, and all of them busy
    # (random search always has a job to give).
    starts = sorted(start for start, _ in intervals)
    assert starts[: budget.n_workers] == [0.0] * budget.n_workers
    for moment in starts:
        busy = sum(start <= moment < end for start, end in intervals)
        assert busy == budget.n_workers


class Script:
    """A scheduler that hands out a fixed list of jobs, then nothing."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.seen: list[tuple[int, int, float]] = []

    def next_job(self) -> Job | None:
        return self.jobs.pop(0) if self.jobs else None

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        self.seen.append((job.trial, epoch, value))
        return True


def test_a_resumed_job_pays_its_new_epochs_and_one_start_up(problem: Problem) -> None:
    config = problem.sample(np.random.default_rng(0))[0]
    curve = problem.curve(config)
    script = Script([Job(0, config, 1, 3), Job(0, config, 4, 5)])
    trace = simulate(problem, Budget(total_epochs=100, n_workers=1, startup_s=5.0), script)
    third = 5.0 + curve.time_s[2]
    assert trace.time_s == pytest.approx(
        [
            5.0 + curve.time_s[0],
            5.0 + curve.time_s[1],
            third,
            third + 5.0 + curve.time_s[3] - curve.time_s[2],
            third + 5.0 + curve.time_s[4] - curve.time_s[2],
        ]
    )
    assert [epoch for _, epoch, _ in script.seen] == [1, 2, 3, 4, 5]
    assert list(trace.value) == pytest.approx(list(curve.val_accuracy[:5]))
    # The scheduler ran out with budget left: the run ends at its last epoch.
    assert trace.end_s == trace.time_s[-1] and trace.num_jobs == 2 and trace.num_trials == 1


def test_a_job_outside_the_epochs_is_refused(problem: Problem) -> None:
    config = problem.sample(np.random.default_rng(0))[0]
    with pytest.raises(ValueError, match=r"epochs 0\.\.3 outside 1\.\.52"):
        simulate(problem, Budget(total_epochs=10), Script([Job(0, config, 0, 3)]))


# ------------------------------------------------------------------------------------------- metrics


def trace_of(values: list[float]) -> Trace:
    return Trace(
        time_s=np.arange(1.0, len(values) + 1),
        epochs=np.arange(1, len(values) + 1),
        value=np.array(values),
        end_s=float(len(values)),
        num_trials=1,
        num_jobs=1,
    )


REFERENCE = Reference(best=90.0, worst=40.0)


def summary(arm: str, values: list[float], seed: int = 0, instance: str = "1") -> RunSummary:
    return summarize(arm, instance, seed, trace_of(values), REFERENCE, Budget(total_epochs=8), cpu_s=0.0)


def test_normalized_regret_at_each_budget_fraction_by_hand() -> None:
    # 8 epochs: 10% and 25% are the first 1 and 2 epochs, 50% the first 4, 100% all 8.
    run = summary("a", [50, 70, 60, 65, 85, 80, 40, 88])
    assert run.regret == pytest.approx((0.8, 0.4, 0.4, 0.04))  # (90 - 50) / 50, (90 - 70) / 50, ...
    assert run.fraction_to_reach(70) == 2 / 8
    assert run.fraction_to_reach(85) == 5 / 8
    assert math.isinf(run.fraction_to_reach(89))


def test_a_short_trace_keeps_its_last_incumbent_for_the_rest_of_the_budget() -> None:
    run = summary("a", [50, 80])
    assert run.regret == pytest.approx((0.8, 0.2, 0.2, 0.2))


def test_medians_over_seeds_then_over_instances_and_mean_ranks() -> None:
    runs = [
        summary("random", [50, 60, 70, 70, 70, 70, 70, 70], seed=0),  # final 70
        summary("random", [50, 60, 60, 60, 60, 60, 60, 80], seed=1),  # final 80
        summary("fast", [80, 80, 80, 80, 80, 80, 80, 80], seed=0),
        summary("fast", [40, 75, 75, 75, 75, 75, 75, 75], seed=1),
    ]
    rows = per_instance(runs, baseline="random")
    by_arm = {row.arm: row for row in rows}
    # The target is the lower median of random's finals: 70. Random reaches it after 3 of 8 epochs in
    # seed 0 and 8 of 8 in seed 1; fast after 1 and 2.
    assert by_arm["random"].fraction_to_random == pytest.approx((3 / 8 + 8 / 8) / 2)
    assert by_arm["fast"].fraction_to_random == pytest.approx((1 / 8 + 2 / 8) / 2)
    # Regret at 100%: random (0.4, 0.2) -> 0.3; fast (0.2, 0.3) -> 0.25.
    assert by_arm["random"].regret[-1] == pytest.approx(0.3)
    assert by_arm["fast"].regret[-1] == pytest.approx(0.25)
    arms = {arm.arm: arm for arm in overall(rows)}
    assert arms["fast"].mean_rank[-1] == 1.0 and arms["random"].mean_rank[-1] == 2.0


def test_ranks_share_ties() -> None:
    assert ranks_of([0.3, 0.1, 0.3, 0.0]) == [3.5, 2.0, 3.5, 1.0]


def test_budget_fractions_in_epochs() -> None:
    budget = Budget(total_epochs=5200)
    assert [budget.epochs_at(f) for f in (0.1, 0.25, 0.5, 1.0)] == [520, 1300, 2600, 5200]
