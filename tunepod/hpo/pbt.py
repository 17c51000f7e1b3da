"""Population-based training over checkpoints (Jaderberg et al., "Population Based Training of Neural
Networks", 2017), as lineages of Optuna trials.

A study under PBT trains ``population`` *members* side by side. Each member is a lineage of Optuna
trials, each trial with fixed parameters (as Optuna wants them): the member's first trial is asked from
the sampler; at every ``interval`` units of training (a unit is a reported step + 1, as for the
pruners) a member's running job is judged against the members that reached the same boundary. Of the
``n`` members ranked there, the top and the bottom *quantiles* are ``ceil(n x quantile)`` members each,
at most ``n // 2`` and none when ``n < 2`` (as in Ray Tune's PBT). One in the bottom is *exploited*:
its job is stopped and its trial ends PRUNED, and a new trial of the same member continues from a copy
of the latest checkpoint of a member in the top (the *donor*), with the donor's parameters *explored*
(perturbed or resampled). Each new trial records where it came from in one user attribute
(``PbtState``: member, generation, the donor's trial, the checkpoint step, the trial it continues),
which becomes the MLflow run's lineage tags.

A boundary is decided once per job, as soon as every member has reached it (or has finished without
reaching it): the member that gets there last decides on arrival, the others at their next report
after that, by then a little further on. Nobody waits (a job trains on while its boundary is open),
and members are ranked at the same point of training, so a member that is ahead is not favoured for
it (Ray Tune's PBT ranks the latest result of each). Members keep each other's pace only if they
train side by side, which is why ``num_parallel >= population`` is checked at spec load (for
``num_parallel: auto``, once the tune step has read the cluster). The cap is the study's: members
driven by two orchestrators still train side by side.

Everything here is pure: read from frozen trials; the tuner does the stopping, copying and creating.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
ATTR_PBT = "tunepod_pbt"
"""A continuing trial's lineage (``PbtState`` as JSON); a member's first trial has none."""


@dataclass(frozen=True)
class PbtState:
    """Where a continuing trial comes from, kept whole in its user attribute ``tunepod_pbt``."""

    member: int
    """The member: the number of its lineage's first trial."""
    generation: int
    """1 for the member's first continuation, 2 for the next, ..."""
    parent: int
    """The donor: the trial whose checkpoint this one starts from."""
    from_step: int
    """The step of that checkpoint: this trial's reports start after it."""
    replaces: int
    """The member's trial that was exploited (stopped) for this one."""
    seed: str
    """The folder holding the copy of the donor's checkpoint (``step-N``), made before this trial."""

    def to_attr(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def of(cls, trial: FrozenTrial) -> PbtState | None:
        raw = trial.user_attrs.get(ATTR_PBT)
        return None if raw is None else cls(**json.loads(str(raw)))


def member_of(trial: FrozenTrial) -> int:
    state = PbtState.of(trial)
    return trial.number if state is None else state.member


def generation_of(trial: FrozenTrial) -> int:
    state = PbtState.of(trial)
    return 0 if state is None else state.generation


@dataclass(frozen=True)
class Pbt:
    """One study's PBT settings and the rule that ranks its members."""

    population: int
    interval: int
    quantile: float
    maximize: bool
    max_resource: int | None = None
    factors: tuple[float, float] = (0.8, 1.2)
    resample_probability: float = 0.25
    explored: frozenset[str] | None = None
    """The parameters ``explore`` changes; None: all."""

    def boundaries_after(self, units: int) -> int:
        """The index k (boundary at ``k * interval`` units) of the first boundary past ``units``."""
        return units // self.interval + 1

    def is_boundary(self, k: int) -> bool:
        """Boundary ``k`` is judged: it lies before ``max_resource`` (a member there has finished)."""
        return self.max_resource is None or k * self.interval < self.max_resource

    def curve(self, member: int, trials: Sequence[FrozenTrial]) -> dict[int, float]:
        """The member's values by step across its lineage: a later generation's values replace an
        earlier one's at the same steps (it continued from a donor, not from its own past)."""
        lineage = sorted((t for t in trials if member_of(t) == member), key=generation_of)
        merged: dict[int, float] = {}
        for trial in lineage:
            merged |= trial.intermediate_values
        return merged

    def value_at(self, member: int, units: int, trials: Sequence[FrozenTrial]) -> float | None:
        """The member's value when it first reached ``units``; None if it has not."""
        curve = self.curve(member, trials)
        reached = [step for step in curve if step >= units - 1]
        if not reached:
            return None
        value = curve[min(reached)]
        return value if math.isfinite(value) else None

    def ranking(self, units: int, trials: Sequence[FrozenTrial]) -> list[int]:
        """The members that reached ``units``, best first (ties: the older member first)."""
        members = sorted({member_of(t) for t in trials})
        valued = [(v, m) for m in members if (v := self.value_at(m, units, trials)) is not None]
        valued.sort(key=lambda pair: (-pair[0] if self.maximize else pair[0], pair[1]))
        return [member for _, member in valued]

    def decidable(self, units: int, trials: Sequence[FrozenTrial]) -> bool:
        """Every member of the population exists and has reached ``units``, or has finished short of
        it (a failed member holds nobody up)."""
        members = sorted({member_of(t) for t in trials if t.state is not TrialState.WAITING})
        if len(members) < self.population:
            return False
        return all(
            self.value_at(member, units, trials) is not None or self.head(member, trials).state in FINISHED
            for member in members
        )

    def donors_for(self, member: int, units: int, trials: Sequence[FrozenTrial]) -> list[int]:
        """The members ``member`` may copy from at ``units`` (the top ``quantile``, best first) when it
        ranks in the bottom ``quantile`` of the ``n`` members there; empty while it may go on."""
        ranking = self.ranking(units, trials)
        count = self.quantile_size(len(ranking))
        if count == 0 or member not in ranking[-count:]:
            return []
        return ranking[:count]

    def quantile_size(self, ranked: int) -> int:
        """How many of ``ranked`` members are in the top, and as many in the bottom: ``ceil(n x
        quantile)``, at most ``n // 2``, none below two (as Ray Tune's PBT). Rounded up, not down: down,
        a population of 2 or 3 at the default 0.25, or 4 once a member failed, never exploited."""
        if ranked < 2:
            return 0
        return min(math.ceil(ranked * self.quantile), ranked // 2)

    def head(self, member: int, trials: Sequence[FrozenTrial]) -> FrozenTrial:
        """The member's newest trial: the one that trains it now, or trained it last."""
        return max((t for t in trials if member_of(t) == member), key=generation_of)

    def explore(
        self, params: Mapping[str, Any], space: Mapping[str, BaseDistribution], rng: random.Random
    ) -> dict[str, Any]:
        """The donor's parameters, each of ``explored`` resampled from its distribution with
        ``resample_probability``, else perturbed: a number times one of ``factors`` (clipped to its
        range, on its grid; at least one grid step that way, a float at 0 by ``|factor - 1|`` of its
        range), a choice moved to a neighbouring one."""
        explored = dict(params)
        for name, distribution in space.items():
            if name not in params or (self.explored is not None and name not in self.explored):
                continue
            if rng.random() < self.resample_probability:
                explored[name] = _sample(distribution, rng)
            else:
                explored[name] = _perturb(params[name], distribution, rng.choice(self.factors), rng)
        return explored


@dataclass
class BoundaryJudge:
    """The boundaries one running job is still to be judged at, each once: when it has reached it and
    so has every other member (a job that went on past one is not exploited there later)."""

    pbt: Pbt
    member: int
    next_boundary: int
    """The index k of the first boundary (at ``k * interval`` units) not yet decided for this job."""

    @classmethod
    def for_job(cls, pbt: Pbt, trial: FrozenTrial) -> BoundaryJudge:
        state = PbtState.of(trial)
        trained = 0 if state is None else state.from_step + 1  # a continuation starts with the donor's
        return cls(pbt, member_of(trial), pbt.boundaries_after(trained))

    def judge(self, units: int, load_trials: Callable[[], Sequence[FrozenTrial]]) -> list[int]:
        """The members to copy from, best first, now that the job has trained ``units``; empty to go
        on. The trials are loaded only while a boundary the job reached is open: most reports reach
        none."""
        trials: Sequence[FrozenTrial] | None = None
        while self.pbt.is_boundary(self.next_boundary) and units >= self.next_boundary * self.pbt.interval:
            trials = load_trials() if trials is None else trials
            boundary = self.next_boundary * self.pbt.interval
            if not self.pbt.decidable(boundary, trials):
                return []  # others are still on their way there: decided at a later report
            donors = self.pbt.donors_for(self.member, boundary, trials)
            if donors:
                return donors
            self.next_boundary += 1
        return []


def _sample(distribution: BaseDistribution, rng: random.Random) -> Any:
    if isinstance(distribution, CategoricalDistribution):
        return rng.choice(distribution.choices)
    if isinstance(distribution, FloatDistribution):
        low, high = distribution.low, distribution.high
        value = (
            math.exp(rng.uniform(math.log(low), math.log(high)))
            if distribution.log
            else rng.uniform(low, high)
        )
        return _on_grid(value, distribution)
    assert isinstance(distribution, IntDistribution)
    if distribution.log:
        return _on_grid(
            math.exp(rng.uniform(math.log(distribution.low), math.log(distribution.high))), distribution
        )
    return rng.randrange(distribution.low, distribution.high + 1, distribution.step)


def _perturb(value: Any, distribution: BaseDistribution, factor: float, rng: random.Random) -> Any:
    if isinstance(distribution, CategoricalDistribution):
        index = distribution.choices.index(value) if value in distribution.choices else 0
        moved = index + rng.choice((-1, 1))
        return distribution.choices[min(max(moved, 0), len(distribution.choices) - 1)]
    assert isinstance(distribution, FloatDistribution | IntDistribution)
    perturbed = _on_grid(float(value) * factor, distribution)
    # Compared on the grid: -0.1 and the grid's -0.09999999999999998 are the same point of it.
    if perturbed == _on_grid(float(value), distribution) and factor != 1:
        perturbed = _nudged(float(value), distribution, factor)
    return perturbed


def _nudged(value: float, distribution: FloatDistribution | IntDistribution, factor: float) -> Any:
    """``value`` moved the least a ``factor`` that could not move it should: a number too small for its
    grid (1 x 1.2 rounds to 1, 0.1 x 1.2 to 0.1 on a grid of 0.1) one step that way; a float at 0
    (which no factor moves) by ``|factor - 1|`` of its range, the share a factor moves a number of its
    own size by, taken of the only scale the space gives. Clipped at the bound it is pushed toward."""
    # The way the factor moves the number: away from 0 above 1, toward it below (at 0: up, or down).
    direction = (1 if factor > 1 else -1) * (-1 if value < 0 else 1)
    step = distribution.step
    if step is None:
        step = abs(factor - 1) * (distribution.high - distribution.low)
    return _on_grid(value + direction * step, distribution)


def _on_grid(value: float, distribution: FloatDistribution | IntDistribution) -> Any:
    """``value`` clipped to the distribution's range and put on its step grid."""
    low, high = distribution.low, distribution.high
    value = min(max(value, low), high)
    step = distribution.step
    if step is not None:
        value = low + round((value - low) / step) * step
        value = min(max(value, low), high)
    if isinstance(distribution, IntDistribution):
        return round(value)
    return float(value)
