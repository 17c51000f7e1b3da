"""Running one job for a step (a train run, an evaluation, a preload) and mirroring it into MLflow.

Job dirs are keyed by what the job is (``job_key``): the same step with the same script, inputs and
parameters gets the same job dir, in a Prefect retry of the step and in a later run of the pipeline.
So a retry re-attaches to the job still running, and a rerun reuses a finished job's result instead
of training again (``tunepod.launch.drive``). Change anything the key covers and the job runs anew.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tunepod.errors import JobError
from tunepod.launch.base import JobHandle, JobSpec
from tunepod.launch.contract import contract_env
from tunepod.launch.drive import DriveSettings, JobDriver, Outcome, acquire_or_follow
from tunepod.launch.lease import Leases
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import make_job_dir
from tunepod.launch.watchdog import Limits
from tunepod.runtime import CheckpointTiers, Parallelism, Report, Result
from tunepod.spec.models import TrainJob
from tunepod.spec.parallelism import job_layout, script_params
from tunepod.spec.resources import Resources
from tunepod.steps.context import StepContext
from tunepod.tracking.mirror import Final, RunMirror

POLL_S = 0.5
# How long a job waits for its MLflow run to exist before it starts without MLFLOW_RUN_ID.
RUN_ID_WAIT_S = 5.0


def job_key(entrypoint: str, **inputs: object) -> str:
    """A short digest of the script's content and every input of a job (JSON, sorted keys)."""
    digest = hashlib.sha256(Path(entrypoint).read_bytes())
    digest.update(json.dumps(inputs, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class StepJob:
    """One job a step runs: a train run, an evaluation, a preload."""

    what: str
    """How error messages name it (``Train step final``)."""
    name: str
    entrypoint: str
    job_dir: Path
    params: dict[str, object]
    data_dir: str
    resources: Resources
    checkpoint_dir: Path | None = None
    """Where its checkpoints are (an evaluation reads its trial's); default: its own job dir's."""
    train: TrainJob | None = None
    """For a training job: its restart and hang detection settings (other jobs never restart)."""


def run_job(ctx: StepContext, job: StepJob, mirror: RunMirror) -> Result:
    """Drive one job to its end, mirrored through ``mirror``; its result, or a ``JobError`` runbook.

    A failed training job starts again in place up to ``train.max_restarts`` times (it resumes
    from its checkpoints). The caller records the outcome on the mirror (``mirror.finish``): it
    alone knows what it means. While another driver (an earlier attempt of the step still running)
    holds the job dir, this one waits for it, then carries on from what the job dir says.
    """
    leases = Leases(private_job_dirs=ctx.launcher.private_job_dirs)
    lease = acquire_or_follow(leases, job.job_dir, what=job.what, poll_s=POLL_S)
    try:
        driven = _driver(ctx, job, mirror, leases).run(lease)
    finally:
        lease.release()
    if driven.outcome is Outcome.COMPLETED and driven.result is not None:
        return driven.result
    if driven.outcome is Outcome.COMPLETED:
        raise JobError(
            f"{job.what} exited 0 without a result file ({JobPaths(job.job_dir).result}); fix: call "
            f"ctx.finish(...) at the end of {job.entrypoint}"
        )
    raise JobError(driven.message)


def _driver(ctx: StepContext, job: StepJob, mirror: RunMirror, leases: Leases) -> JobDriver:
    """The driver of one step job, its environment pointing at the job's MLflow run when it exists."""
    ctx.outbox.add(mirror)
    env = contract_env(
        JobPaths(job.job_dir),
        params=script_params(job.params),
        data_dir=job.data_dir,
        trial=job.name,
        checkpoint_dir=job.checkpoint_dir,
        tracking_uri=ctx.tracker.tracking_uri,
        run_id=mirror.wait_for_run(RUN_ID_WAIT_S),
        parallelism=_layout(job),
        checkpoint_tiers=_tiers(job),
    )
    spec = JobSpec(
        name=job.name,
        entrypoint=Path(job.entrypoint).resolve(),
        job_dir=job.job_dir,
        env=env,
        resources=job.resources,
        limits=Limits.of(job.resources, job.train),
    )
    settings = DriveSettings(
        poll_s=POLL_S, max_restarts=job.train.max_restarts if job.train is not None else 0
    )

    def mirror_reports(_: list[Report]) -> None:
        ctx.outbox.add(mirror)

    return JobDriver(
        ctx.launcher,
        spec,
        settings,
        what=job.what,
        on_reports=mirror_reports,
        observe=lambda handle, _new: _mirrored(ctx, mirror, handle),
        leases=leases,
    )


def _layout(job: StepJob) -> Parallelism | None:
    """A training job's layout: its train block with the ``parallelism.*`` parameters it was given (a
    needed study's best); other jobs (evaluations, preloads) declare none."""
    if job.train is None:
        return None
    try:
        return job_layout(job.train.parallelism, job.resources, job.params)
    except ValueError as exc:
        raise JobError(f"{job.what}: its parallelism layout does not fit its resources: {exc}") from None


def _tiers(job: StepJob) -> CheckpointTiers | None:
    """A training job's checkpoint tiers; other jobs (evaluations, preloads) save nothing."""
    if job.train is None or job.train.checkpoints is None:
        return None
    return job.train.checkpoints.tiers()


def prepared(ctx: StepContext, job_dir: Path) -> Path:
    """``job_dir``, created the way the launcher creates job dirs (before anything is written there)."""
    make_job_dir(job_dir, private=ctx.launcher.private_job_dirs)
    return job_dir


def finish_mirror(ctx: StepContext, mirror: RunMirror, final: Final) -> None:
    """Record ``final`` on the mirror and hand it to the outbox (never waits for MLflow)."""
    mirror.finish(final)
    ctx.outbox.add(mirror)


def _mirrored(ctx: StepContext, mirror: RunMirror, handle: JobHandle) -> JobHandle:
    ctx.outbox.add(mirror)  # the new job id and attempt go onto the run
    return handle
