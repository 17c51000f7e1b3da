"""Running one job for a step (a train run, an evaluation) and mirroring it into an MLflow run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tunepod.errors import JobError
from tunepod.launch.base import JobSpec, JobState, Resources
from tunepod.launch.contract import contract_env
from tunepod.launch.paths import JobPaths
from tunepod.launch.watch import failure_message, watch
from tunepod.runtime import Report, Result, read_result

if TYPE_CHECKING:
    from tunepod.pipeline import PipelineRun

POLL_S = 0.5


def run_job(
    run: PipelineRun,
    *,
    what: str,
    name: str,
    entrypoint: str,
    job_dir: Path,
    params: dict[str, object],
    data_dir: str,
    resources: Resources,
    run_id: str,
    checkpoint_dir: Path | None = None,
    max_restarts: int = 0,
    tag_prefix: str = "tunepod.",
) -> Result:
    """Run one job to its end, its reports mirrored into ``run_id``; its result, or a ``JobError``.

    A job that fails is started again in place up to ``max_restarts`` times (it resumes from its
    checkpoints). The job's id and dir are tagged on ``run_id`` as ``<tag_prefix>job_id`` and
    ``<tag_prefix>job_dir``: a job that runs in another job's run (an evaluation in its trial's run)
    passes its own prefix, so that the tags of the job that made the run are kept."""
    paths = JobPaths(job_dir)
    paths.result.unlink(missing_ok=True)  # a result left by an earlier attempt must not count
    env = contract_env(
        paths,
        params=params,
        data_dir=data_dir,
        trial=name,
        checkpoint_dir=checkpoint_dir,
        tracking_uri=run.tracker.tracking_uri,
        run_id=run_id,
    )
    job = JobSpec(
        name=name, entrypoint=Path(entrypoint).resolve(), job_dir=job_dir, env=env, resources=resources
    )
    handle = run.launcher.submit(job)
    run.tracker.set_tags(run_id, {f"{tag_prefix}job_id": handle.job_id, f"{tag_prefix}job_dir": str(job_dir)})

    def mirror(reports: list[Report]) -> bool:
        run.tracker.log_reports(run_id, reports)
        return False

    timeout_s = None if resources.timeout_min is None else resources.timeout_min * 60
    outcome = watch(handle, poll_s=POLL_S, on_reports=mirror, timeout_s=timeout_s)
    for _ in range(max_restarts):
        if outcome.state is not JobState.FAILED or outcome.timed_out:
            break
        handle = run.launcher.submit(job)
        run.tracker.set_tags(run_id, {f"{tag_prefix}job_id": handle.job_id})
        outcome = watch(
            handle, poll_s=POLL_S, on_reports=mirror, after_step=outcome.last_step, timeout_s=timeout_s
        )
    result = read_result(paths.result)
    if outcome.state is JobState.SUCCEEDED and result is not None:
        return result
    message = failure_message(what, handle, outcome.state, kind=run.launcher.kind)
    if outcome.state is JobState.SUCCEEDED:
        message += "\nIt exited 0 without a result file; fix: call ctx.finish(...) at the end of the script."
    raise JobError(message)
