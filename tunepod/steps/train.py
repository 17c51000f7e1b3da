"""``uses: train`` -- one training job with fixed params, or the best params of a needed tune step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from tunepod.errors import JobError
from tunepod.launch.paths import JobPaths
from tunepod.outputs import Dataset, StepOutput, TrialRecord, TrialSet
from tunepod.runtime import latest_checkpoint
from tunepod.spec.models import TrainSettings
from tunepod.steps import only_input, optional_input
from tunepod.steps.jobs import run_job

if TYPE_CHECKING:
    from tunepod.pipeline import PipelineRun


def run(run: PipelineRun, name: str, settings: TrainSettings, inputs: Mapping[str, StepOutput]) -> TrialSet:
    dataset = only_input(inputs, Dataset, name)
    tuned = optional_input(inputs, TrialSet)
    best = tuned.best(1) if tuned else []
    params = {**(best[0].params if best else {}), **settings.train.args, **settings.params}
    job_dir = run.jobs_dir(name)
    run_id = run.tracker.start_run(
        name,
        parent_run_id=run.run_id,
        params=params,
        tags={"tunepod.step": name, "tunepod.state": "RUNNING", "tunepod.launcher": run.launcher.kind},
    )
    try:
        result = run_job(
            run,
            what=f"Train step {name}",
            name=f"{run.spec.name}-{name}",
            entrypoint=settings.train.entrypoint,
            job_dir=job_dir,
            params=params,
            data_dir=dataset.path,
            resources=settings.train.resources,
            run_id=run_id,
            max_restarts=settings.train.max_restarts,
        )
    except JobError as exc:
        run.tracker.log_text(run_id, str(exc), "error.txt")
        run.tracker.set_tags(run_id, {"tunepod.state": "FAIL"})
        run.tracker.end_run(run_id, "FAILED")
        raise
    value = result.metrics.get(settings.metric) if settings.metric else None
    checkpoint = latest_checkpoint(JobPaths(job_dir).checkpoints)
    model_id = None
    if checkpoint is not None:
        model_id = run.tracker.log_checkpoint_model(
            run_id, checkpoint.path, name=f"{run.spec.name}-{name}", step=checkpoint.step, params=params
        )
    run.tracker.set_tags(run_id, {"tunepod.state": "COMPLETE", "tunepod.model_id": model_id or ""})
    run.tracker.end_run(run_id, "FINISHED")
    record = TrialRecord(
        number=0,
        outcome="COMPLETE",
        params=params,
        value=value,
        last_step=result.step,
        run_id=run_id,
        job_dir=str(job_dir),
        checkpoint_dir=str(JobPaths(job_dir).checkpoints),
        model_id=model_id,
    )
    direction = tuned.direction if tuned else "maximize"
    return TrialSet(
        step=name,
        study=None,
        metric=settings.metric or "",
        direction=direction,
        dataset=dataset,
        trials=[record],
    )
