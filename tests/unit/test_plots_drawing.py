"""A study's plots (``tunepod.hpo.plots``) from real Optuna trials and real matplotlib: which plots a
study has and why it lacks the others, where learning curves mark pauses, promotions and exploits,
and how many curves a large study draws. (tests/integration/test_study_plots.py: a tune step writes
them to its pipeline run.)"""

from __future__ import annotations

import io
import json

import matplotlib
import matplotlib.pyplot as plt
import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial
from PIL import Image

from tunepod.hpo.asha import ATTR_ASHA, Asha, AshaState
from tunepod.hpo.plots import (
    MAX_CURVES,
    Mark,
    Plot,
    Skipped,
    curves_to_draw,
    describe,
    marks,
    objective_view,
    renumber_curves,
    study_plots,
)
from tunepod.hpo.population import ATTR_CONTINUED_IN
from tunepod.outputs import Goal

SCORE = Goal(metric="score", direction="maximize")
COST = Goal(metric="cost", direction="minimize")
# Rungs at 1, 3 and 9 units: a pause at rung 1 is judged at step 2.
ASHA = Asha(min_resource=1, reduction_factor=3, max_resource=27, maximize=True)


def trial(
    number: int,
    curve: dict[int, float],
    *,
    state: TrialState = TrialState.COMPLETE,
    values: list[float] | None = None,
    **attrs: object,
) -> FrozenTrial:
    x = number / 100
    made = create_trial(
        state=state,
        values=(values or [1.0 - (x - 0.3) ** 2]) if state is TrialState.COMPLETE else None,
        params={"x": x, "y": (number * 37 % 100) / 100},
        distributions={"x": FloatDistribution(0, 10), "y": FloatDistribution(0, 1)},
        intermediate_values=curve,
        user_attrs=attrs,
    )
    made.number = number
    return made


def study(n: int) -> list[FrozenTrial]:
    return [trial(i, {s: (s + 1) * (1.0 - (i / 100 - 0.3) ** 2) for s in range(3)}) for i in range(n)]


def made(plots: list[Plot | Skipped]) -> dict[str, Plot | Skipped]:
    return {plot.name: plot for plot in plots}


def png_text(plot: Plot | Skipped) -> dict[str, str]:
    assert isinstance(plot, Plot), plot
    image = Image.open(io.BytesIO(plot.png))
    assert image.format == "PNG"
    return dict(image.text)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ marks


def test_a_promoted_pause_and_a_last_unpromoted_one_are_marked_at_the_first_value_of_their_rungs() -> None:
    state = AshaState.pause(AshaState.pause(None, 0, attempt=1).promoted(), 1, attempt=2)
    paused_twice = trial(4, {0: 0.1, 1: 0.2, 3: 0.4}, state=TrialState.PRUNED, **{ATTR_ASHA: state.to_attr()})
    # Rung 1 (3 units) is judged at step 2; the trial was told step 3 first.
    assert marks(paused_twice, ASHA) == [Mark(4, 0, 0.1, "promoted"), Mark(4, 3, 0.4, "paused")]
    assert describe(marks(paused_twice, ASHA)).splitlines() == [
        "trial 4, step 0 (value 0.1): paused by ASHA, then promoted",
        "trial 4, step 3 (value 0.4): paused by ASHA, never promoted",
    ]


def test_a_state_written_before_the_rungs_were_kept_marks_its_last_pause() -> None:
    legacy = json.dumps({"rung": 1, "paused": False, "attempt": 2, "promotions": 1})
    promoted = trial(2, {0: 0.1, 2: 0.3, 8: 0.9}, **{ATTR_ASHA: legacy})
    assert marks(promoted, ASHA) == [Mark(2, 2, 0.3, "promoted")]


def test_an_exploited_trial_is_marked_at_its_last_step_and_an_unpaused_one_not_at_all() -> None:
    exploited = trial(5, {3: 0.2, 7: 0.25}, state=TrialState.PRUNED, **{ATTR_CONTINUED_IN: 9})
    assert marks(exploited, None) == [Mark(5, 7, 0.25, "exploited")]
    assert marks(trial(6, {0: 0.5, 8: 0.9}), ASHA) == []


# ------------------------------------------------------------------------------------------ which plots


def test_each_plot_is_a_png_titled_for_its_study_and_pyplot_is_left_as_it_was() -> None:
    facecolor = matplotlib.rcParams["axes.facecolor"]
    plots = made(study_plots(study(5), [SCORE], ASHA, "tiny"))

    assert list(plots) == ["optimization_history", "param_importances", "intermediate_values"]
    assert "study tiny" in png_text(plots["optimization_history"])["Title"]
    assert "score (maximize)" in png_text(plots["param_importances"])["Title"]
    curves = png_text(plots["intermediate_values"])
    assert curves["Title"] == "Learning curves of study tiny: score (maximize)"
    # Optuna's functions set ggplot's style and leave their figures open: neither outlives the plots.
    assert plt.get_fignums() == []
    assert matplotlib.rcParams["axes.facecolor"] == facecolor


