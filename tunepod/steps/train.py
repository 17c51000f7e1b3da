"""``uses: train`` -- one training job with fixed params, or the best params of a needed tune step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tunepod.errors import JobError
from tunepod.launch.paths import JobPaths
from tunepod.outputs import Dataset, StepOutput, TrialRecord, TrialSet
from tunepod.runtime import Result
from tunepod.runtime.checkpoints import saved_checkpoints
from tunepod.spec.models import TrainSettings
from tunepod.steps.context import StepContext
from tunepod.steps.inputs import only_input, optional_input
from tunepod.steps.jobs import StepJob, finish_mirror, job_key, prepared, run_job
from tunepod.tracking import tags
from tunepod.tracking.mirror import Final, ModelPlan, RunMirror, RunPlan
from tunepod.tracking.mlflow_tracker import Point


def run(ctx: StepContext, name: str, settings: TrainSettings, inputs: Mapping[str, StepOutput]) -> TrialSet:
    dataset = only_input(inputs, Dataset, name)
    tuned = optional_input(inputs, TrialSet)
    best = tuned.best(1) if tuned else []
    params = {**(best[0].params if best else {}), **settings.train.args, **settings.params}
    # Keyed by the layout only when one is declared, so the keys of jobs without one stay as they were.
    layout = settings.train.parallelism
    key = job_key(
        settings.train.entrypoint,
        params=params,
        data=dataset.path,
        resources=settings.train.resources.model_dump(),
        **({"parallelism": layout.model_dump()} if layout is not None else {}),
    )
    job_dir = ctx.job_dir(name, key)
    mirror = RunMirror(
        ctx.tracker,
        prepared(ctx, job_dir),
        plan=RunPlan(
            key=f"{ctx.spec.name}/{name}/{key}",
            name=name,
            parent_run_id=ctx.run_id,
            tags={tags.STEP: name, tags.STATE: "RUNNING", tags.LAUNCHER: ctx.launcher.kind},
            params=params,
        ),
    )
    try:
        result = run_job(
            ctx,
            StepJob(
                what=f"Train step {name}",
                name=f"{ctx.spec.name}-{name}",
                entrypoint=settings.train.entrypoint,
                job_dir=job_dir,
                params=params,
                data_dir=dataset.path,
                resources=settings.train.resources,
                train=settings.train,
            ),
            mirror,
        )
    except JobError as exc:
        finish_mirror(ctx, mirror, Final(tags={tags.STATE: "FAIL"}, status="FAILED", error=str(exc)))
        raise
    finish_mirror(ctx, mirror, _completed(ctx, name, settings, job_dir, params, result))
    ctx.outbox.flush(ctx.spec.tracking.flush_timeout_s)
    record = TrialRecord(
        number=0,
        outcome="COMPLETE",
        params=params,
        value=result.metrics.get(settings.metric) if settings.metric else None,
        last_step=result.step,
        run_id=mirror.run_id,
        job_dir=str(job_dir),
        checkpoint_dir=str(JobPaths(job_dir).checkpoints),
        model_id=mirror.model_id,
    )
    return TrialSet(
        step=name,
        study=None,
        metric=settings.metric or "",
        direction=tuned.direction if tuned else "maximize",
        dataset=dataset,
        trials=[record],
    )


def _completed(
    ctx: StepContext,
    name: str,
    settings: TrainSettings,
    job_dir: Path,
    params: dict[str, object],
    result: Result,
) -> Final:
    # As the metadata says, unhashed: the mirror verifies the checkpoint it logs as the model.
    saved = saved_checkpoints(JobPaths(job_dir).checkpoints)
    latest = saved[0] if saved else None
    model = None
    if latest is not None:
        model = ModelPlan(latest.path, name=f"{ctx.spec.name}-{name}", step=latest.step, params=params)
    metrics: tuple[Point, ...] = ()
    value = result.metrics.get(settings.metric) if settings.metric else None
    if settings.metric and value is not None:
        metrics = (Point(settings.metric, value, result.step, timestamp_ms=int(result.time * 1000)),)
    checkpoints = tuple(c.path for c in saved)
    return Final(
        tags={tags.STATE: "COMPLETE"},
        status="FINISHED",
        metrics=metrics,
        model=model,
        checkpoints=checkpoints,
    )
