"""The environment contract between the orchestrator and a training job.

The orchestrator (or a backend such as SageMaker) sets environment variables; ``read_contract`` turns
them into a ``Contract``. Each value is looked up in this order:

1. the ``TUNEPOD_*`` variable, set by every tunepod launcher;
2. on SageMaker (any ``SM_*`` variable present), SageMaker's own names: ``SM_HPS`` for the parameters,
   ``SM_CHANNEL_TRAIN`` (else the first ``SM_CHANNEL_*`` by name) for the data, ``/opt/ml/checkpoints``
   for checkpoints (SageMaker syncs it with S3), ``SM_OUTPUT_DATA_DIR`` (``/opt/ml/output/data``) for
   the result and metrics files (uploaded with the job's output), ``TRAINING_JOB_NAME`` for the trial;
3. outside any job, a local run: folders under ``<cwd>/.tunepod/local`` (``data/``, ``checkpoints/``,
   ``metrics.jsonl``, ``result.json``). The current directory, not a temp folder, so that a second
   ``python train.py`` resumes from the first one's checkpoints and ``evaluate.py`` finds them.

Parameters are the ``defaults`` given by the script, overlaid by the job's parameters.
Standard library only: this module runs inside training images that may lack everything else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tunepod.runtime.parallel import Parallelism, read_parallelism
from tunepod.runtime.tiers import CheckpointTiers, read_checkpoint_tiers

# Set by the orchestrator for every job.
PARAMS_ENV = "TUNEPOD_PARAMS"
DATA_DIR_ENV = "TUNEPOD_DATA_DIR"
CHECKPOINT_DIR_ENV = "TUNEPOD_CHECKPOINT_DIR"
RESULT_FILE_ENV = "TUNEPOD_RESULT_FILE"
METRICS_FILE_ENV = "TUNEPOD_METRICS_FILE"
TRIAL_ENV = "TUNEPOD_TRIAL"
KEEP_CHECKPOINTS_ENV = "TUNEPOD_KEEP_CHECKPOINTS"
PARALLELISM_ENV = "TUNEPOD_PARALLELISM"  # JSON of tunepod.runtime.parallel.Parallelism; unset: data only
# JSON of tunepod.runtime.tiers.CheckpointTiers; unset: every save goes to the shared folder.
CHECKPOINT_TIERS_ENV = "TUNEPOD_CHECKPOINT_TIERS"
MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
MLFLOW_RUN_ID_ENV = "MLFLOW_RUN_ID"

# Set by torchrun for each process.
RANK_ENV = "RANK"
LOCAL_RANK_ENV = "LOCAL_RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"

# SageMaker's names, used only when the TUNEPOD_ ones are absent.
SAGEMAKER_PARAMS_ENV = "SM_HPS"
SAGEMAKER_CHANNEL_PREFIX = "SM_CHANNEL_"
SAGEMAKER_TRAIN_CHANNEL_ENV = "SM_CHANNEL_TRAIN"
SAGEMAKER_JOB_NAME_ENV = "TRAINING_JOB_NAME"
SAGEMAKER_CHECKPOINT_DIR = Path("/opt/ml/checkpoints")
SAGEMAKER_OUTPUT_DIR = Path("/opt/ml/output/data")
SAGEMAKER_OUTPUT_DIR_ENV = "SM_OUTPUT_DATA_DIR"  # the training toolkit's name for SAGEMAKER_OUTPUT_DIR

_FOLDER_ENVS = (DATA_DIR_ENV, CHECKPOINT_DIR_ENV, RESULT_FILE_ENV, METRICS_FILE_ENV)

DEFAULT_KEEP_CHECKPOINTS = 3
LOCAL_RUN_DIR = Path(".tunepod") / "local"

Source = Literal["tunepod", "sagemaker", "local"]


@dataclass(frozen=True)
class Contract:
    """Everything a job learns from its environment. Immutable; safe to share between threads."""

    source: Source
    """Where the folders came from: ``tunepod`` (any of the TUNEPOD_ folder or file variables set),
    ``sagemaker`` (else, any ``SM_*`` variable set) or ``local`` (none: everything under
    ``.tunepod/local``)."""
    params: dict[str, Any]
    data_dir: Path
    checkpoint_dir: Path
    metrics_file: Path
    result_file: Path
    trial: str | None
    keep_checkpoints: int
    rank: int
    local_rank: int
    world_size: int
    parallelism: Parallelism
    """The job's data x tensor x pipeline layout (``TUNEPOD_PARALLELISM``), checked against
    ``world_size``; plain data parallelism when unset."""
    mlflow_tracking_uri: str | None
    mlflow_run_id: str | None
    checkpoint_tiers: CheckpointTiers | None = None
    """How often saves go to node memory and to the shared folder (``TUNEPOD_CHECKPOINT_TIERS``);
    ``None``: every save goes to the shared folder."""


def read_contract(
    env: Mapping[str, str], defaults: Mapping[str, Any] | None = None, cwd: Path | None = None
) -> Contract:
    """Resolve the contract from ``env`` without touching the filesystem (nothing is created).

    Raises ``ValueError`` naming the variable when one is malformed (bad JSON, a non-integer rank).
    """
    on_sagemaker = any(name.startswith("SM_") for name in env)
    local_dir = (cwd or Path.cwd()) / LOCAL_RUN_DIR
    world_size = _int(env, WORLD_SIZE_ENV, 1, minimum=1)
    sagemaker_output = _path(env, SAGEMAKER_OUTPUT_DIR_ENV) or SAGEMAKER_OUTPUT_DIR
    sagemaker_or_local = sagemaker_output if on_sagemaker else local_dir
    return Contract(
        source=_source(env, on_sagemaker),
        params={**(defaults or {}), **_params(env)},
        data_dir=_path(env, DATA_DIR_ENV) or _sagemaker_channel(env) or local_dir / "data",
        checkpoint_dir=_path(env, CHECKPOINT_DIR_ENV)
        or (SAGEMAKER_CHECKPOINT_DIR if on_sagemaker else local_dir / "checkpoints"),
        metrics_file=_path(env, METRICS_FILE_ENV) or sagemaker_or_local / "metrics.jsonl",
        result_file=_path(env, RESULT_FILE_ENV) or sagemaker_or_local / "result.json",
        trial=env.get(TRIAL_ENV) or env.get(SAGEMAKER_JOB_NAME_ENV) or None,
        keep_checkpoints=_int(env, KEEP_CHECKPOINTS_ENV, DEFAULT_KEEP_CHECKPOINTS, minimum=1),
        rank=_int(env, RANK_ENV, 0, minimum=0),
        local_rank=_int(env, LOCAL_RANK_ENV, 0, minimum=0),
        world_size=world_size,
        parallelism=read_parallelism(env, PARALLELISM_ENV, world_size),
        mlflow_tracking_uri=env.get(MLFLOW_TRACKING_URI_ENV) or None,
        mlflow_run_id=env.get(MLFLOW_RUN_ID_ENV) or None,
        checkpoint_tiers=read_checkpoint_tiers(env, CHECKPOINT_TIERS_ENV),
    )


def _source(env: Mapping[str, str], on_sagemaker: bool) -> Source:
    # Parameters alone (TUNEPOD_PARAMS=... python train.py) are still a local run: what makes a job
    # is being handed its folders.
    if any(env.get(name) for name in _FOLDER_ENVS):
        return "tunepod"
    return "sagemaker" if on_sagemaker else "local"


def _params(env: Mapping[str, str]) -> dict[str, Any]:
    if PARAMS_ENV in env:
        name = PARAMS_ENV
    elif SAGEMAKER_PARAMS_ENV in env:
        name = SAGEMAKER_PARAMS_ENV
    else:
        return {}
    try:
        params = json.loads(env[name])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON ({exc}): {env[name]!r}") from exc
    if not isinstance(params, dict):
        raise ValueError(f"{name} must be a JSON object of parameters, got {env[name]!r}")
    return params


def _path(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name)
    return Path(value) if value else None


def _sagemaker_channel(env: Mapping[str, str]) -> Path | None:
    if env.get(SAGEMAKER_TRAIN_CHANNEL_ENV):
        return Path(env[SAGEMAKER_TRAIN_CHANNEL_ENV])
    channels = sorted(name for name in env if name.startswith(SAGEMAKER_CHANNEL_PREFIX) and env[name])
    return Path(env[channels[0]]) if channels else None


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
