"""The training contract, from inside a training job.

Standard library only at import time (torch is imported when a checkpoint is saved or loaded; MLflow
never: the orchestrator mirrors the reported metrics into MLflow itself), so it installs on any
training image::

    from tunepod import runtime

    ctx = runtime.init({"lr": 0.01, "epochs": 10})   # params, folders, rank from the environment
    checkpoint = ctx.load_latest_checkpoint()        # resume after a kill, a requeue, an auto-resume
    start = checkpoint.step + 1 if checkpoint else 0
    if ctx.world_change:                             # fewer nodes after a node loss (elastic), or more
        lr *= ctx.world_change.scale                 # (or keep the global batch: batch /= scale)
    for epoch in range(start, ctx.params["epochs"]):
        for batch in loader:
            ...
            ctx.step_done(step, samples=len(batch))  # every rank: times the step (per-rank telemetry)
        ctx.report(epoch, val_accuracy=accuracy)     # rank 0: one line of the metrics file
        ctx.save_checkpoint(state, epoch)            # rank 0: atomic step folder, keeps the last K
        if ctx.should_stop():                        # SIGTERM: preempted, requeued, pruned, time limit
            return                                   # (saved above); the job resumes from it
    ctx.finish(val_accuracy=accuracy)                # rank 0: the result file, atomically

The orchestrator side reads what the job wrote with ``read_reports``, ``read_result``,
``latest_checkpoint`` and ``read_progress`` (heartbeats and per-rank telemetry). The environment
variables are the ``*_ENV`` constants below.
"""

from tunepod.runtime.checkpoints import Checkpoint, CheckpointInfo, latest_checkpoint, valid_checkpoints
from tunepod.runtime.context import TrainingContext, init
from tunepod.runtime.contract import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_TIERS_ENV,
    DATA_DIR_ENV,
    DEFAULT_KEEP_CHECKPOINTS,
    KEEP_CHECKPOINTS_ENV,
    LOCAL_RANK_ENV,
    METRICS_FILE_ENV,
    MLFLOW_RUN_ID_ENV,
    MLFLOW_TRACKING_URI_ENV,
    PARALLELISM_ENV,
    PARAMS_ENV,
    RANK_ENV,
    RESULT_FILE_ENV,
    TRIAL_ENV,
    WORLD_SIZE_ENV,
)
from tunepod.runtime.metrics import Report, ReportTail, Result, read_reports, read_result
from tunepod.runtime.parallel import Parallelism, device_mesh
from tunepod.runtime.progress import RankProgress, StepTelemetry, read_progress
from tunepod.runtime.tiers import CheckpointTiers
from tunepod.runtime.worlds import World, WorldChange, read_worlds

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "CHECKPOINT_TIERS_ENV",
    "DATA_DIR_ENV",
    "DEFAULT_KEEP_CHECKPOINTS",
    "KEEP_CHECKPOINTS_ENV",
    "LOCAL_RANK_ENV",
    "METRICS_FILE_ENV",
    "MLFLOW_RUN_ID_ENV",
    "MLFLOW_TRACKING_URI_ENV",
    "PARALLELISM_ENV",
    "PARAMS_ENV",
    "RANK_ENV",
    "RESULT_FILE_ENV",
    "TRIAL_ENV",
    "WORLD_SIZE_ENV",
    "Checkpoint",
    "CheckpointInfo",
    "CheckpointTiers",
    "Parallelism",
    "RankProgress",
    "Report",
    "ReportTail",
    "Result",
    "StepTelemetry",
    "TrainingContext",
    "World",
    "WorldChange",
    "device_mesh",
    "init",
    "latest_checkpoint",
    "read_progress",
    "read_reports",
    "read_result",
    "read_worlds",
    "valid_checkpoints",
]
