"""What an arm is given and what it returns: the Problem, the Budget and the Trace.

An arm tunes one LCBench instance under a Budget and returns a Trace: one point per epoch trained,
in simulated time. The metrics (metrics.py) read traces only, so an arm may produce its trace any way
it likes (the simulator in simulator.py, or its own loop on its own simulated clock) as long as it
keeps the Trace's contract.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.lcbench.reference import load_references
from benchmarks.lcbench.surrogate import NUM_EPOCHS, Config, Lcbench, Param

METRIC = "val_accuracy"  # maximised, in percent


@dataclass(frozen=True)
class Budget:
    """The resources every arm gets, the same for all arms of a comparison."""

    total_epochs: int = NUM_EPOCHS * 100
    """Epochs trained over all trials, counted as trained: an epoch trained twice (a trial restarted
    from scratch at a larger budget, as SMAC's and DEHB's Hyperband do) counts twice; a trial resumed
    from its checkpoint trains only its new epochs. 52 x 100: 100 full-length trials' worth, enough for
    random search to reach a few percent of regret on most instances and for model-based arms to
    learn, and still a few seconds of simulation per run."""
    n_workers: int = 4
    """Trials training at once (workers). An arm may keep fewer busy (a synchronous bracket waiting)."""
    startup_s: float = 5.0
    """Simulated seconds from a job's start (fresh or resumed) to the start of its first epoch, on top
    of the surrogate's epoch times: scheduling, the process's start, loading data and checkpoint.
    tunepod's digits trials took 2.8 s from submission to their first report on this machine; a
    cluster takes longer. LCBench's epochs take ~1-15 s, so a start costs about one epoch's time. It
    moves the time columns only: the budget and the regrets are counted in epochs."""

    def epochs_at(self, fraction: float) -> int:
        """The budget's first ``fraction``, in epochs (at least one)."""
        return max(1, math.ceil(fraction * self.total_epochs - 1e-9))


@dataclass(frozen=True)
class Reference:
    """An instance's reference values for normalized regret (reference.py says how they were drawn)."""

    best: float
    worst: float

    def regret(self, incumbent: float | np.ndarray) -> Any:
        """``(best - incumbent) / (best - worst)``: 0 at the reference best, 1 at the worst final value
        of the reference sample. Negative when an arm beats every reference draw."""
        return (self.best - incumbent) / (self.best - self.worst)


@dataclass(frozen=True)
class Curve:
    """One configuration's surrogate curve: index k is epoch k + 1."""

    val_accuracy: np.ndarray
    time_s: np.ndarray  # cumulative training seconds at the end of each epoch, non-decreasing


@dataclass(frozen=True)
class Problem:
    """One LCBench instance to tune: the surrogate that answers for it and its reference values."""

    instance: str
    surrogate: Lcbench
    reference: Reference
    max_epochs: int = NUM_EPOCHS

    @property
    def space(self) -> tuple[Param, ...]:
        return self.surrogate.space

    def curves(self, configs: Sequence[Config]) -> list[Curve]:
        """Each config's curve, in one surrogate call."""
        curves = self.surrogate.curves(self.instance, configs)
        # float64: the simulator adds many epoch times, and float32 sums drift by tens of microseconds.
        accuracy, time_s = curves.val_accuracy.astype(np.float64), curves.time.astype(np.float64)
        return [Curve(accuracy[i], time_s[i]) for i in range(len(configs))]

    def curve(self, config: Config) -> Curve:
        (curve,) = self.curves([config])
        return curve

    def sample(self, rng: np.random.Generator, size: int = 1) -> list[dict[str, float]]:
        """Configurations drawn uniformly from the space (the random arm's and the samplers' start)."""
        return self.surrogate.sample(rng, size)


@functools.cache
def shared_surrogate() -> Lcbench:
    """One surrogate per process (its ONNX session takes ~0.1 s to load)."""
    return Lcbench()


def make_problem(instance: str) -> Problem:
    """The problem of ``instance``, with its cached reference values (data/reference.json)."""
    references = load_references()
    if instance not in references:
        raise ValueError(
            f"no reference values for LCBench instance {instance!r} in data/reference.json; compute them "
            f"with: python -m benchmarks.lcbench.reference --instances {instance}"
        )
    values = references[instance]
    return Problem(instance, shared_surrogate(), Reference(best=values["best"], worst=values["worst_final"]))


@dataclass(frozen=True)
class Trace:
    """What an arm did, one point per epoch trained, in the order the epochs ended (simulated time).

    ``time_s[i]`` is the simulated time (seconds since the arm's start) at which the ``i + 1``-th
    epoch trained in all ended, ``epochs[i] == i + 1``, and ``value[i]`` is the val_accuracy that
    epoch reported. ``end_s`` is the simulated time at which the arm's budget ran out (the last
    epoch's end), or at which it stopped with budget left. The incumbent after ``n`` epochs is the best
    value of the first ``n`` points: the best validation value of any evaluation, at any fidelity,
    seen so far (as YAHPO Gym's and Syne Tune's benchmarks count it).
    """

    time_s: np.ndarray
    epochs: np.ndarray
    value: np.ndarray
    end_s: float
    num_trials: int
    """Configurations the arm trained (a configuration retrained at a larger budget counts once when
    the arm says so, else once per job)."""
    num_jobs: int
    """Jobs started: fresh starts, restarts and resumes, each of which paid ``Budget.startup_s``."""

    def incumbent(self) -> np.ndarray:
        return np.maximum.accumulate(self.value)

    def incumbent_after(self, epochs: int) -> float:
        """The best value within the first ``epochs`` epochs (all of them when the trace is shorter);
        NaN when it has none."""
        if len(self.value) == 0:
            return math.nan
        return float(self.value[: max(1, epochs)].max())

    def time_after(self, epochs: int) -> float:
        """Simulated seconds at which the ``epochs``-th epoch ended (``end_s`` when it never did)."""
        return float(self.time_s[epochs - 1]) if 0 < epochs <= len(self.time_s) else self.end_s


@dataclass
class Recorder:
    """Builds a Trace epoch by epoch and says when the budget is spent. Times must not go backwards."""

    budget: Budget
    time_s: list[float] = field(default_factory=list)
    value: list[float] = field(default_factory=list)

    @property
    def spent(self) -> bool:
        return len(self.value) >= self.budget.total_epochs

    def record(self, time_s: float, value: float) -> bool:
        """One epoch trained; returns whether budget is left for another."""
        if self.spent:
            raise RuntimeError(f"epoch recorded past the budget of {self.budget.total_epochs} epochs")
        if self.time_s and time_s < self.time_s[-1]:
            raise ValueError(f"epoch ends at {time_s} s, before the previous one ({self.time_s[-1]} s)")
        self.time_s.append(time_s)
        self.value.append(value)
        return not self.spent

    def trace(self, end_s: float, num_trials: int, num_jobs: int) -> Trace:
        return Trace(
            time_s=np.array(self.time_s, dtype=np.float64),
            epochs=np.arange(1, len(self.value) + 1),
            value=np.array(self.value, dtype=np.float64),
            end_s=end_s,
            num_trials=num_trials,
            num_jobs=num_jobs,
        )
