"""A study's plots, as PNG images: Optuna's optimization history and parameter importances (one of
each per objective), and its intermediate values (the trials' learning curves), marked where ASHA
paused a trial, where it promoted one, and where PBT exploited one.

Drawn by Optuna's own matplotlib functions (``optuna.visualization.matplotlib``) on a copy of the
study in memory, one single-objective copy per objective: Optuna plots a multi-objective study's
objectives only through ``target=``, and its default importance evaluator (PED-ANOVA) then takes
every target for one to minimize. A PNG's size does not grow with the study; a chart of many
learning curves is unreadable and slow, so at most ``MAX_CURVES`` are drawn, and its title says so.

A plot the study cannot have (no completed trial, too few for importances, no intermediate values:
a multi-objective study has none) is skipped with its reason; a plot that fails to draw is skipped
with its error. Nothing here raises for a plot: the caller logs what was skipped.
"""

from __future__ import annotations

import copy
import io
import math
import sys
import threading
import warnings
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Literal

import optuna
from optuna.storages import InMemoryStorage
from optuna.trial import FrozenTrial, TrialState

from tunepod.hpo.asha import Asha, AshaState
from tunepod.hpo.population import ATTR_CONTINUED_IN
from tunepod.outputs import Goal

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_CURVES = 40
"""The most learning curves one intermediate-values plot draws."""
BEST_CURVES = 10
"""Of those, the best completed trials' curves always; the rest are spread evenly over the study."""
LEGEND_CURVES = 20
OPTUNA_CURVE_LABEL = "Trial"
"""How Optuna labels a trial's learning curve: ``Trial<number>``."""
"""Up to this many curves, the legend names each trial; past it, only the marks."""
MIN_TRIALS_FOR_IMPORTANCES = 2
CURVE_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
"""The trials whose learning curves Optuna draws: not failed ones."""
"""Importances compare completed trials: with one, every parameter would be equally important."""

MarkKind = Literal["promoted", "paused", "exploited"]
MARK_STYLES: dict[MarkKind, tuple[str, str, str]] = {
    "promoted": ("^", "tab:green", "paused by ASHA, then promoted"),
    "paused": ("X", "tab:red", "paused by ASHA, never promoted"),
    "exploited": ("D", "black", "exploited by PBT"),
}
"""Each mark's marker, colour and legend label."""

# pyplot's figures and styles are the process's: several tune steps may end at once, on threads.
_PYPLOT = threading.Lock()


class CannotPlot(Exception):
    """The study cannot have this plot (yet); the message says why."""


@dataclass(frozen=True)
class Plot:
    name: str
    """The file's name without ``.png``: ``optimization_history``, ``param_importances_<metric>``..."""
    png: bytes


@dataclass(frozen=True)
class Skipped:
    name: str
    why: str
    failed: bool = False
    """True when drawing it raised; False when the study cannot have it."""


@dataclass(frozen=True)
class Mark:
    """A point of a trial's learning curve where something happened to its job."""

    trial: int
    step: int
    value: float
    kind: MarkKind


def study_plots(
    trials: Sequence[FrozenTrial], goals: Sequence[Goal], asha: Asha | None, study: str
) -> list[Plot | Skipped]:
    """Every plot of the study whose trials are ``trials`` (all of them, in number order: each
    plot's x axis numbers trials as they come), with objectives ``goals`` (primary first), under
    the ASHA rule ``asha`` if it has one; ``study`` names it in the titles."""
    made = [plot for index in range(len(goals)) for plot in _objective_plots(trials, goals, index, study)]
    if len(goals) == 1:
        made.append(_attempt("intermediate_values", lambda: _intermediate(trials, goals[0], asha, study)))
    else:
        made.append(Skipped("intermediate_values", "a multi-objective study has no intermediate values"))
    return made


