"""ASHA's rule over frozen Optuna trials (``tunepod.hpo.asha``): rungs, values at rungs, who goes on,
who is promoted, and the pause state kept in a trial's user attribute."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from tunepod.hpo.asha import (
    ATTR_ASHA,
    Asha,
    AshaState,
    PausedAsPruned,
    RungJudge,
    forecast_final,
    is_paused,
)
from tunepod.hpo.study import make_sampler
from tunepod.spec.models import PrunerSpec, TuneSettings

ASHA = Asha(min_resource=1, reduction_factor=3, max_resource=27, maximize=True)


def trial(number: int, values: dict[int, float], *, paused_at: int | None = None) -> FrozenTrial:
    attrs = {} if paused_at is None else {ATTR_ASHA: AshaState(paused_at, True, attempt=1).to_attr()}
    made = create_trial(
        state=TrialState.RUNNING,
        params={"x": 0.5},
        distributions={"x": FloatDistribution(0, 1)},
        intermediate_values=values,
        user_attrs=attrs,
    )
    made.number = number
    return made


def test_rungs_grow_by_the_reduction_factor_below_max_resource() -> None:
    assert ASHA.rungs == (1, 3, 9)
    assert Asha(min_resource=2, reduction_factor=2, max_resource=16, maximize=False).rungs == (2, 4, 8)
    assert Asha(min_resource=5, reduction_factor=3, max_resource=5, maximize=True).rungs == ()


def test_a_rungs_value_is_the_first_report_at_or_past_its_units() -> None:
    # A unit is a step + 1: rung 1 (3 units) is reached at step 2; a trial told steps 0, 4, 5 reached it at 4.
    sparse = trial(0, {0: 0.1, 4: 0.4, 5: 0.5})
    assert [ASHA.value_at(sparse, rung) for rung in range(3)] == [0.1, 0.4, None]
    assert ASHA.highest_rung(sparse) == 1
    assert ASHA.highest_rung(trial(1, {})) is None


def test_a_trial_goes_on_only_in_the_top_third_of_those_at_its_rung_or_as_their_leader() -> None:
    first, second = trial(0, {0: 0.9}), trial(1, {0: 0.5})
    # Fewer than reduction_factor at the rung: the leader goes on, the others wait.
    assert ASHA.pause_rung(first, None, [first]) is None
    assert ASHA.pause_rung(first, None, [first, second]) is None
    assert ASHA.pause_rung(second, None, [first, second]) == 0
    # From three on, the top floor(n / 3).
    third = trial(2, {0: 0.1})
    assert ASHA.pause_rung(first, None, [first, second, third]) is None
    assert ASHA.pause_rung(second, None, [first, second, third]) == 0
    six = [first, second, third, *(trial(n, {0: 0.2 + n / 100}) for n in range(3, 6))]
    assert [n for n in range(6) if ASHA.pause_rung(six[n], None, six) is None] == [0, 1]
    assert [ASHA.kept(n) for n in (0, 1, 2, 3, 5, 6, 9)] == [0, 1, 1, 1, 1, 2, 3]


def test_a_promoted_trial_is_judged_from_the_rung_after_the_one_it_was_paused_at() -> None:
    trials = [trial(n, {0: v}) for n, v in enumerate([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])]
    trials[0] = trial(0, {0: 0.9, 2: 0.97})
    promoted = trial(6, {0: 0.3, 1: 0.95, 2: 0.96})
    state = AshaState(rung=0, paused=False, attempt=1, promotions=1)
    # Rung 0 is not judged again (it would rank last there); behind trial 0 at rung 1 it waits.
    assert ASHA.pause_rung(promoted, state, [*trials, promoted]) == 1


def test_a_job_is_judged_once_at_each_rung_and_trials_are_read_only_when_it_reaches_one() -> None:
    others = [trial(1, {0: 0.5}), trial(2, {0: 0.1})]
    loads: list[int] = []

    def study(*trials: FrozenTrial) -> Callable[[], list[FrozenTrial]]:
        return lambda: loads.append(1) or list(trials)

    first = trial(0, {0: 0.9})
    judge = RungJudge.for_job(ASHA, 0, None)
    assert judge.judge(1, study(first, *others)) is None  # top third of three at rung 0: go on
    assert len(loads) == 1 and judge.next_rung == 1
    # Better newcomers at rung 0 would now rank it outside the top third, but rung 0 was decided.
    better = [trial(n, {0: 0.95 + n / 100}) for n in range(3, 6)]
    first = trial(0, {0: 0.9, 1: 0.91})
    assert judge.judge(2, study(first, *others, *better)) is None
    assert len(loads) == 1, "a report that reaches no new rung reads no trials"
    # At rung 1 (3 units) it is behind the one trial there before it: it waits there.
    first = trial(0, {0: 0.9, 1: 0.91, 2: 0.92})
    ahead = trial(6, {0: 0.99, 2: 0.99})
    assert judge.judge(3, study(first, *others, *better, ahead)) == 1
    # A job past the last rung's units (finishing) is never paused, and reads nothing.
    assert RungJudge.for_job(ASHA, 0, None).judge(27, study()) is None and len(loads) == 2


def test_a_promoted_job_is_judged_from_the_rung_after_its_pause() -> None:
    state = AshaState(rung=0, paused=False, attempt=1, promotions=1)
    assert RungJudge.for_job(ASHA, 6, state).next_rung == 1
    assert RungJudge.for_job(ASHA, 6, None).next_rung == 0


def test_minimizing_ranks_the_lowest_first() -> None:
    low = Asha(min_resource=1, reduction_factor=2, max_resource=4, maximize=False)
    trials = [trial(0, {0: 3.0}), trial(1, {0: 1.0})]
    assert low.ranking(0, trials) == [1, 0]
    assert low.pause_rung(trials[1], None, trials) is None
    assert low.pause_rung(trials[0], None, trials) == 0


def test_paused_trials_in_the_top_of_their_rung_are_promoted_the_highest_rung_first() -> None:
    trials = [
        trial(0, {0: 0.8}, paused_at=0),  # paused behind trial 2, the only one at rung 0 before it
        trial(1, {0: 0.2}, paused_at=0),
        trial(2, {0: 0.9}),
        trial(3, {0: 0.7, 2: 0.95}, paused_at=1),
        trial(4, {0: 0.6, 2: 0.5}),
        trial(5, {0: 0.5, 2: 0.4}),
        trial(6, {0: 0.1}),
    ]
    # Rung 1: three trials, the top one (3) is paused there. Rung 0: seven, the top two are 2 and 0.
    assert ASHA.promotable(trials) == [3, 0]
    # For a slot that would idle: every paused trial, the highest rung first, the best first.
    assert ASHA.by_merit(trials) == [3, 0, 1]


def test_the_pause_state_round_trips_through_its_attribute_and_counts_promotions() -> None:
    state = AshaState(rung=2, paused=True, attempt=3)
    promoted = state.promoted()
    assert (promoted.paused, promoted.promotions, promoted.attempt, promoted.rung) == (False, 1, 3, 2)
    paused = trial(0, {0: 0.1}, paused_at=2)
    assert AshaState.of(paused) == AshaState(2, True, 1)
    assert is_paused(paused)
    paused.state = TrialState.PRUNED
    assert not is_paused(paused)  # a trial pruned while paused is finished, not paused
    assert AshaState.of(trial(1, {})) is None


def test_the_pause_state_keeps_every_rung_paused_at_across_promotions() -> None:
    first = AshaState.pause(None, 0, attempt=1)
    again = AshaState.pause(first.promoted(), 1, attempt=2)
    assert again == AshaState(rung=1, paused=True, attempt=2, promotions=1, paused_at=(0, 1))
    assert again.promoted().paused_at == (0, 1)
    read = create_trial(state=TrialState.RUNNING, user_attrs={ATTR_ASHA: again.to_attr()})
    assert AshaState.of(read) == again  # JSON's list read back as the tuple
    # A state written before the rungs were kept: its own rung is its last pause.
    legacy = AshaState(rung=2, paused=False, attempt=1, promotions=1)
    assert AshaState.pause(legacy, 3, attempt=2).paused_at == (2, 3)


def test_a_promotion_for_an_idle_slot_is_kept_in_the_state_until_the_trial_pauses_again() -> None:
    """Every orchestrator on the study reads it: such a trial is not the study's own work."""
    idle = AshaState.pause(None, 0, attempt=1).promoted(idle=True)
    read = create_trial(state=TrialState.RUNNING, user_attrs={ATTR_ASHA: idle.to_attr()})
    assert AshaState.of(read) == idle and idle.idle and not idle.paused
    paused = AshaState.pause(idle, 1, attempt=2)
    assert not paused.idle and not paused.promoted().idle  # promoted by the rule
    # A state written before the mark was kept reads as a promotion by the rule.
    legacy = create_trial(
        state=TrialState.RUNNING, user_attrs={ATTR_ASHA: '{"rung": 0, "paused": false, "attempt": 1}'}
    )
    assert AshaState.of(legacy) == AshaState(0, False, 1)


