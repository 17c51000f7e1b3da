"""``uses: tune`` -- an Optuna study over training jobs (see ``tunepod.hpo.tuner``)."""

from __future__ import annotations

from collections.abc import Mapping

from tunepod.hpo.tuner import TrialSubmitter, TuneContext, Tuner, require_completed
from tunepod.outputs import Dataset, StepOutput, TrialSet
from tunepod.spec.models import TuneSettings
from tunepod.steps.context import StepContext
from tunepod.steps.inputs import only_input
from tunepod.tracking import tags


def tuner(run: StepContext, name: str, settings: TuneSettings, inputs: Mapping[str, StepOutput]) -> Tuner:
    return Tuner(
        TuneContext(
            step=name,
            settings=settings,
            launcher=run.launcher,
            dataset=only_input(inputs, Dataset, name),
            # Keyed by study, not by run: a rerun of the study resumes the same trial folders.
            jobs_dir=run.shared.jobs_dir(settings.study.name),
            tracker=run.tracker,
            outbox=run.outbox,
            parent_run_id=run.run_id,
            pipeline=run.spec.name,
            flush_timeout_s=run.spec.tracking.flush_timeout_s,
        )
    )


def run(
    run: StepContext,
    name: str,
    settings: TuneSettings,
    inputs: Mapping[str, StepOutput],
    *,
    submit_trial: TrialSubmitter | None = None,
) -> TrialSet:
    trials = tuner(run, name, settings, inputs).run(submit_trial)
    run.tracker.set_tags(run.run_id, {tags.step_tag(name, "study"): settings.study.name})
    return require_completed(trials)