def _objective_plots(
    trials: Sequence[FrozenTrial], goals: Sequence[Goal], index: int, study: str
) -> list[Plot | Skipped]:
    """The optimization history and the importances of objective ``index``; named for its metric
    when the study has several."""
    goal = goals[index]
    suffix = "" if len(goals) == 1 else f"_{goal.metric}"
    view = objective_view(trials, index, goal, study, curves=())
    return [
        _attempt(f"optimization_history{suffix}", lambda: _history(view, goal, study)),
        _attempt(f"param_importances{suffix}", lambda: _importances(view, goal, study)),
    ]


def _attempt(name: str, draw: Callable[[], bytes]) -> Plot | Skipped:
    try:
        return Plot(name, draw())
    except CannotPlot as why:
        return Skipped(name, str(why))
    except Exception as exc:  # Optuna's and matplotlib's errors are many, and no plot is worth a step
        return Skipped(name, f"{type(exc).__name__}: {exc}", failed=True)


# ------------------------------------------------------------------------------------------ the plots


def _history(view: optuna.Study, goal: Goal, study: str) -> bytes:
    if not _completed(view):
        raise CannotPlot("no trial has completed")

    def draw() -> Axes:
        ax = optuna.visualization.matplotlib.plot_optimization_history(view, target_name=goal.metric)
        ax.set_title(f"Optimization history of study {study}: {goal.metric} ({goal.direction})")
        return ax

    return _png(draw)


def _importances(view: optuna.Study, goal: Goal, study: str) -> bytes:
    completed = _completed(view)
    if len(completed) < MIN_TRIALS_FOR_IMPORTANCES:
        needed = MIN_TRIALS_FOR_IMPORTANCES
        raise CannotPlot(f"{len(completed)} completed trial(s); importances need {needed}")
    # Either way PED-ANOVA would find every parameter equally important.
    if not any(len({repr(t.params.get(name)) for t in completed}) > 1 for name in _param_names(completed)):
        raise CannotPlot("no parameter took two values among the completed trials")
    if len({t.value for t in completed}) == 1:
        raise CannotPlot(f"every completed trial has the same {goal.metric}")

    def draw() -> Axes:
        ax = optuna.visualization.matplotlib.plot_param_importances(view, target_name=goal.metric)
        ax.set_title(f"Parameter importances for {goal.metric} ({goal.direction}), study {study}", loc="left")
        return ax

    return _png(draw)


def _intermediate(trials: Sequence[FrozenTrial], goal: Goal, asha: Asha | None, study: str) -> bytes:
    drawn, note = curves_to_draw(trials, goal)
    if not drawn:
        raise CannotPlot("no trial reported an intermediate value")
    # Only the drawn trials: a view of all of them costs a second per 10,000 trials. Optuna numbers
    # them 0, 1, ... in the view; the legend gets their own numbers back.
    shown = [t for t in trials if t.number in drawn]
    view = objective_view(shown, 0, goal, study, curves=drawn)
    found = [mark for t in shown for mark in marks(t, asha)]

    def draw() -> Axes:
        ax = optuna.visualization.matplotlib.plot_intermediate_values(view)
        renumber_curves(ax, [t.number for t in shown])
        _figure(ax).set_size_inches(10, 6)
        _draw_marks(ax, found)
        _legend(ax, with_trials=len(drawn) <= LEGEND_CURVES)
        ax.set_ylabel(goal.metric)
        ax.set_title(f"Learning curves of study {study}: {goal.metric} ({goal.direction}){note}")
        return ax

    return _png(draw, description=describe(found))


def renumber_curves(ax: Axes, numbers: Sequence[int]) -> None:
    """Label each curve ``Trial<n>`` with its trial's own number (``numbers``, by its number in the
    view)."""
    for line in ax.get_lines():
        label = str(line.get_label())
        if label.startswith(OPTUNA_CURVE_LABEL) and label[len(OPTUNA_CURVE_LABEL) :].isdigit():
            line.set_label(f"{OPTUNA_CURVE_LABEL}{numbers[int(label[len(OPTUNA_CURVE_LABEL) :])]}")