def test_asha_needs_max_resource() -> None:
    with pytest.raises(ValueError, match="pruner kind asha needs max_resource"):
        PrunerSpec.model_validate({"kind": "asha", "min_resource": 1})
    assert (
        PrunerSpec.model_validate({"kind": "asha", "max_resource": 9, "reduction_factor": 3}).kind == "asha"
    )


def test_asha_sizes_its_first_rung_from_max_resource_unless_told() -> None:
    def first_rung(**options: int) -> int:
        return PrunerSpec.model_validate({"kind": "asha", **options}).min_resource

    assert first_rung(max_resource=6) == 2  # a third of a trial: one rung below it
    assert first_rung(max_resource=121) == 40
    assert first_rung(max_resource=16, reduction_factor=4) == 4
    assert first_rung(max_resource=2) == 1  # never below one unit
    assert first_rung(max_resource=6, min_resource=1) == 1  # a set value is kept
    # Other pruners keep Optuna's own default.
    assert PrunerSpec.model_validate({"kind": "hyperband", "max_resource": 6}).min_resource == 1


def test_a_sampler_under_asha_learns_from_paused_trials_as_pruned_ones() -> None:
    study = optuna.create_study(direction="maximize")
    space = {"x": FloatDistribution(0, 1)}
    for x in (0.1, 0.5, 0.9):
        paused = study.ask(space)
        paused.report(x, 0)
        paused.set_user_attr(ATTR_ASHA, AshaState(0, True, attempt=1).to_attr())
    new = study.ask()
    frozen = study._storage.get_trial(new._trial_id)
    bare = optuna.samplers.TPESampler(n_startup_trials=3, multivariate=True, seed=0)
    wrapped = PausedAsPruned(optuna.samplers.TPESampler(n_startup_trials=3, multivariate=True, seed=0))
    # Alone, TPE counts no finished trial and stays in its random start-up; through the view, three.
    assert bare.sample_relative(study, frozen, space) == {}
    assert set(wrapped.sample_relative(study, frozen, space)) == {"x"}
    assert {t.state for t in study.trials} == {TrialState.RUNNING}  # the study itself is unchanged
    assert make_sampler(settings_with("asha")).__class__ is PausedAsPruned
    assert not isinstance(make_sampler(settings_with("none")), PausedAsPruned)


