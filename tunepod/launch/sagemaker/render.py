"""The ``CreateTrainingJob`` request for a tunepod job (pure functions; the launcher is ``launcher.py``).

Render, then execute: ``render_training_job`` is a pure function from a ``JobSpec`` to the
``CreateTrainingJob`` request (golden-tested, and checked by botocore's Stubber against the real API
model); ``SageMakerLauncher.send`` sends it with boto3. We render the request ourselves rather than
going through ``sagemaker.train.ModelTrainer``: the request is then a plain dict that botocore
validates, and the launcher needs only boto3 (the ``sagemaker`` SDK stays in the ``aws`` extra, for
users' own code).

How a job runs there: the image is a SageMaker PyTorch training container (or one built on it), whose
sagemaker-training toolkit reads the ``sagemaker_*`` hyperparameters, copies the code from
``sagemaker_submit_directory`` and, with ``sagemaker_torch_distributed_enabled``, starts the
entrypoint under torchrun on every instance, one process per GPU. The toolkit exports ``SM_HPS`` (the
trial parameters), ``SM_CHANNEL_TRAIN`` (the FSx mount) and friends, which ``tunepod.runtime`` reads.

Paths: with ``spec.fsx`` every job mounts ``fsx.directory_path`` as its ``train`` channel at
``/opt/ml/input/data/train``. tunepod sees the same directory at ``spec.root``, so the contract's
paths under ``root`` (data, metrics file, result file, even the code) are rewritten to the mount and
the orchestrator reads what the job writes, as on Slurm.

Checkpoints: with a read-write FSx channel they go where every other backend keeps them, the job's
checkpoint dir under ``root`` (rewritten to the mount): the orchestrator logs the final one as an MLflow
model, evaluation jobs and resubmits read them in place, and an ``export`` step can send them to S3.
A job restarted by RetryStrategy sees the same file system, so it resumes as well. Without a writable
FSx channel they go to ``/opt/ml/checkpoints``, which SageMaker syncs with ``CheckpointConfig.S3Uri``
(downloaded before the script starts, uploaded while it runs). That URI is keyed by the checkpoint
dir, not by the job: ``<checkpoint_s3_uri>/<checkpoint dir relative to root>``, so a trial's job, its
resubmits and an evaluation job pointed at the trial's checkpoint dir share one prefix. The
orchestrator cannot read such checkpoints (nor, with a read-only channel, results): that mode runs
jobs, not whole pipelines, and the launcher says so once.

Names: a training job name is unique in an account and region for good, so attempt N > 1 of one
tunepod job is ``<name>-rN`` (the attempt is counted in ``<job_dir>/submission.json``), and a name
that another submission already holds (a job dir deleted and made again, two tunepod names that clean
to one) gets a variant suffix ``-vK``. The request's ``Environment`` carries the job's whole
environment, ``TUNEPOD_SUBMISSION_ID`` included: DescribeTrainingJob returns it, which is how the
launcher tells its own job from another submission's under one name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from tunepod import runtime
from tunepod.errors import TunepodError
from tunepod.launch.base import JobSpec, Resources
from tunepod.launch.refusals import refuse
from tunepod.launch.sagemaker.images import training_image
from tunepod.runtime.parallel import read_parallelism
from tunepod.spec.models import SageMakerLauncherSpec

CHANNEL = "train"
CHANNEL_MOUNT = PurePosixPath("/opt/ml/input/data") / CHANNEL
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
MAX_NAME_LENGTH = 63
REQUEST_FILE = "training-job.json"
NO_INSTANCE_TYPE = "<instance type>"
"""What a dry run shows for the instance type of a job that names none (``refuse``)."""
"""The rendered request, kept in the job dir for people to read (owner-only: it holds the environment)."""

# Hyperparameter names the PyTorch containers' toolkit reads (sagemaker-python-sdk,
# src/sagemaker/pytorch/estimator.py: LAUNCH_TORCH_DISTRIBUTED_ENV_NAME, INSTANCE_TYPE_ENV_NAME;
# sagemaker-training-toolkit: sagemaker_program, sagemaker_submit_directory).
HP_PROGRAM = "sagemaker_program"
HP_SUBMIT_DIRECTORY = "sagemaker_submit_directory"
HP_TORCH_DISTRIBUTED = "sagemaker_torch_distributed_enabled"
HP_INSTANCE_TYPE = "sagemaker_instance_type"
# SMP v2 takes its settings as one JSON hyperparameter (sagemaker-train,
# sagemaker/train/distributed.py: SMP._to_mp_hyperparameters; keys from the SMP v2 reference,
# docs.aws.amazon.com/sagemaker/latest/dg/distributed-model-parallel-v2-reference.html).
HP_SMP = "mp_parameters"
_RESERVED_PARAM = re.compile(r"^(sagemaker_|mp_parameters$)")

# Contract variables that name orchestrator-side paths: rewritten to the FSx mount, else dropped so
# that the runtime falls back to SageMaker's own folders (/opt/ml/output/data, SM_CHANNEL_*).
_PATH_ENVS = (runtime.DATA_DIR_ENV, runtime.RESULT_FILE_ENV, runtime.METRICS_FILE_ENV)
_WRITTEN_PATH_ENVS = (runtime.RESULT_FILE_ENV, runtime.METRICS_FILE_ENV)


def training_job_name(name: str, attempt: int = 1, variant: int = 0) -> str:
    """A valid, stable training job name for attempt ``attempt`` of tunepod job ``name``; ``variant`` > 0
    when the names before it are held by other submissions.

    SageMaker allows 63 characters of ``[a-zA-Z0-9-]``, starting and ending alphanumeric. Other
    characters become ``-``; when that loses information (``a_b`` and ``a.b`` would clash) or the name
    is too long, an 8-character hash of the original name keeps distinct jobs distinct.
    """
    suffix = (f"-r{attempt}" if attempt > 1 else "") + (f"-v{variant}" if variant > 0 else "")
    cleaned = re.sub(r"-{2,}", "-", re.sub(r"[^a-zA-Z0-9-]", "-", name)).strip("-") or "tunepod-job"
    if cleaned == name and len(cleaned) + len(suffix) <= MAX_NAME_LENGTH:
        return cleaned + suffix
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    keep = MAX_NAME_LENGTH - len(suffix) - len(digest) - 1
    return f"{cleaned[:keep].rstrip('-')}-{digest}{suffix}"


def instance_type(resources: Resources, spec: SageMakerLauncherSpec) -> str:
    """The job's instance type, else the launcher's; refuses a job that names neither."""
    chosen = resources.instance_type or spec.instance_type
    if chosen is None:
        refuse(
            "a SageMaker job needs an instance type; fix: set resources.instance_type of the job "
            "(e.g. ml.g5.12xlarge) or instance_type of the sagemaker launcher"
        )
        return NO_INSTANCE_TYPE
    return chosen


def ignored_resources(resources: Resources) -> dict[str, str]:
    """What SageMaker cannot honour in ``resources``, keyed by field."""
    ignored: dict[str, str] = {}
    # gpus_per_node is not ignored: it states the instance's GPUs for the parallelism check.
    if resources.procs_per_node not in (1, resources.gpus_per_node):
        ignored["procs_per_node"] = (
            f"resources.procs_per_node={resources.procs_per_node} ignored: the PyTorch container starts "
            "one process per GPU of the instance type"
        )
    return ignored


def relative_to_root(path: Path | str, spec: SageMakerLauncherSpec) -> PurePosixPath | None:
    """``path`` relative to ``spec.root`` (both made absolute and normalized), or None if outside it."""
    try:
        return PurePosixPath(os.path.abspath(path)).relative_to(os.path.abspath(spec.root))
    except ValueError:
        return None


def container_path(path: Path, spec: SageMakerLauncherSpec) -> str | None:
    """Where the job sees ``path`` (a path under ``spec.root``), or None when it cannot see it."""
    relative = relative_to_root(path, spec)
    if spec.fsx is None or relative is None:
        return None
    return str(CHANNEL_MOUNT / relative)


def checkpoints_on_fsx(spec: SageMakerLauncherSpec) -> bool:
    """Whether jobs keep checkpoints on the FSx channel (read-write) rather than syncing them with S3."""
    return spec.fsx is not None and spec.fsx.access_mode == "rw"


def checkpoint_dir(job: JobSpec) -> Path:
    """The folder whose checkpoints the job reads and writes: the contract's ``TUNEPOD_CHECKPOINT_DIR``
    (an evaluation job points it at a trial's), else the job's own ``checkpoints`` folder."""
    configured = job.env.get(runtime.CHECKPOINT_DIR_ENV)
    return Path(configured) if configured else job.paths.checkpoints


def checkpoint_s3_uri(job: JobSpec, spec: SageMakerLauncherSpec) -> str:
    """``CheckpointConfig.S3Uri``: ``<checkpoint_s3_uri>/<checkpoint dir relative to root>``.

    Keyed by the folder, not the job, so every job handed one checkpoint dir (a trial, its resubmits,
    its evaluation) syncs ``/opt/ml/checkpoints`` with the same prefix.
    """
    directory = checkpoint_dir(job)
    relative = relative_to_root(directory, spec)
    if relative is None:
        refuse(
            f"checkpoint dir {directory} of job {job.name} is outside root {spec.root}, so it has no S3 "
            "prefix that other jobs could find; fix: keep job dirs (and the checkpoint dirs evaluations "
            "read) under root"
        )
        relative = PurePosixPath(directory.as_posix().lstrip("/"))
    if spec.checkpoint_s3_uri is None:  # the spec requires it whenever checkpoints go to S3
        raise TunepodError("checkpoints go to S3 but the launcher has no checkpoint_s3_uri; fix: set it")
    prefix = spec.checkpoint_s3_uri.rstrip("/")
    return f"{prefix}/{relative}" if relative.parts else prefix


def _mounted(what: str, path: Path, spec: SageMakerLauncherSpec) -> str:
    mounted = container_path(path, spec)
    if mounted is None:
        where = f"under root {spec.root}" if spec.fsx else "on FSx (set fsx and root on the launcher)"
        refuse(f"{what} {path} is not visible to SageMaker jobs; fix: keep it {where}")
        return str(path)
    return mounted


def trial_params(job: JobSpec) -> dict[str, Any]:
    """The parameters of the contract (``TUNEPOD_PARAMS``), refusing names the container reserves."""
    params: dict[str, Any] = json.loads(job.env.get(runtime.PARAMS_ENV, "{}"))
    reserved = sorted(name for name in params if _RESERVED_PARAM.match(name))
    if reserved:
        refuse(
            f"parameter names {', '.join(reserved)} are reserved by SageMaker's containers; fix: rename them"
        )
    return params


def smp_parameters(job: JobSpec) -> dict[str, int] | None:
    """SMP v2 settings for the job's layout (``TUNEPOD_PARALLELISM``), or None when SMP stays off.

    SMP v2 takes the tensor degree and, for hybrid sharding, the shard degree; it derives the data
    degree itself (world size / tensor). Pipeline parallelism is not SMP v2's but the script's
    (``torch.distributed.pipelining`` over ``ctx.device_mesh()["pp"]``), so it is handed over, not
    rendered. The spec checked the layout against ``procs_per_node``, but the container starts one
    process per GPU: a layout that does not fit ``num_nodes x gpus_per_node`` is refused here.
    """
    resources = job.resources
    gpus = resources.gpus_per_node or resources.procs_per_node
    world_size = resources.num_nodes * gpus
    try:
        layout = read_parallelism(job.env, runtime.PARALLELISM_ENV, world_size)
    except ValueError as exc:
        raise TunepodError(
            f"job {job.name}: {exc} (SageMaker runs one process per GPU: {resources.num_nodes} nodes x "
            f"{gpus} GPUs = {world_size}); fix: set resources.procs_per_node to gpus_per_node ({gpus}) "
            "and fit the parallelism to it"
        ) from None
    smp: dict[str, int] = {}
    if layout.tensor > 1:
        smp["tensor_parallel_degree"] = layout.tensor
    if layout.sharding == "hybrid":
        smp["hybrid_shard_degree"] = layout.shard
    return smp or None


def hyperparameters(job: JobSpec, spec: SageMakerLauncherSpec) -> dict[str, str]:
    """Trial parameters plus the container's ``sagemaker_*`` settings, each value JSON-encoded.

    SageMaker takes strings only; like the SageMaker SDK we JSON-encode every value and the
    container's toolkit decodes them again, so ``SM_HPS`` holds the parameters with their types.
    """
    if job.args:
        refuse(
            f"job {job.name} has argv {list(job.args)!r}, which SageMaker cannot pass (the container builds "
            "the script's argv from hyperparameters); fix: pass them as parameters"
        )
    values: dict[str, object] = dict(trial_params(job))
    if spec.code_uri is not None:
        values[HP_SUBMIT_DIRECTORY] = spec.code_uri
    else:
        values[HP_SUBMIT_DIRECTORY] = _mounted("entrypoint folder", job.entrypoint.parent, spec)
    values[HP_PROGRAM] = job.entrypoint.name
    values[HP_TORCH_DISTRIBUTED] = True
    values[HP_INSTANCE_TYPE] = instance_type(job.resources, spec)
    smp = smp_parameters(job)
    if smp is not None:
        values[HP_SMP] = smp
    return {name: json.dumps(value, sort_keys=True) for name, value in values.items()}


def environment(job: JobSpec, spec: SageMakerLauncherSpec) -> dict[str, str]:
    """The launcher's ``env``, then the job's contract (which wins), with its paths made the job's own.

    The parameters travel as hyperparameters instead. Paths under ``root`` become paths on the FSx
    mount; a path the job cannot see (or, on a read-only channel, could not write) is dropped so that
    the runtime falls back to SageMaker's own folder. Checkpoints: see the module docstring.
    """
    env = {**spec.env, **job.env}
    env.pop(runtime.PARAMS_ENV, None)
    writable = checkpoints_on_fsx(spec)
    for name in _PATH_ENVS:
        if name not in env:
            continue
        mounted = container_path(Path(env[name]), spec)
        if mounted is None or (name in _WRITTEN_PATH_ENVS and not writable):
            del env[name]
        else:
            env[name] = mounted
    if writable:
        env[runtime.CHECKPOINT_DIR_ENV] = _mounted("checkpoint dir", checkpoint_dir(job), spec)
    else:
        env[runtime.CHECKPOINT_DIR_ENV] = CHECKPOINT_LOCAL_PATH
    return env


def max_runtime_s(resources: Resources, spec: SageMakerLauncherSpec) -> int:
    """The job's timeout in whole seconds (rounded up), else the launcher's default."""
    if resources.timeout_min is None:
        return spec.max_runtime_s
    return max(1, math.ceil(resources.timeout_min * 60))


def fsx_channel(spec: SageMakerLauncherSpec) -> list[dict[str, Any]]:
    """``InputDataConfig``: the FSx for Lustre directory as the ``train`` channel (none without FSx)."""
    if spec.fsx is None:
        return []
    source = {
        "FileSystemId": spec.fsx.file_system_id,
        "FileSystemAccessMode": spec.fsx.access_mode,
        "FileSystemType": "FSxLustre",
        "DirectoryPath": spec.fsx.directory_path,
    }
    # A file system channel is mounted, never copied: File is the only input mode it takes.
    return [{"ChannelName": CHANNEL, "DataSource": {"FileSystemDataSource": source}, "InputMode": "File"}]


def render_training_job(
    job: JobSpec,
    spec: SageMakerLauncherSpec,
    *,
    attempt: int = 1,
    variant: int = 0,
    region: str | None = None,
) -> dict[str, Any]:
    """The ``CreateTrainingJob`` request for attempt ``attempt`` (name variant ``variant``) of ``job`` (pure
    but for the image lookup of a ``framework_version``, in ``region``, from the SDK's own tables).

    Refuses (``refuse``) what a training job could not run (argv, paths SageMaker cannot see, no
    instance type, reserved parameter names, no region to find the image in); raises ``TunepodError``
    for what it cannot express (inconsistent parallelism, no image for the framework version).
    """
    instance = instance_type(job.resources, spec)
    smp = smp_parameters(job) is not None
    if instance == NO_INSTANCE_TYPE:  # refused: the image (CPU or GPU) depends on the instance type
        image = spec.image_uri or f"<the training image of the {NO_INSTANCE_TYPE}>"
    else:  # SMP v2's settings need SMP v2's image (``images``)
        image = training_image(spec, instance, region or spec.region, smp=smp)
    request: dict[str, Any] = {
        "TrainingJobName": training_job_name(job.name, attempt, variant),
        "RoleArn": spec.role_arn,
        "AlgorithmSpecification": {"TrainingImage": image, "TrainingInputMode": spec.input_mode},
        "HyperParameters": hyperparameters(job, spec),
        "Environment": environment(job, spec),
        "ResourceConfig": {
            "InstanceType": instance,
            "InstanceCount": job.resources.num_nodes,
            "VolumeSizeInGB": spec.volume_size_gb,
        },
        "OutputDataConfig": {"S3OutputPath": spec.output_s3_uri},
        "StoppingCondition": {"MaxRuntimeInSeconds": max_runtime_s(job.resources, spec)},
        "RetryStrategy": {"MaximumRetryAttempts": spec.max_retry_attempts},
    }
    if not checkpoints_on_fsx(spec):
        sync = {"S3Uri": checkpoint_s3_uri(job, spec), "LocalPath": CHECKPOINT_LOCAL_PATH}
        request["CheckpointConfig"] = sync
    channels = fsx_channel(spec)
    if channels:
        request["InputDataConfig"] = channels
    if spec.subnets:
        request["VpcConfig"] = {
            "SecurityGroupIds": list(spec.security_group_ids),
            "Subnets": list(spec.subnets),
        }
    return request