def _draw_marks(ax: Axes, found: Sequence[Mark]) -> None:
    for kind, (marker, colour, label) in MARK_STYLES.items():
        points = [mark for mark in found if mark.kind == kind]
        if points:
            steps, values = [m.step for m in points], [m.value for m in points]
            ax.scatter(steps, values, marker=marker, color=colour, s=70, zorder=3, label=label)


def _legend(ax: Axes, *, with_trials: bool) -> None:
    """The trials' legend Optuna drew, or only the marks' once there are too many curves to name."""
    handles, labels = ax.get_legend_handles_labels()
    marked = {label for _, _, label in MARK_STYLES.values()}
    kept = [(h, label) for h, label in zip(handles, labels, strict=True) if with_trials or label in marked]
    if (legend := ax.get_legend()) is not None:
        legend.remove()
    if kept:
        ax.legend(*zip(*kept, strict=True), bbox_to_anchor=(1.02, 1), loc="upper left", fontsize="small")


# ------------------------------------------------------------------------------------------ pure parts


def curves_to_draw(trials: Sequence[FrozenTrial], goal: Goal, cap: int = MAX_CURVES) -> tuple[set[int], str]:
    """The numbers of the trials whose learning curves are drawn, and what the title adds about them:
    every trial that reported while they are at most ``cap``; past it the ``BEST_CURVES`` best
    completed ones and the others evenly spaced by number, ``cap`` in all."""
    reported = [t for t in trials if t.intermediate_values and t.state in CURVE_STATES]
    if len(reported) <= cap:
        return {t.number for t in reported}, ""
    ranked = sorted(
        (t for t in reported if t.state is TrialState.COMPLETE and t.values),
        key=lambda t: -t.values[0] if goal.direction == "maximize" else t.values[0],
    )
    best = [t.number for t in ranked[:BEST_CURVES]]
    rest = [t.number for t in reported if t.number not in best]
    room = cap - len(best)
    spread = [rest[math.floor(i * len(rest) / room)] for i in range(room)]
    note = f"\n{cap} of {len(reported)} trials: the {len(best)} best, the others evenly spaced by number"
    return set(best) | set(spread), note


def marks(trial: FrozenTrial, asha: Asha | None) -> list[Mark]:
    """Where ``trial``'s learning curve marks its pauses by ASHA (each followed by a promotion but
    one left paused, or pruned at the end of the study) and its exploit by PBT, read from its user
    attributes. A pause is marked at the first value reported at its rung, as ASHA judged it."""
    found: list[Mark] = []
    state = AshaState.of(trial)
    if state is not None and asha is not None:
        rungs = state.paused_at or (state.rung,)  # a state from before the rungs were kept: its last
        for i, rung in enumerate(rungs):
            # A promotion clears ``paused``: only the last pause can have been left unpromoted.
            promoted = i < len(rungs) - 1 or not state.paused
            point = _first_at_or_after(trial, asha.rungs[rung] - 1) if rung < len(asha.rungs) else None
            if point is not None:
                found.append(Mark(trial.number, *point, "promoted" if promoted else "paused"))
    if trial.user_attrs.get(ATTR_CONTINUED_IN) is not None and trial.intermediate_values:
        last = max(trial.intermediate_values)
        found.append(Mark(trial.number, last, trial.intermediate_values[last], "exploited"))
    return found


def describe(found: Sequence[Mark]) -> str:
    """The marks in words, a line each: the PNG's description, for whoever reads it without looking."""
    return "\n".join(
        f"trial {m.trial}, step {m.step} (value {m.value:.6g}): {MARK_STYLES[m.kind][2]}" for m in found
    )


def _first_at_or_after(trial: FrozenTrial, step: int) -> tuple[int, float] | None:
    reached = [s for s in trial.intermediate_values if s >= step]
    return (min(reached), trial.intermediate_values[min(reached)]) if reached else None


