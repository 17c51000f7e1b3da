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

from tunepod import watch
from tunepod.errors import JobError
from tunepod.outputs import Candidate, Evaluation, StepOutput, TrialRecord, TrialSet
from tunepod.runtime import latest_checkpoint
from tunepod.spec.models import EvaluateSettings
from tunepod.steps.context import StepContext
from tunepod.steps.inputs import only_input
from tunepod.steps.jobs import StepJob, finish_mirror, job_key, prepared, run_job
from tunepod.tracking import tags
from tunepod.tracking.mirror import Final, RunMirror
from tunepod.tracking.mlflow_tracker import Point

log = logging.getLogger(__name__)


def run(
    run: StepContext, name: str, settings: EvaluateSettings, inputs: Mapping[str, StepOutput]
) -> Evaluation:
    trials = only_input(inputs, TrialSet, name)
    chosen = trials.best(settings.top_k)
    if not chosen:
        met = " that met the study's constraints" if trials.completed() else ""
        raise JobError(f"step {name}: {trials.step} has no completed trial{met} to evaluate")
    evaluated = watch.progress(len(chosen), "evaluations")
    with ThreadPoolExecutor(min(settings.num_parallel, len(chosen)), f"{name}-eval") as pool:
        futures = {pool.submit(_evaluate, run, name, settings, trials, t): t for t in chosen}
        for future in futures:
            future.add_done_callback(lambda _: evaluated(1))
    scored, failures = [], []
    for future, trial in futures.items():
        if (exc := future.exception()) is not None:
            failures.append(f"trial {trial.number}: {exc}")
        else:
            scored.append(future.result())
    run.outbox.flush(run.spec.tracking.flush_timeout_s)
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
    run.tracker.set_tags(run.run_id, {tags.step_tag(name, "best_trial"): best.trial.number})
    return Evaluation(step=name, metric=settings.metric, direction=settings.direction, candidates=scored)


def _evaluate(
    run: StepContext, name: str, settings: EvaluateSettings, trials: TrialSet, trial: TrialRecord
) -> Candidate:
    checkpoint = latest_checkpoint(Path(trial.checkpoint_dir))
    params = {**trial.params, **settings.args}
    key = job_key(
        settings.entrypoint,
        params=params,
        checkpoint=str(checkpoint.path) if checkpoint else trial.checkpoint_dir,
        data=trials.dataset.path,
        resources=settings.resources.model_dump(),
    )
    job_dir = prepared(run, run.job_dir(name, f"trial-{trial.number}-{key}"))
    # The evaluation writes into its trial's run, under its own tag prefix: the trial's own
    # tunepod.job_id names its training job.
    mirror = RunMirror(
        run.tracker, job_dir, run_id=trial.run_id or run.run_id, tag_prefix=tags.step_tag(name, "")
    )
    result = run_job(
        run,
        StepJob(
            what=f"Evaluation of trial {trial.number} (step {name})",
            name=f"{run.spec.name}-{name}-trial-{trial.number}",
            entrypoint=settings.entrypoint,
            job_dir=job_dir,
            params=params,
            data_dir=trials.dataset.path,
            resources=settings.resources,
            checkpoint_dir=Path(trial.checkpoint_dir),
        ),
        mirror,
    )
    value = result.metrics.get(settings.metric)
    if value is None or not math.isfinite(value):
        raise JobError(
            f"{settings.entrypoint} finished without a finite {settings.metric!r} "
            f"(it gave {result.metrics}); fix: call ctx.finish({settings.metric}=...)"
        )
    score = Point(settings.metric, value, None, int(result.time * 1000), model_id=trial.model_id)
    finish_mirror(run, mirror, Final(tags={}, status=None, metrics=(score,)))
    return Candidate(trial=trial, value=value, eval_job_dir=str(job_dir))
