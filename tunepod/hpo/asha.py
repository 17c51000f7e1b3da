"""Asynchronous successive halving that pauses and promotes trials over their checkpoints.

ASHA (Li et al., "A System for Massively Parallel Hyperparameter Tuning", MLSys 2020) judges each
trial at rungs of ``min_resource x reduction_factor^k`` units of training (below ``max_resource``): a
trial goes on past rung ``k`` only while it ranks in the top ``floor(n / reduction_factor)`` of the
``n`` trials that have reached rung ``k`` so far, or leads them while they are fewer than
``reduction_factor`` (Ray Tune's ASHA and Optuna's successive halving let that leader go on too:
measured, pausing it until a cohort gathers costs the study a stop and a restart of the very trial
that was leading, and loses to random search where a good trial comes early). Nothing waits for a
full cohort. Optuna's pruners and Ray Tune's ASHA kill the others; here they are *paused*: the job is
stopped after its checkpoint, the Optuna trial stays RUNNING with its reports, and the trial is
*promoted* (resumed from its checkpoint on a new job) as soon as the rung's growing population puts
it in the top, or when a slot would otherwise idle at the end of the study. A trial never promoted
ends PRUNED when nothing else runs.

A unit of training is a reported step + 1, as for ``pruner.max_resource``: a job reporting epochs 0,
1, ... has used ``r`` units at step ``r - 1``. A trial's value at a rung is the one it reported at the
first step that reached it (as told to Optuna, which is every step below 1,000).

Everything here is pure: the rungs, each trial's values at them and its pause state (one Optuna user
attribute, written whole so that a crash never leaves half of it), read from frozen trials.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Container, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

RankBy = Literal["value", "forecast"]

ATTR_ASHA = "tunepod_asha"
"""The trial's pause state (``AshaState`` as JSON); absent until its first pause."""


