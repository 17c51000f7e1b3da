"""The environment the orchestrator hands a job: the training contract of ``tunepod.runtime``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from tunepod import runtime
from tunepod.launch.paths import JobPaths
from tunepod.runtime.memory_store import job_folder
from tunepod.runtime.tiers import read_checkpoint_tiers


def contract_env(
    paths: JobPaths,
    *,
    params: Mapping[str, object],
    data_dir: Path | str,
    trial: str,
    checkpoint_dir: Path | None = None,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    parallelism: runtime.Parallelism | None = None,
    checkpoint_tiers: runtime.CheckpointTiers | None = None,
) -> dict[str, str]:
    """Environment variables for one job. ``checkpoint_dir`` defaults to the job's own folder;
    ``parallelism`` unset leaves the job plain data parallel (``TUNEPOD_PARALLELISM`` absent);
    ``checkpoint_tiers`` unset sends every save to the shared folder (``TUNEPOD_CHECKPOINT_TIERS``
    absent)."""
    env = {
        runtime.PARAMS_ENV: json.dumps(dict(params), sort_keys=True),
        runtime.DATA_DIR_ENV: str(data_dir),
        runtime.CHECKPOINT_DIR_ENV: str(checkpoint_dir or paths.checkpoints),
        runtime.RESULT_FILE_ENV: str(paths.result),
        runtime.METRICS_FILE_ENV: str(paths.metrics),
        runtime.TRIAL_ENV: trial,
    }
    if tracking_uri:
        env[runtime.MLFLOW_TRACKING_URI_ENV] = tracking_uri
    if run_id:
        env[runtime.MLFLOW_RUN_ID_ENV] = run_id
    if parallelism is not None:
        env[runtime.PARALLELISM_ENV] = parallelism.to_json()
    if checkpoint_tiers is not None:
        env[runtime.CHECKPOINT_TIERS_ENV] = checkpoint_tiers.to_json()
    return env


def memory_folder(env: Mapping[str, str]) -> Path | None:
    """The folder a job with checkpoint tiers keeps under each node's ``memory_dir``
    (``tunepod.runtime.memory_store.job_folder``), from the job's environment; None without tiers.
    ``ctx.finish`` removes it; a job that ends without it (killed, failed, cancelled) leaves it to its
    launcher, which knows when the job has ended for good."""
    tiers = read_checkpoint_tiers(env, runtime.CHECKPOINT_TIERS_ENV)
    checkpoint_dir = env.get(runtime.CHECKPOINT_DIR_ENV)
    if tiers is None or not checkpoint_dir:
        return None
    return job_folder(tiers.memory_dir, Path(checkpoint_dir))
