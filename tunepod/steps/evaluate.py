"""``uses: evaluate`` -- score the best checkpoints of a tune or train step on held-out data.

Each candidate is evaluated by a job on the same launcher as training (the checkpoints live on the
cluster's shared filesystem). The score is logged on the trial's run and linked to the logged model
of the checkpoint it scored.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tunepod.errors import JobError
from tunepod.outputs import Candidate, Evaluation, StepOutput, TrialRecord, TrialSet
from tunepod.spec.models import EvaluateSettings
from tunepod.steps import only_input
from tunepod.steps.jobs import run_job

if TYPE_CHECKING:
    from tunepod.pipeline import PipelineRun

log = logging.getLogger(__name__)


def run(
    run: PipelineRun, name: str, settings: EvaluateSettings, inputs: Mapping[str, StepOutput]
) -> Evaluation:
    trials = only_input(inputs, TrialSet, name)
    chosen = trials.best(settings.top_k)
    if not chosen:
        raise JobError(f"step {name}: {trials.step} has no completed trial to evaluate")
    with ThreadPoolExecutor(min(settings.num_parallel, len(chosen)), f"{name}-eval") as pool:
        futures = {pool.submit(_evaluate, run, name, settings, trials, t): t for t in chosen}
    scored, failures = [], []
    for future, trial in futures.items():
        if (exc := future.exception()) is not None:
            failures.append(f"trial {trial.number}: {exc}")
        else:
            scored.append(future.result())
    if not scored:
        raise JobError(f"step {name}: every evaluation failed.\n" + "\n\n".join(failures))
    for failure in failures:
        log.error("step %s: evaluation failed for %s", name, failure)
    sign = -1.0 if settings.direction == "maximize" else 1.0
    scored.sort(key=lambda c: (sign * c.value, c.trial.number))
    best = scored[0]
    run.tracker.log_metric(
        run.run_id, f"{name}.best_{settings.metric}", best.value, model_id=best.trial.model_id
    )
    run.tracker.set_tags(run.run_id, {f"tunepod.{name}.best_trial": best.trial.number})
    return Evaluation(step=name, metric=settings.metric, direction=settings.direction, candidates=scored)


def _evaluate(
    run: PipelineRun, name: str, settings: EvaluateSettings, trials: TrialSet, trial: TrialRecord
) -> Candidate:
    job_dir = run.jobs_dir(name, f"trial-{trial.number}")
    run_id = trial.run_id or run.run_id
    result = run_job(
        run,
        what=f"Evaluation of trial {trial.number} (step {name})",
        name=f"{run.spec.name}-{name}-trial-{trial.number}",
        entrypoint=settings.entrypoint,
        job_dir=job_dir,
        params={**trial.params, **settings.args},
        data_dir=trials.dataset.path,
        resources=settings.resources,
        run_id=run_id,
        checkpoint_dir=Path(trial.checkpoint_dir),
        tag_prefix=f"tunepod.{name}.",  # the trial's own tunepod.job_id names its training job
    )
    value = result.metrics.get(settings.metric)
    if value is None or not math.isfinite(value):
        raise JobError(
            f"{settings.entrypoint} finished without a finite {settings.metric!r} "
            f"(it gave {result.metrics}); fix: call ctx.finish({settings.metric}=...)"
        )
    run.tracker.log_metric(run_id, settings.metric, value, model_id=trial.model_id)
    return Candidate(trial=trial, value=value, eval_job_dir=str(job_dir))