def objective_view(
    trials: Sequence[FrozenTrial], index: int, goal: Goal, study: str, *, curves: Container[int]
) -> optuna.Study:
    """A single-objective study in memory with every trial of ``trials`` (so numbered as they are),
    its value the ``index``-th objective's (``goal``), its intermediate values only if its number is
    in ``curves``, its constraints kept (Optuna greys infeasible trials)."""
    # Named for what it is: Optuna logs every study it creates, by name.
    name = f"{study} ({goal.metric}, to plot)"
    view = optuna.create_study(study_name=name, storage=InMemoryStorage(), direction=goal.direction)
    view.add_trials([_projected(t, index, curves) for t in trials])
    return view


def _projected(trial: FrozenTrial, index: int, curves: Container[int]) -> FrozenTrial:
    completed = trial.state is TrialState.COMPLETE and trial.values is not None
    # A waiting trial has no start Optuna would take: added as the failed trial it is to a plot.
    state = TrialState.FAIL if trial.state is TrialState.WAITING else trial.state
    started = trial.datetime_start or datetime.now()
    return _Projection(
        number=trial.number,
        state=state,
        value=None,
        values=[trial.values[index]] if completed else None,
        datetime_start=started,
        datetime_complete=(trial.datetime_complete or started) if state.is_finished() else None,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs={},
        system_attrs=trial.system_attrs,
        intermediate_values=trial.intermediate_values if trial.number in curves else {},
        trial_id=trial._trial_id,
    )


class _Projection(FrozenTrial):
    """A trial made for a view alone and never changed after: the view's storage may keep it as it
    is. Optuna's in-memory storage deep-copies every trial added to it, so that its caller's later
    changes cannot reach it; at 10,000 trials that copy took most of a second of the study's end. Its
    shallow copy still gets a number and an id of its own from the storage; ``add_trials`` validates
    it as it would any trial."""

    def __deepcopy__(self, memo: dict[int, object]) -> _Projection:
        return copy.copy(self)


def _completed(view: optuna.Study) -> list[FrozenTrial]:
    return view.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def _param_names(trials: Sequence[FrozenTrial]) -> set[str]:
    return {name for t in trials for name in t.params}


# ------------------------------------------------------------------------------------------ rendering


def _png(draw: Callable[[], Axes], description: str = "") -> bytes:
    """What ``draw`` draws with pyplot, as a PNG (its text chunks: the title, and ``description``);
    every figure it made closed again, and pyplot's style (Optuna's functions set ggplot's) as it
    was."""
    _use_agg()
    import matplotlib.pyplot as plt

    with _PYPLOT, plt.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        before = set(plt.get_fignums())
        try:
            ax = draw()
            buffer = io.BytesIO()
            title = ax.get_title() or ax.get_title(loc="left")
            metadata = {"Title": title, **({"Description": description} if description else {})}
            _figure(ax).savefig(buffer, format="png", dpi=100, bbox_inches="tight", metadata=metadata)
            return buffer.getvalue()
        finally:
            for number in set(plt.get_fignums()) - before:
                plt.close(number)


def load_drawing_in_background() -> None:
    """Import what drawing the plots needs on a thread of its own, now: matplotlib, and Optuna's
    plotting and importance modules, which import scikit-learn and SciPy (seconds of CPU, once per
    process). Call it when a study starts: the plots are drawn after its last trial, where every second
    is a wait for the step's end, and the study's own threads mostly wait on its jobs meanwhile."""
    threading.Thread(target=_import_drawing, name="tunepod-plots-imports", daemon=True).start()


def _import_drawing() -> None:
    try:
        _use_agg()
        import matplotlib.pyplot  # noqa: F401
        import optuna.importance
        import optuna.visualization.matplotlib  # noqa: F401
    except Exception:  # drawing imports them again, and shows its own error as a skipped plot
        return


def _use_agg() -> None:
    """The Agg backend, unless the process has chosen one already (it imported pyplot): the plots are
    files, drawn on a step's thread, where an interactive backend's windows must never open."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("agg")


def _figure(ax: Axes) -> Figure:
    figure = ax.get_figure(root=True)
    assert figure is not None, "Optuna's plots are drawn on an axes of a figure"
    return figure
