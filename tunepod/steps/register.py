"""``uses: register`` -- a new registered model version from the best evaluated checkpoint; the alias
moves to it only when it beats the version that holds the alias now."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tunepod.errors import JobError
from tunepod.outputs import Evaluation, Registration, StepOutput
from tunepod.spec.models import RegisterSettings
from tunepod.steps import only_input

if TYPE_CHECKING:
    from tunepod.pipeline import PipelineRun

log = logging.getLogger(__name__)

TAG_METRIC = "tunepod.metric"
TAG_VALUE = "tunepod.value"
TAG_DIRECTION = "tunepod.direction"


def run(
    run: PipelineRun, name: str, settings: RegisterSettings, inputs: Mapping[str, StepOutput]
) -> Registration:
    evaluation = only_input(inputs, Evaluation, name)
    best = evaluation.best
    if best.trial.model_id is None:
        raise JobError(
            f"step {name}: trial {best.trial.number} left no checkpoint in {best.trial.checkpoint_dir}, "
            "so there is nothing to register; fix: call ctx.save_checkpoint(...) in the training script"
        )
    holder = run.tracker.alias_holder(settings.model, settings.alias)
    previous_version, previous_value = _holder_value(holder, evaluation.metric)
    version = run.tracker.register(
        best.trial.model_id,
        settings.model,
        tags={
            TAG_METRIC: evaluation.metric,
            TAG_VALUE: repr(best.value),
            TAG_DIRECTION: evaluation.direction,
            "tunepod.pipeline_run": run.run_id,
            "tunepod.trial_run": best.trial.run_id or "",
        },
    )
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