@dataclass(frozen=True)
class AshaState:
    """Where a trial stands in ASHA, kept in its Optuna user attribute ``tunepod_asha``."""

    rung: int
    """The rung the trial was last paused at."""
    paused: bool
    """True while its job is stopped and it waits for a promotion."""
    attempt: int
    """The attempt (submission) of the job that was paused: a promotion starts the attempt after it."""
    promotions: int = 0
    """How often the trial was promoted: each is one more attempt that is no restart after a failure."""
    paused_at: tuple[int, ...] = ()
    """Every rung the trial was paused at, in order (the last is ``rung``): where its learning curve
    marks its pauses and promotions. Empty in a state written before they were kept."""
    idle: bool = False
    """Promoted only because a slot would otherwise idle at the end of the study, not by the rule.
    Kept here, not by the orchestrator that promoted it, so that no orchestrator on the study takes
    such a trial for the study's own work (``Tuner._end_of_study``)."""

    def __post_init__(self) -> None:
        # Read back from JSON, the rungs are a list: kept a tuple, so that states compare equal.
        object.__setattr__(self, "paused_at", tuple(self.paused_at))

    def promoted(self, *, idle: bool = False) -> AshaState:
        return AshaState(self.rung, False, self.attempt, self.promotions + 1, self.paused_at, idle)

    @classmethod
    def pause(cls, before: AshaState | None, rung: int, attempt: int) -> AshaState:
        """The state of a trial whose job of ``attempt`` is paused at ``rung``; ``before``: its state
        until then (None before its first pause)."""
        if before is None:
            return cls(rung, True, attempt, 0, (rung,))
        earlier = before.paused_at or (before.rung,)
        return cls(rung, True, attempt, before.promotions, (*earlier, rung))

    def to_attr(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def of(cls, trial: FrozenTrial) -> AshaState | None:
        raw = trial.user_attrs.get(ATTR_ASHA)
        return None if raw is None else cls(**json.loads(str(raw)))


def is_paused(trial: FrozenTrial) -> bool:
    state = AshaState.of(trial)
    return trial.state is TrialState.RUNNING and state is not None and state.paused


@dataclass(frozen=True)
class Asha:
    """The rungs of one study and the rule that ranks trials at them."""

    min_resource: int
    reduction_factor: int
    max_resource: int
    maximize: bool
    rank_by: RankBy = "value"
    """What trials are ranked by at a rung: the value each reported there, or the value its learning
    curve up to there forecasts at ``max_resource`` (``forecast_final``)."""

    @property
    def rungs(self) -> tuple[int, ...]:
        """The units of training at each rung, below ``max_resource`` (a trial that gets there has
        finished: there is nothing to judge it for)."""
        rungs: list[int] = []
        resource = self.min_resource
        while resource < self.max_resource:
            rungs.append(resource)
            resource *= self.reduction_factor
        return tuple(rungs)

    def value_at(self, trial: FrozenTrial, rung: int) -> float | None:
        """The value ``trial`` reported when it reached rung ``rung``; None if it has not (yet)."""
        first_step = self.rungs[rung] - 1
        reached = [step for step in trial.intermediate_values if step >= first_step]
        if not reached:
            return None
        value = trial.intermediate_values[min(reached)]
        return value if math.isfinite(value) else None

    def highest_rung(self, trial: FrozenTrial) -> int | None:
        """The highest rung ``trial`` has a value at; None below the first."""
        reached = [rung for rung in range(len(self.rungs)) if self.value_at(trial, rung) is not None]
        return max(reached, default=None)

    def first_undecided_rung(self, state: AshaState | None) -> int:
        """The first rung a trial's running job is still to be judged at: after the rung it was
        promoted from, else the first."""
        return 0 if state is None else state.rung + 1

    def merit_at(self, trial: FrozenTrial, rung: int) -> float | None:
        """What ``trial`` is ranked by at ``rung``: its value there, or the final value its curve up to
        there forecasts. None if it has not reached the rung (yet)."""
        value = self.value_at(trial, rung)
        if value is None or self.rank_by == "value":
            return value
        first_step = self.rungs[rung] - 1
        at = min(step for step in trial.intermediate_values if step >= first_step)
        curve = [(step + 1, v) for step, v in sorted(trial.intermediate_values.items()) if step <= at]
        return forecast_final(curve, self.max_resource, maximize=self.maximize)

    def ranking(self, rung: int, trials: Sequence[FrozenTrial]) -> list[int]:
        """Numbers of the trials that reached ``rung``, best first (ties: the older trial first)."""
        valued = [(value, t.number) for t in trials if (value := self.merit_at(t, rung)) is not None]
        valued.sort(key=lambda pair: (-pair[0] if self.maximize else pair[0], pair[1]))
        return [number for _, number in valued]

    def kept(self, reached: int) -> int:
        """How many of the ``reached`` trials at a rung go on: the top ``1 / reduction_factor``, and
        never fewer than the leader."""
        return max(1, reached // self.reduction_factor) if reached else 0

    def top(self, rung: int, trials: Sequence[FrozenTrial]) -> list[int]:
        """Numbers of the trials at ``rung`` that rank among the kept, best first."""
        ranking = self.ranking(rung, trials)
        return ranking[: self.kept(len(ranking))]

    def in_top(self, number: int, rung: int, trials: Sequence[FrozenTrial]) -> bool:
        """``number`` ranks among the kept of the trials at ``rung``."""
        return number in self.top(rung, trials)

    def pause_rung(
        self, trial: FrozenTrial, state: AshaState | None, trials: Sequence[FrozenTrial]
    ) -> int | None:
        """The rung at which ``trial``'s running job must stop, judged on the values reported so far:
        the first rung from ``first_undecided_rung`` that it reached outside the top; None while it
        may go on."""
        for rung in range(self.first_undecided_rung(state), len(self.rungs)):
            if self.value_at(trial, rung) is None:
                return None
            if not self.in_top(trial.number, rung, trials):
                return rung
        return None

    def promotable(self, trials: Sequence[FrozenTrial]) -> list[int]:
        """Paused trials the rule promotes now (each in the top of the rung it was paused at), the
        highest rung first, the best first within a rung."""
        chosen: list[int] = []
        for rung in reversed(range(len(self.rungs))):
            paused = {t.number for t in trials if is_paused(t) and _state(t).rung == rung}
            chosen += [number for number in self.top(rung, trials) if number in paused]
        return chosen

    def by_merit(self, trials: Sequence[FrozenTrial]) -> list[int]:
        """Every paused trial, the highest rung first, the best first within a rung: the order in
        which a slot that would idle takes them."""
        chosen: list[int] = []
        for rung in reversed(range(len(self.rungs))):
            paused = {t.number for t in trials if is_paused(t) and _state(t).rung == rung}
            chosen += [number for number in self.ranking(rung, trials) if number in paused]
        return chosen


FORECAST_POINTS = 5
"""The newest points of a curve its forecast is fitted to: its recent slope, not its early climb."""
FORECAST_MIN_POINTS = 3
"""The fewest points of a curve's later half its forecast is fitted to; below, a curve's value ranks
it better than a line through its early climb does (benchmarks/README.md, "Ranking by forecast
needs a curve")."""


def forecast_final(curve: Sequence[tuple[int, float]], horizon: int, *, maximize: bool) -> float:
    """The value a learning curve, ``(units, value)`` points in order, forecasts at ``horizon`` units.

    A line against log(units) through the newest ``FORECAST_POINTS`` points of the curve's later half
    (from half its newest units on), followed from the newest point to log(``horizon``): learning
    curves flatten as training goes on, and are close to straight in log units over a stretch, but
    not over their early climb, which a line through it carries on far past the final value. With
    fewer than ``FORECAST_MIN_POINTS`` points there, a curve forecasts its newest value (ranking by
    forecast is then ASHA's own ranking): two points cannot tell the climb from the slope. A
    minimized metric whose values are all positive (a loss, a perplexity) is forecast on its
    logarithm: it falls as a power law, toward zero and never below it. Two guards keep the forecast
    from trusting a few noisy points: a curve that is not improving is forecast to stay where it is,
    and no curve gains more in its remaining training than it did in its training so far (a line in
    log units overshoots a saturating curve)."""
    finite = [(units, value) for units, value in curve if math.isfinite(value)]
    if not finite:
        return math.nan
    newest = finite[-1][1]
    if not maximize and all(value > 0 for _, value in finite):
        logs = [(units, math.log(value)) for units, value in finite]
        return newest * math.exp(_gain_ahead(logs, horizon, maximize=False))
    return newest + _gain_ahead(finite, horizon, maximize=maximize)


def _gain_ahead(curve: Sequence[tuple[int, float]], horizon: int, *, maximize: bool) -> float:
    """What ``forecast_final`` adds to a curve's newest value, on the scale of its values (finite)."""
    newest_units, newest = curve[-1]
    recent = [(units, value) for units, value in curve if units >= newest_units / 2][-FORECAST_POINTS:]
    if len(recent) < FORECAST_MIN_POINTS or horizon <= newest_units:
        return 0.0
    xs = [math.log(units) for units, _ in recent]
    ys = [value for _, value in recent]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    gain = slope * (math.log(horizon) - math.log(newest_units))
    if (gain > 0) != maximize:
        return 0.0
    gained_so_far = abs(newest - curve[0][1])
    return math.copysign(min(abs(gain), gained_so_far), gain)


@dataclass
class RungJudge:
    """The rungs one running job is still to be judged at. ASHA decides a rung once: when the job's
    reports first reach it, against the trials there so far. A job that went on past a rung is not
    paused there later, when worse-ranked newcomers at that rung would now put it outside the top."""

    asha: Asha
    number: int
    next_rung: int
    """The first rung not yet decided for this job."""

    @classmethod
    def for_job(cls, asha: Asha, number: int, state: AshaState | None) -> RungJudge:
        return cls(asha, number, asha.first_undecided_rung(state))

    def judge(self, units: int, load_trials: Callable[[], Sequence[FrozenTrial]]) -> int | None:
        """The rung to pause at, now that the job has trained ``units``; None to go on. The trials
        are loaded only when a rung is reached: most reports reach none."""
        rungs = self.asha.rungs
        if units >= self.asha.max_resource:
            return None  # it is finishing: a pause would only cost a job
        trials: Sequence[FrozenTrial] | None = None
        while self.next_rung < len(rungs) and units >= rungs[self.next_rung]:
            trials = load_trials() if trials is None else trials
            if not self.asha.in_top(self.number, self.next_rung, trials):
                return self.next_rung
            self.next_rung += 1
        return None


def _state(trial: FrozenTrial) -> AshaState:
    state = AshaState.of(trial)
    assert state is not None
    return state


class PausedAsPruned(optuna.samplers.BaseSampler):
    """A sampler that sees paused trials as pruned ones (at the step and value they paused with).

    A paused trial stays RUNNING in Optuna, so that it can be promoted; but a model-based sampler
    learns from finished trials only (TPE counts COMPLETE and PRUNED ones against its start-up trials
    and ranks PRUNED ones by the step and value they reached). Under ASHA most trials are paused most
    of the time, and TPE would draw at random all study long. Through this, the sampler gets what a
    pruner would have given it; the study's trials themselves are not changed. Samplers read trials
    through ``Study._get_trials`` (Optuna's own samplers all do), which the view below answers."""

    def __init__(self, inner: optuna.samplers.BaseSampler) -> None:
        self.inner = inner

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self.inner.infer_relative_search_space(_PausedView(study), trial)  # type: ignore[arg-type]

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return self.inner.sample_relative(_PausedView(study), trial, search_space)  # type: ignore[arg-type]

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        view = _PausedView(study)
        return self.inner.sample_independent(view, trial, param_name, param_distribution)  # type: ignore[arg-type]

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()


class _PausedView:
    """``study`` as a sampler reads it, with every paused trial PRUNED; everything else is the study's."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(
        self, deepcopy: bool = True, states: Container[TrialState] | None = None, use_cache: bool = False
    ) -> list[FrozenTrial]:
        trials = [_as_pruned(t) for t in self._study._get_trials(deepcopy=deepcopy, use_cache=use_cache)]
        return trials if states is None else [t for t in trials if t.state in states]

    def get_trials(
        self, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self.get_trials()


def _as_pruned(trial: FrozenTrial) -> FrozenTrial:
    if not is_paused(trial):
        return trial
    pruned = copy.copy(trial)
    pruned.state = TrialState.PRUNED
    return pruned
