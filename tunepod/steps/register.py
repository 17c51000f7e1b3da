"""``uses: register`` -- a new registered model version from the best evaluated checkpoint; the alias
moves to it only when it beats the version that holds the alias now.

Idempotent, so Prefect may retry it and a rerun may repeat it: the version made from a logged model
is looked up before one is created, and an alias that already points at that version stays.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from tunepod.errors import JobError
from tunepod.outputs import Evaluation, Registration, StepOutput
from tunepod.runtime import latest_checkpoint
from tunepod.spec.models import RegisterSettings
from tunepod.steps.context import StepContext
from tunepod.steps.inputs import only_input
from tunepod.tracking import tags

log = logging.getLogger(__name__)

TAG_METRIC = tags.METRIC
TAG_VALUE = tags.VALUE
TAG_DIRECTION = tags.DIRECTION


def run(
    run: StepContext, name: str, settings: RegisterSettings, inputs: Mapping[str, StepOutput]
) -> Registration:
    evaluation = only_input(inputs, Evaluation, name)
    best = evaluation.best
    if best.trial.model_id is None:
        raise JobError(_no_model(name, best.trial.number, Path(best.trial.checkpoint_dir)))
    holder = run.tracker.alias_holder(settings.model, settings.alias)
    previous_version, previous_value = _holder_value(holder, evaluation.metric)
    version = run.tracker.register(
        best.trial.model_id,
        settings.model,
        tags={
            TAG_METRIC: evaluation.metric,
            TAG_VALUE: repr(best.value),
            TAG_DIRECTION: evaluation.direction,
            tags.PIPELINE_RUN: run.run_id,
            tags.TRIAL_RUN: best.trial.run_id or "",
        },
    )
    if previous_version == version:
        # An earlier attempt of this step (or run) registered this version and moved the alias to it.
        log.info("%s version %s already holds alias %s", settings.model, version, settings.alias)
        moves, previous_version, previous_value = True, None, None
    else:
        moves = (
            not settings.only_if_better
            or previous_value is None
            or _beats(best.value, previous_value, evaluation.direction)
        )
        if moves:
            run.tracker.set_alias(settings.model, settings.alias, version)
    log.info(
        "registered %s version %s (%s=%s); alias %s %s",
        settings.model,
        version,
        evaluation.metric,
        best.value,
        settings.alias,
        "moved to it" if moves else f"stays on version {previous_version} ({previous_value})",
    )
    return Registration(
        model=settings.model,
        version=version,
        alias=settings.alias,
        alias_moved=moves,
        previous_version=previous_version,
        previous_value=previous_value,
        value=best.value,
        metric=evaluation.metric,
    )


def _no_model(name: str, trial: int, checkpoint_dir: Path) -> str:
    if latest_checkpoint(checkpoint_dir) is None:
        return (
            f"step {name}: trial {trial} left no checkpoint in {checkpoint_dir}, so there is nothing to "
            "register; fix: call ctx.save_checkpoint(...) in the training script"
        )
    return (
        f"step {name}: the checkpoint of trial {trial} ({checkpoint_dir}) never reached MLflow (it did not "
        "answer while the trial ended); fix: run the pipeline again once MLflow is reachable: finished "
        "trials are not trained again, and their checkpoints are logged then"
    )


def _holder_value(holder: tuple[str, dict[str, str]] | None, metric: str) -> tuple[str | None, float | None]:
    """The alias holder's version and score; a holder scored on another metric cannot be compared."""
    if holder is None:
        return None, None
    version, tags = holder
    if tags.get(TAG_METRIC) != metric or TAG_VALUE not in tags:
        log.warning("alias holder version %s has no %s score; the new version replaces it", version, metric)
        return version, None
    return version, float(tags[TAG_VALUE])


def _beats(value: float, previous: float, direction: str) -> bool:
    return value > previous if direction == "maximize" else value < previous
