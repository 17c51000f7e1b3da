"""From traces to the table: normalized regret at budget fractions, the budget an arm needs to reach
random search's final incumbent, and their aggregation over seeds and instances.

- Normalized regret of a run at fraction f of the budget: ``(best - incumbent) / (best - worst)``,
  the incumbent being the best val_accuracy of any epoch within the run's first ``f x total_epochs``
  epochs, and best and worst the instance's reference values (reference.py).
- Budget to random's final: the instance's target is the lower median over seeds of random search's
  final incumbent (so that at least half of random's seeds reach it, and random's own figure is at
  most 1); a run's figure is the fraction of its budget (epochs) after which its incumbent first
  reaches the target; infinite when it never does (shown ">1").
- Per instance: the median over seeds. Over instances: the median of the per-instance medians, and
  the mean rank (1 = lowest regret; ties share their mean rank) of each arm's per-instance median.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.lcbench.problem import Budget, Reference, Trace

FRACTIONS = (0.1, 0.25, 0.5, 1.0)
GRID_POINTS = 200  # the incumbent kept every 0.5% of the budget, for plots and the JSON


@dataclass(frozen=True)
class RunSummary:
    """What the table and the plot need of one run (one arm, instance and seed)."""

    arm: str
    instance: str
    seed: int
    regret: tuple[float, ...]
    """Normalized regret at each of FRACTIONS."""
    incumbent: np.ndarray
    """The incumbent after every epoch of the budget (the last value repeated past a short trace)."""
    grid_regret: np.ndarray
    """Normalized regret after each GRID_POINTS-th of the budget."""
    end_s: float
    num_trials: int
    num_jobs: int
    cpu_s: float
    """CPU seconds the run took here (the tuner's own work and the surrogate's)."""

    def fraction_to_reach(self, target: float) -> float:
        """The budget fraction after which the incumbent first reaches ``target``; inf if never."""
        reached = np.flatnonzero(self.incumbent >= target)
        return math.inf if len(reached) == 0 else (int(reached[0]) + 1) / len(self.incumbent)


def summarize(
    arm: str, instance: str, seed: int, trace: Trace, reference: Reference, budget: Budget, cpu_s: float
) -> RunSummary:
    if len(trace.value) == 0:
        raise ValueError(f"arm {arm} on instance {instance}, seed {seed}, trained no epoch")
    incumbent = trace.incumbent()
    padded = np.full(budget.total_epochs, incumbent[-1])
    padded[: len(incumbent)] = incumbent[: budget.total_epochs]
    grid = [budget.epochs_at((i + 1) / GRID_POINTS) for i in range(GRID_POINTS)]
    return RunSummary(
        arm=arm,
        instance=instance,
        seed=seed,
        regret=tuple(float(reference.regret(padded[budget.epochs_at(f) - 1])) for f in FRACTIONS),
        incumbent=padded,
        grid_regret=reference.regret(padded[np.array(grid) - 1]),
        end_s=trace.end_s,
        num_trials=trace.num_trials,
        num_jobs=trace.num_jobs,
        cpu_s=cpu_s,
    )


@dataclass(frozen=True)
class ArmOnInstance:
    """One arm on one instance: medians over its seeds."""

    arm: str
    instance: str
    seeds: int
    regret: tuple[float, ...]
    fraction_to_random: float
    end_s: float
    num_trials: float
    grid_regret: np.ndarray


def median(values: Iterable[float]) -> float:
    """The median, infinite values counted as the largest (a median of "never" is never)."""
    return float(statistics.median(values))


def random_target(runs: Sequence[RunSummary], baseline: str) -> float:
    """The instance's target: the lower median over seeds of the baseline's final incumbent (with an
    even number of seeds, the mean of the middle two would be reached by half the seeds only, and
    the baseline's own median budget would read "never")."""
    finals = [float(run.incumbent[-1]) for run in runs if run.arm == baseline]
    if not finals:
        raise ValueError(f"no {baseline} run to set the target: run the {baseline} arm too")
    return float(statistics.median_low(finals))


def per_instance(runs: Sequence[RunSummary], baseline: str) -> list[ArmOnInstance]:
    """Every (arm, instance) pair's medians over seeds, in the order the runs came."""
    rows = []
    for instance in unique(run.instance for run in runs):
        on_instance = [run for run in runs if run.instance == instance]
        target = random_target(on_instance, baseline)
        for arm in unique(run.arm for run in on_instance):
            mine = [run for run in on_instance if run.arm == arm]
            rows.append(
                ArmOnInstance(
                    arm=arm,
                    instance=instance,
                    seeds=len(mine),
                    regret=tuple(median(run.regret[i] for run in mine) for i in range(len(FRACTIONS))),
                    fraction_to_random=median(run.fraction_to_reach(target) for run in mine),
                    end_s=median(run.end_s for run in mine),
                    num_trials=median(run.num_trials for run in mine),
                    grid_regret=np.median(np.stack([run.grid_regret for run in mine]), axis=0),
                )
            )
    return rows


@dataclass(frozen=True)
class ArmOverall:
    """One arm over all instances: medians of the per-instance medians and mean ranks."""

    arm: str
    instances: int
    regret: tuple[float, ...]
    mean_rank: tuple[float, ...]
    fraction_to_random: float
    end_s: float
    grid_regret: np.ndarray


def overall(rows: Sequence[ArmOnInstance]) -> list[ArmOverall]:
    arms = unique(row.arm for row in rows)
    instances = unique(row.instance for row in rows)
    ranks: dict[str, list[list[float]]] = {arm: [[] for _ in FRACTIONS] for arm in arms}
    for instance in instances:
        on_instance = [row for row in rows if row.instance == instance]
        for i in range(len(FRACTIONS)):
            for row, rank in zip(on_instance, ranks_of([row.regret[i] for row in on_instance]), strict=True):
                ranks[row.arm][i].append(rank)
    result = []
    for arm in arms:
        mine = [row for row in rows if row.arm == arm]
        result.append(
            ArmOverall(
                arm=arm,
                instances=len(mine),
                regret=tuple(median(row.regret[i] for row in mine) for i in range(len(FRACTIONS))),
                mean_rank=tuple(float(np.mean(r)) for r in ranks[arm]),
                fraction_to_random=median(row.fraction_to_random for row in mine),
                end_s=median(row.end_s for row in mine),
                grid_regret=np.median(np.stack([row.grid_regret for row in mine]), axis=0),
            )
        )
    return result


def ranks_of(values: Sequence[float]) -> list[float]:
    """1 for the smallest; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