def settings_with(pruner: str) -> TuneSettings:
    options = {"kind": pruner} | ({"max_resource": 4} if pruner == "asha" else {})
    return TuneSettings.model_validate(
        {
            "train": {"entrypoint": "train.py"},
            "study": {"name": "s", "storage": "journal://x.log", "metric": "m"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "pruner": options,
            "num_trials": 4,
        }
    )


def test_a_forecast_follows_a_curve_in_log_units_and_never_gains_more_than_so_far() -> None:
    straight = [(units, 0.1 * math.log(units)) for units in (1, 2, 4, 5, 6, 7, 8)]
    # Along the line in log units: 0.1 x log(16) at 16 units (within what it gained so far).
    assert forecast_final(straight, 16, maximize=True) == pytest.approx(0.1 * math.log(16))
    # Followed to 1,024 units the line would gain 0.35 more; capped at the 0.21 gained so far.
    assert forecast_final(straight, 1024, maximize=True) == pytest.approx(2 * 0.1 * math.log(8))
    worsening = [(4, 0.5), (5, 0.4), (6, 0.3)]
    assert forecast_final(worsening, 27, maximize=True) == 0.3  # stays where it is
    assert forecast_final(worsening, 27, maximize=False) < 0.3  # a loss going down goes on down
    assert forecast_final([(3, 0.7)], 27, maximize=True) == 0.7  # one point forecasts itself


def test_a_forecast_is_fitted_to_the_curves_later_half_only() -> None:
    """A perplexity curve's early drop, carried on along a line, would end far below zero: the fit
    starts at half the newest units, so only the flattening part of the curve sets the slope."""
    perplexity = [(21, 33.5), (41, 17.3), (61, 15.6), (81, 14.9), (101, 14.5)]
    forecast = forecast_final(perplexity, 121, maximize=False)
    assert 13.5 < forecast < 14.5
    two_points = forecast_final(perplexity[-2:], 121, maximize=False)
    assert two_points == 14.5  # two points of the later half: too few to fit, the value stands


def test_a_positive_minimized_metric_is_forecast_on_its_log_and_never_below_zero() -> None:
    """A line through a steep fall in a loss's own units crosses zero; on its logarithm the loss
    falls as a power law and stays positive."""
    loss = [(20, 4.0), (30, 1.0), (40, 0.2)]
    assert 0 < forecast_final(loss, 400, maximize=False) < 0.2
    shifted = [(20, 1.0), (30, -2.0), (40, -2.8)]  # a metric that is not positive: its own units
    assert forecast_final(shifted, 400, maximize=False) < -2.8


def test_a_short_curve_forecasts_its_newest_value() -> None:
    """The tiny LLM's rung (reports at 20, 40, 60 steps): two points in the curve's later half, so
    ranking by forecast ranks by the value there, as ASHA by value does."""
    steep = [(21, 33.5), (41, 17.3), (61, 15.6)]
    assert forecast_final(steep, 121, maximize=False) == 15.6
    digits_rung = [(1, 0.90), (2, 0.95)]
    assert forecast_final(digits_rung, 6, maximize=True) == 0.95


def test_ranked_by_forecast_a_steady_learner_passes_one_that_flattened() -> None:
    """At the rung of 9 units, the flat trial reports more (0.60 against 0.55), but the steady one's
    curve forecasts more at 27: ranked by value the flat one leads, by forecast the steady one."""
    flat = {step: 0.60 - 0.2 * 0.5**step for step in range(9)}
    steady = {step: 0.15 + 0.18 * math.log(step + 1) for step in range(9)}
    trials = [trial(0, flat), trial(1, steady)]
    by_value = Asha(min_resource=1, reduction_factor=3, max_resource=27, maximize=True)
    by_forecast = replace(by_value, rank_by="forecast")
    rung = by_value.rungs.index(9)
    assert by_value.ranking(rung, trials) == [0, 1]
    assert by_forecast.ranking(rung, trials) == [1, 0]
    assert by_forecast.value_at(trials[1], rung) == by_value.value_at(trials[1], rung)  # plots unchanged
