"""``uses: tune`` -- an Optuna study over training jobs (see ``tunepod.hpo.tuner``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from tunepod.hpo.plots import Skipped, load_drawing_in_background, study_plots
from tunepod.hpo.policies.asha import make_asha
from tunepod.hpo.tuner import TrialSubmitter, TuneContext, Tuner, require_completed
from tunepod.outputs import Dataset, Goal, StepOutput, TrialSet
from tunepod.spec.models import TuneSettings
from tunepod.steps.context import StepContext
from tunepod.steps.inputs import only_input
from tunepod.stores import redacted
from tunepod.tracking import tags
from tunepod.tracking.outbox import takes_one_writer
from tunepod.tracking.reserve import RunReserve

log = logging.getLogger(__name__)


def tuner(run: StepContext, name: str, settings: TuneSettings, inputs: Mapping[str, StepOutput]) -> Tuner:
    jobs_dir = run.shared.jobs_dir(settings.study.name)
    return Tuner(
        TuneContext(
            step=name,
            settings=settings,
            launcher=run.launcher,
            dataset=only_input(inputs, Dataset, name),
            # Keyed by study, not by run: a rerun of the study resumes the same trial folders.
            jobs_dir=jobs_dir,
            tracker=run.tracker,
            outbox=run.outbox,
            parent_run_id=run.run_id,
            pipeline=run.spec.name,
            flush_timeout_s=run.spec.tracking.flush_timeout_s,
            mlflow_ui_url=run.spec.tracking.browse_url,
            open_run_reserve=run_reserve_opener(run, jobs_dir),
        )
    )


def run_reserve_opener(run: StepContext, jobs_dir: Path) -> Callable[[int], RunReserve] | None:
    """How the tune step opens its reserve of MLflow runs made ahead (``tracking.runs_ahead``). None
    by default on a SQLite store: naming a run made ahead is one more write per trial, and SQLite
    takes one writer at a time, which short trials keep busy (measured: 10,000 one-second trials, 16
    in flight, left a 60 s backlog at the study's end, against none without)."""
    wanted = run.spec.tracking.runs_ahead
    if wanted == 0 or (wanted is None and takes_one_writer(run.spec.tracking.uri)):
        return None
    return lambda in_flight: RunReserve(
        run.tracker, jobs_dir, run.run_id, size=in_flight if wanted is None else wanted
    )


def run(
    run: StepContext,
    name: str,
    settings: TuneSettings,
    inputs: Mapping[str, StepOutput],
    *,
    submit_trial: TrialSubmitter | None = None,
) -> TrialSet:
    tuned = tuner(run, name, settings, inputs)
    load_drawing_in_background()  # ready by the study's end, where the plots are drawn
    trials = tuned.run(submit_trial)
    run.tracker.set_tags(run.run_id, {tags.step_tag(name, "study"): settings.study.name})
    if trials.multi_objective:
        record_pareto_front(run, name, trials)
    # Before the check: a study none of whose trials completed still shows how far its curves got.
    if record_plots(run, name, tuned):
        record_trial_table(run, name, trials)
    return require_completed(trials)


def record_trial_table(run: StepContext, name: str, trials: TrialSet) -> None:
    """Every trial of the study as one table on the pipeline run, ``<step>/trials.json``: the summary
    and Prefect's trial tables show the best ones only past ``tunepod.pipeline.SUMMARY_ROWS``. Best
    effort, as all tracking (and not tried when the plots' writes just failed)."""
    try:
        run.tracker.log_table(run.run_id, trial_columns(trials), f"{name}/trials.json")
    except Exception as exc:  # MLflow's errors are many; none of them fails a step that tuned
        why = f"{type(exc).__name__}: {redacted(str(exc), run.tracker.tracking_uri)[:500]}"
        log.warning("step %s: its trial table was not written to MLflow: %s", name, why)


def trial_columns(trials: TrialSet) -> dict[str, list[object]]:
    """The trials as columns: number, how each ended, each objective's value, each parameter (as
    text: a categorical's values may be of several types), the MLflow run."""
    metrics = [goal.metric for goal in trials.objectives] or [trials.metric]
    rows = trials.trials
    params = list(dict.fromkeys(key for t in rows for key in t.params))
    columns: dict[str, list[object]] = {
        "trial": [t.number for t in trials.trials],
        "outcome": [t.ending or t.outcome for t in trials.trials],
    }
    for metric in metrics:
        columns[metric] = [trials.value_of(t, metric) if t.outcome == "COMPLETE" else None for t in rows]
    for param in params:
        columns[f"params.{param}"] = [str(t.params[param]) if param in t.params else None for t in rows]
    columns["run_id"] = [t.run_id for t in trials.trials]
    return columns


def record_pareto_front(run: StepContext, name: str, trials: TrialSet) -> None:
    """The front on the pipeline run (a table artifact ``<step>/pareto_front.json`` and a tag listing
    its trials), and on every completed trial's run a ``tunepod.pareto_front`` tag, true or false (a
    rerun that grows the study moves trials off the front)."""
    front = trials.pareto_front()
    columns: dict[str, list[object]] = {"trial": [t.number for t in front]}
    for goal in trials.objectives:
        columns[goal.metric] = [trials.value_of(t, goal.metric) for t in front]
    columns["run_id"] = [t.run_id for t in front]
    run.tracker.log_table(run.run_id, columns, f"{name}/pareto_front.json")
    on_front = {t.number for t in front}
    listed = ",".join(str(number) for number in sorted(on_front))
    run.tracker.set_tags(run.run_id, {tags.step_tag(name, "pareto_front"): listed})
    for trial in trials.completed():
        if trial.run_id:
            run.tracker.set_tags(trial.run_id, {tags.PARETO_FRONT: str(trial.number in on_front).lower()})


def record_plots(run: StepContext, name: str, tuned: Tuner) -> bool:
    """The study's plots on the pipeline run, as ``<step>/plots/<plot>.png`` (``tunepod.hpo.plots``),
    rewritten by each run of the step. Best effort, as all tracking: a plot the study cannot have is
    logged, one that cannot be drawn or written is a warning, and the step goes on either way. After a
    failed write the others are not tried: MLflow is away, and each write would wait for it. Returns
    False after such a failed write (True when the study had no plots to draw)."""
    study = tuned.settings.study
    goals = [Goal(metric=g.metric, direction=g.direction) for g in study.goals]
    try:
        made = study_plots(tuned.trials.all(), goals, make_asha(tuned.settings), study.name)
    except Exception as exc:  # the storage's errors, past its retries: no plot is worth the step
        why = f"{type(exc).__name__}: {redacted(str(exc), study.storage)[:500]}"
        log.warning("step %s: no plots of study %s: %s", name, study.name, why)
        return True
    for plot in made:
        if isinstance(plot, Skipped):
            (log.warning if plot.failed else log.info)("step %s: no %s plot: %s", name, plot.name, plot.why)
            continue
        try:
            run.tracker.log_bytes(run.run_id, plot.png, f"{name}/plots/{plot.name}.png")
        except Exception as exc:  # MLflow's errors are many; none of them fails a step that tuned
            why = f"{type(exc).__name__}: {redacted(str(exc), run.tracker.tracking_uri)[:500]}"
            log.warning("step %s: its plots were not written to MLflow: %s", name, why)
            return False
    return True