def test_drawn_from_a_view_of_its_drawn_trials_only_each_curve_keeps_its_trials_number() -> None:
    """The learning curves are drawn from a view of the drawn trials alone (numbered 0, 1, ... there),
    and the legend names each curve by its own trial's number."""
    shown = [t for t in study(9) if t.number % 4 == 1]  # trials 1 and 5 of 0..8
    view = objective_view(shown, 0, SCORE, "tiny", curves={t.number for t in shown})
    ax = optuna.visualization.matplotlib.plot_intermediate_values(view)
    try:
        renumber_curves(ax, [t.number for t in shown])
        labels = sorted(
            str(line.get_label()) for line in ax.get_lines() if str(line.get_label()).startswith("T")
        )
        assert labels == ["Trial1", "Trial5"]
    finally:
        plt.close("all")


def test_one_completed_trial_has_its_history_and_no_importances_and_says_why() -> None:
    plots = made(study_plots(study(1), [SCORE], None, "tiny"))
    assert isinstance(plots["optimization_history"], Plot)
    assert plots["param_importances"] == Skipped(
        "param_importances", "1 completed trial(s); importances need 2", failed=False
    )


def test_a_study_where_no_trial_completed_has_only_its_learning_curves() -> None:
    pruned = [trial(n, {0: 0.1 * n, 1: 0.2 * n}, state=TrialState.PRUNED) for n in range(3)]
    plots = made(study_plots(pruned, [SCORE], None, "tiny"))
    assert plots["optimization_history"] == Skipped("optimization_history", "no trial has completed")
    assert isinstance(plots["param_importances"], Skipped)
    assert isinstance(plots["intermediate_values"], Plot)


def test_a_study_without_intermediate_values_has_no_learning_curves() -> None:
    plots = made(study_plots([trial(n, {}) for n in range(3)], [SCORE], None, "tiny"))
    assert plots["intermediate_values"] == Skipped(
        "intermediate_values", "no trial reported an intermediate value"
    )


def test_a_two_objective_study_has_a_history_and_importances_per_objective_and_no_curves() -> None:
    trials = [trial(n, {}, values=[n / 10, (n * 7 % 5) / 10]) for n in range(5)]
    plots = made(study_plots(trials, [SCORE, COST], None, "duo"))

    for name in ("optimization_history_score", "param_importances_score", "optimization_history_cost"):
        assert isinstance(plots[name], Plot), plots[name]
    assert "cost (minimize)" in png_text(plots["optimization_history_cost"])["Title"]
    assert isinstance(plots["param_importances_cost"], Plot)
    assert plots["intermediate_values"] == Skipped(
        "intermediate_values", "a multi-objective study has no intermediate values"
    )


def test_equal_values_give_no_importances() -> None:
    plots = made(study_plots([trial(n, {}, values=[0.5]) for n in range(4)], [SCORE], None, "flat"))
    why = "every completed trial has the same score"
    assert plots["param_importances"] == Skipped("param_importances", why)


def test_a_plot_that_fails_to_draw_is_skipped_with_its_error_and_the_others_are_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no font")

    monkeypatch.setattr(optuna.visualization.matplotlib, "plot_param_importances", broken)
    plots = made(study_plots(study(4), [SCORE], None, "tiny"))
    assert plots["param_importances"] == Skipped("param_importances", "RuntimeError: no font", failed=True)
    assert isinstance(plots["optimization_history"], Plot)
    assert plt.get_fignums() == []


# ------------------------------------------------------------------------------------------ many trials


def test_up_to_the_cap_every_reported_curve_is_drawn_and_failed_trials_are_not() -> None:
    trials = [*study(5), trial(5, {0: 0.1}, state=TrialState.FAIL), trial(6, {})]
    assert curves_to_draw(trials, SCORE) == ({0, 1, 2, 3, 4}, "")


def test_past_the_cap_the_best_curves_and_an_even_spread_are_drawn_and_the_title_says_so() -> None:
    trials = study(1000)
    drawn, note = curves_to_draw(trials, SCORE)
    assert len(drawn) == MAX_CURVES
    best = sorted(trials, key=lambda t: -t.values[0])[:10]
    assert {t.number for t in best} <= drawn  # x near 0.3: trials 25 to 35
    assert min(drawn) == 0 and max(drawn) > 900  # the rest spread over the whole study
    assert note == f"\n{MAX_CURVES} of 1000 trials: the 10 best, the others evenly spaced by number"

    plots = made(study_plots(trials, [SCORE], None, "big"))
    assert png_text(plots["intermediate_values"])["Title"].endswith(note)
