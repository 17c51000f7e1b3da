"""Run jobs as SageMaker training jobs.

Render, then execute: ``render_training_job`` is a pure function from a ``JobSpec`` to the
``CreateTrainingJob`` request (golden-tested, and checked by botocore's Stubber against the real API
model); ``SageMakerLauncher.submit`` sends it with boto3. We render the request ourselves rather than
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
tunepod job is ``<name>-rN``; the attempt is counted in ``<job_dir>/submission.json``.

States: one DescribeTrainingJob per job answers ``state()`` for ``spec.poll_cache_s`` (a final state
for good). Per job, because no call lists the states of just the jobs we follow: ListTrainingJobs
pages through every job of the account (filters: a name substring, times, one status) and carries no
FailureReason. Logs: the job's output is in CloudWatch Logs (group ``/aws/sagemaker/TrainingJobs``, one
stream ``<job>/algo-<n>-<ts>`` per instance); ``logs()`` reads its tail from there.

Tested against the SageMaker stand-in of ``tests/standins/sagemaker_api.py`` (the launcher contract
suite: real boto3 clients over HTTP, local torchrun processes, checkpoints synced to moto's S3),
against moto's server (create and describe; its jobs complete at once and cannot be stopped) and with
botocore's Stubber for what neither reaches (Stopping, MaxRuntimeExceeded, racing a stop).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from tunepod import runtime
from tunepod.errors import JobError, TransientError, TunepodError
from tunepod.launch.base import JobSpec, JobState, Resources
from tunepod.launch.paths import JobPaths
from tunepod.runtime.files import write_bytes_atomic
from tunepod.spec.models import SageMakerLauncherSpec

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tunepod[aws]'"
CHANNEL = "train"
CHANNEL_MOUNT = PurePosixPath("/opt/ml/input/data") / CHANNEL
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
REQUEST_NAME = "training-job.json"
MAX_NAME_LENGTH = 63
_NAME_ATTEMPTS = 5
_CANCEL_POLL_S = 2.0

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

# ------------------------------------------------------------------------------------------ states

# TrainingJobStatus -> JobState, for every status but InProgress (decided by SecondaryStatus).
TRAINING_JOB_STATES: Mapping[str, JobState] = {
    "Completed": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
    # StopTrainingJob was called; SageMaker is still shutting the instances down (and uploading the
    # output): not over yet, so that cancel() returns only once nothing of the job is left.
    "Stopping": JobState.RUNNING,
    "Stopped": JobState.CANCELLED,
}

# SecondaryStatus of an InProgress job -> JobState: the script runs only in Training (and the upload
# after it); everything before is provisioning.
IN_PROGRESS_SECONDARY_STATES: Mapping[str, JobState] = {
    "Starting": JobState.PENDING,
    "Pending": JobState.PENDING,
    "LaunchingMLInstances": JobState.PENDING,
    "PreparingTrainingStack": JobState.PENDING,
    "Downloading": JobState.PENDING,
    "DownloadingTrainingImage": JobState.PENDING,
    # Managed spot capacity was taken back; the job waits for capacity and resumes from checkpoints.
    "Interrupted": JobState.PENDING,
    # RetryStrategy is starting the job again after an internal error.
    "Restarting": JobState.PENDING,
    "Training": JobState.RUNNING,
    "Uploading": JobState.RUNNING,
    "Updating": JobState.RUNNING,
}

# A Stopped job stopped by SageMaker itself at a limit failed; tunepod's own stops are cancellations.
_LIMIT_SECONDARY_STATES = frozenset({"MaxRuntimeExceeded", "MaxWaitTimeExceeded"})

# A script error's FailureReason: "AlgorithmError: ExecuteUserScriptError:\nExitCode 1\nErrorMessage
# ...\nCommand ..., exit code: 1" (the sagemaker-training toolkit's ExecuteUserScriptError).
_EXIT_CODE = re.compile(r"exit\s*code\s*:?\s*(-?\d+)", re.IGNORECASE)


def map_training_job_state(status: str, secondary_status: str = "") -> JobState:
    """DescribeTrainingJob's ``TrainingJobStatus`` and ``SecondaryStatus`` -> ``JobState``.

    An unknown status (a newer API) is logged once and read as RUNNING, so the job is followed until
    a known state (or the caller's timeout) ends it.
    """
    if status == "InProgress":
        mapped = IN_PROGRESS_SECONDARY_STATES.get(secondary_status)
        if mapped is None:
            _warn_unknown_state(f"InProgress/{secondary_status}")
            return JobState.RUNNING
        return mapped
    if status == "Stopped" and secondary_status in _LIMIT_SECONDARY_STATES:
        return JobState.FAILED
    mapped = TRAINING_JOB_STATES.get(status)
    if mapped is None:
        _warn_unknown_state(status)
        return JobState.RUNNING
    return mapped


@functools.cache
def _warn_unknown_state(name: str) -> None:
    # Cached: a job polled every few seconds would otherwise repeat the warning each time.
    logger.warning("unknown SageMaker training job status %r, treated as RUNNING until it changes", name)


# ------------------------------------------------------------------------------------------ rendering


def training_job_name(name: str, attempt: int = 1) -> str:
    """A valid, stable training job name for attempt ``attempt`` of tunepod job ``name``.

    SageMaker allows 63 characters of ``[a-zA-Z0-9-]``, starting and ending alphanumeric. Other
    characters become ``-``; when that loses information (``a_b`` and ``a.b`` would clash) or the name
    is too long, an 8-character hash of the original name keeps distinct jobs distinct.
    """
    suffix = f"-r{attempt}" if attempt > 1 else ""
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
        raise TunepodError(
            "a SageMaker job needs an instance type; fix: set resources.instance_type of the job "
            "(e.g. ml.g5.12xlarge) or instance_type of the sagemaker launcher"
        )
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
        raise TunepodError(
            f"checkpoint dir {directory} of job {job.name} is outside root {spec.root}, so it has no S3 "
            "prefix that other jobs could find; fix: keep job dirs (and the checkpoint dirs evaluations "
            "read) under root"
        )
    if spec.checkpoint_s3_uri is None:  # the spec requires it whenever checkpoints go to S3
        raise TunepodError("checkpoints go to S3 but the launcher has no checkpoint_s3_uri; fix: set it")
    prefix = spec.checkpoint_s3_uri.rstrip("/")
    return f"{prefix}/{relative}" if relative.parts else prefix


def _mounted(what: str, path: Path, spec: SageMakerLauncherSpec) -> str:
    mounted = container_path(path, spec)
    if mounted is None:
        where = f"under root {spec.root}" if spec.fsx else "on FSx (set fsx and root on the launcher)"
        raise TunepodError(f"{what} {path} is not visible to SageMaker jobs; fix: keep it {where}")
    return mounted


def trial_params(job: JobSpec) -> dict[str, Any]:
    """The parameters of the contract (``TUNEPOD_PARAMS``), refusing names the container reserves."""
    params: dict[str, Any] = json.loads(job.env.get(runtime.PARAMS_ENV, "{}"))
    reserved = sorted(name for name in params if _RESERVED_PARAM.match(name))
    if reserved:
        raise TunepodError(
            f"parameter names {', '.join(reserved)} are reserved by SageMaker's containers; fix: rename them"
        )
    return params


def smp_parameters(job: JobSpec, spec: SageMakerLauncherSpec) -> dict[str, int] | None:
    """SMP v2 settings for ``spec.parallelism``, or None when SMP stays off (tensor degree 1).

    SMP v2 derives the data-parallel degree itself (world size / tensor degree); a declared ``data``
    degree is only checked against it, so a spec that disagrees with the instance count fails here.
    """
    parallel = spec.parallelism
    gpus = job.resources.gpus_per_node or job.resources.procs_per_node
    world_size = job.resources.num_nodes * gpus
    if parallel.data is not None and parallel.data * parallel.tensor != world_size:
        raise TunepodError(
            f"parallelism data={parallel.data} x tensor={parallel.tensor} != world size {world_size} "
            f"({job.resources.num_nodes} nodes x {gpus} GPUs); fix: change data, or unset it to derive it"
        )
    if parallel.tensor == 1:
        return None
    return {"tensor_parallel_degree": parallel.tensor}


def hyperparameters(job: JobSpec, spec: SageMakerLauncherSpec) -> dict[str, str]:
    """Trial parameters plus the container's ``sagemaker_*`` settings, each value JSON-encoded.

    SageMaker takes strings only; like the SageMaker SDK we JSON-encode every value and the
    container's toolkit decodes them again, so ``SM_HPS`` holds the parameters with their types.
    """
    if job.args:
        raise TunepodError(
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
    smp = smp_parameters(job, spec)
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


def render_training_job(job: JobSpec, spec: SageMakerLauncherSpec, *, attempt: int = 1) -> dict[str, Any]:
    """The ``CreateTrainingJob`` request for attempt ``attempt`` of ``job`` (pure).

    Raises ``TunepodError`` for what a training job cannot express (argv, paths SageMaker cannot see,
    no instance type, inconsistent parallelism).
    """
    request: dict[str, Any] = {
        "TrainingJobName": training_job_name(job.name, attempt),
        "RoleArn": spec.role_arn,
        "AlgorithmSpecification": {"TrainingImage": spec.image_uri, "TrainingInputMode": spec.input_mode},
        "HyperParameters": hyperparameters(job, spec),
        "Environment": environment(job, spec),
        "ResourceConfig": {
            "InstanceType": instance_type(job.resources, spec),
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


# ------------------------------------------------------------------------------------------ jobs


@dataclass(frozen=True)
class TrainingJobStatus:
    """What DescribeTrainingJob says about one job."""

    status: str
    secondary_status: str = ""
    failure_reason: str = ""

    @classmethod
    def from_describe(cls, response: Mapping[str, Any]) -> TrainingJobStatus:
        return cls(
            status=str(response.get("TrainingJobStatus", "")),
            secondary_status=str(response.get("SecondaryStatus", "")),
            failure_reason=str(response.get("FailureReason", "")),
        )

    @property
    def job_state(self) -> JobState:
        return map_training_job_state(self.status, self.secondary_status)

    @property
    def exit_code(self) -> int | None:
        """The script's exit code when the FailureReason names one (a script error), else None."""
        return exit_code_of(self.failure_reason)

    @property
    def one_line_reason(self) -> str:
        # SageMaker's reasons for a script error span several lines.
        return " ".join(self.failure_reason.split())

    def describe(self, job_id: str) -> str:
        """One line: ``sagemaker training job x Failed (exit code 1; Failed: AlgorithmError: ...)``."""
        details = [part for part in (self.secondary_status, self.one_line_reason) if part]
        code = "" if self.exit_code is None else f"exit code {self.exit_code}; "
        suffix = f" ({code}{': '.join(details)})" if details else ""
        return f"sagemaker training job {job_id} {self.status}{suffix}"


def exit_code_of(failure_reason: str) -> int | None:
    """The exit code in a FailureReason (``... ExitCode 1 ...``, ``exit code: 1``), or None."""
    match = _EXIT_CODE.search(failure_reason)
    return int(match.group(1)) if match else None


def log_hint(job_id: str) -> str:
    """Where a training job's output is: CloudWatch Logs, one stream per instance."""
    return f"CloudWatch Logs group {LOG_GROUP}, streams {job_id}/algo-<n>-<timestamp>"


class TrainingJobStatusCache:
    """DescribeTrainingJob answers, at most one call per job every ``max_age_s`` seconds.

    Per job (see the module docstring for why there is no one-call-for-all). A final status is kept
    for good: once SageMaker says a job ended, it is never asked again. Thread safety: every method
    may be called from several threads; callers asking about one job share one call (a lock per job),
    different jobs are described concurrently.
    """

    def __init__(self, client: Any, max_age_s: float) -> None:
        self.client = client
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._job_locks: dict[str, threading.Lock] = {}
        self._known: dict[str, tuple[TrainingJobStatus, float]] = {}

    def status(self, job_id: str, *, max_age_s: float | None = None) -> TrainingJobStatus:
        """The status of ``job_id``, at most ``max_age_s`` (default: the cache's) seconds old.

        Raises ``JobError`` when SageMaker does not know the job, ``TransientError`` when a retry may help.
        """
        limit = self.max_age_s if max_age_s is None else max_age_s
        with self._lock_of(job_id):
            with self._lock:
                known = self._known.get(job_id)
            if known is not None:
                status, fetched_at = known
                if status.job_state.is_terminal or time.monotonic() - fetched_at < limit:
                    return status
            status = self._describe(job_id)
            with self._lock:
                self._known[job_id] = (status, time.monotonic())
            return status

    def _lock_of(self, job_id: str) -> threading.Lock:
        with self._lock:
            return self._job_locks.setdefault(job_id, threading.Lock())

    def _describe(self, job_id: str) -> TrainingJobStatus:
        try:
            response = self.client.describe_training_job(TrainingJobName=job_id)
        except Exception as exc:
            raise _translate(exc, f"describe sagemaker training job {job_id}") from exc
        return TrainingJobStatus.from_describe(response)


class CloudWatchLogReader:
    """The tail of a training job's output, read from CloudWatch Logs.

    ``make_client`` builds the boto3 ``logs`` client on first use (a launcher whose jobs never fail
    never needs one). Reading never raises: logs are what an error message shows, so a missing stream
    or permission becomes a line saying so. Thread safety: safe from several threads.
    """

    def __init__(self, make_client: Callable[[], Any]) -> None:
        self._make_client = make_client
        self._client: Any | None = None
        self._lock = threading.Lock()

    def tail(self, job_id: str, lines: int) -> list[str]:
        """The last ``lines`` lines of every instance's stream (algo-1 first), or why there are none."""
        try:
            client = self._client_once()
            streams = _log_streams(client, job_id)
            if not streams:
                return [f"(no CloudWatch log streams for {job_id} yet: its instances have not started)"]
            tails = [(stream, _stream_tail(client, stream, lines)) for stream in streams]
        except Exception as exc:
            return [f"(cannot read CloudWatch Logs for {job_id}: {_error_text(exc)})"]
        if len(tails) == 1:
            return tails[0][1]
        return [line for stream, text in tails for line in (f"==> {stream} <==", *text)]

    def _client_once(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client


def _log_streams(client: Any, job_id: str) -> list[str]:
    """The job's stream names, ``algo-1`` first (a prefix search: ``<job>/`` matches no other job)."""
    names: list[str] = []
    request: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{job_id}/"}
    while True:
        response = client.describe_log_streams(**request)
        names += [str(stream["logStreamName"]) for stream in response.get("logStreams", [])]
        if not response.get("nextToken"):
            break
        request["nextToken"] = response["nextToken"]
    return sorted(names, key=_instance_order)


def _instance_order(stream: str) -> tuple[int, str]:
    match = re.search(r"/algo-(\d+)", stream)
    return (int(match.group(1)) if match else 0, stream)


def _stream_tail(client: Any, stream: str, lines: int) -> list[str]:
    # startFromHead=False: the newest ``limit`` events, in order; an event is usually one line.
    response = client.get_log_events(
        logGroupName=LOG_GROUP, logStreamName=stream, startFromHead=False, limit=min(lines, 10_000)
    )
    text = [line for event in response.get("events", []) for line in str(event["message"]).splitlines()]
    return text[-lines:]


def _error_text(exc: BaseException) -> str:
    code = _error_code(exc)
    if code == "ResourceNotFoundException":
        return f"{LOG_GROUP} does not exist yet in this account and region"
    if code == "AccessDeniedException":
        return "access denied; fix: allow logs:DescribeLogStreams and logs:GetLogEvents on it"
    return f"{type(exc).__name__}: {exc}"


class SageMakerJob:
    """A submitted SageMaker training job, followed through its launcher's status cache.

    Thread safety: boto3 clients are thread-safe and the cache is, so every method may be called from
    several threads; concurrent ``cancel`` calls are serialized and all return once the job has ended.
    """

    def __init__(
        self,
        job_id: str,
        job_dir: Path,
        *,
        client: Any,
        cache: TrainingJobStatusCache,
        log_reader: CloudWatchLogReader,
        cancel_timeout_s: float,
        poll_s: float,
    ) -> None:
        self.job_id = job_id
        self.job_dir = job_dir
        self._client = client
        self._cache = cache
        self._log_reader = log_reader
        self._cancel_timeout_s = cancel_timeout_s
        self._poll_s = poll_s
        self._paths = JobPaths(job_dir)
        self._cancel_lock = threading.Lock()

    def status(self, *, max_age_s: float | None = None) -> TrainingJobStatus:
        """SageMaker's view of the job (cached, see ``TrainingJobStatusCache.status``)."""
        return self._cache.status(self.job_id, max_age_s=max_age_s)

    def state(self) -> JobState:
        return self.status().job_state

    def cancel(self) -> None:
        """Mark the job cancelled, StopTrainingJob it and wait until SageMaker says it ended.

        Idempotent; a job that has already ended keeps its real outcome. Raises ``JobError`` when it is
        still not over after ``cancel_timeout_s``.
        """
        with self._cancel_lock:
            if self.status(max_age_s=0).job_state.is_terminal:
                return
            self._paths.job_dir.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self._paths.cancelled, f"cancelled at {_now()}\n".encode())
            self._stop()
            self._wait_until_ended()

    def logs(self, tail: int = 50) -> str:
        """The last ``tail`` lines of the job's CloudWatch output, SageMaker's FailureReason, and
        where the full logs are. Never raises: what cannot be read is said instead."""
        if tail <= 0:
            return ""
        lines = self._log_reader.tail(self.job_id, tail)
        try:
            reason = self.status().one_line_reason
        except TunepodError as exc:
            lines.append(f"(could not describe the job: {exc})")
        else:
            if reason:
                lines.append(f"FailureReason: {reason}")
        lines.append(f"Full logs: {log_hint(self.job_id)}")
        return "\n".join(lines)

    def describe(self) -> str:
        return self.status().describe(self.job_id)

    def _stop(self) -> None:
        try:
            self._client.stop_training_job(TrainingJobName=self.job_id)
        except Exception as exc:
            # It ended between our look and the stop (SageMaker then answers ValidationException):
            # the wait below sees its real outcome.
            if _error_code(exc) != "ValidationException":
                raise _translate(exc, f"stop sagemaker training job {self.job_id}") from exc

    def _wait_until_ended(self) -> None:
        deadline = time.monotonic() + self._cancel_timeout_s
        # Asked fresh each time: a long poll_cache_s must not slow a cancel down.
        while not (status := self.status(max_age_s=0)).job_state.is_terminal:
            if time.monotonic() > deadline:
                raise JobError(
                    f"{status.describe(self.job_id)} {self._cancel_timeout_s:.0f}s after StopTrainingJob; "
                    f"check it in the SageMaker console; logs: {log_hint(self.job_id)}"
                )
            time.sleep(self._poll_s)


# ------------------------------------------------------------------------------------------ launcher


class SageMakerLauncher:
    """Submits jobs as SageMaker training jobs with boto3 and follows them with DescribeTrainingJob.

    ``client`` is a boto3 ``sagemaker`` client and ``logs_client`` a ``logs`` one (default: new ones
    for ``spec.region``, made by boto3, so ``AWS_ENDPOINT_URL_SAGEMAKER`` and
    ``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS`` apply; the logs client is made on first use, in the region
    of ``client``). Handles from one launcher share its status cache. Thread safety: ``submit`` and
    ``attach`` may be called from several threads.
    """

    kind = "sagemaker"

    def __init__(
        self,
        spec: SageMakerLauncherSpec,
        client: Any | None = None,
        *,
        logs_client: Any | None = None,
        cancel_timeout_s: float = 900.0,
        poll_s: float = _CANCEL_POLL_S,
    ) -> None:
        self.spec = spec
        self.client = client if client is not None else sagemaker_client(spec.region)
        self.cancel_timeout_s = cancel_timeout_s
        self.poll_s = poll_s
        self.cache = TrainingJobStatusCache(self.client, spec.poll_cache_s)
        region = spec.region or getattr(getattr(self.client, "meta", None), "region_name", None)
        self.log_reader = CloudWatchLogReader(
            (lambda: logs_client) if logs_client is not None else (lambda: aws_client("logs", region))
        )
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()

    def submit(self, job: JobSpec) -> SageMakerJob:
        """Create the training job and record ``submission.json`` (and the request) in the job dir.

        A job dir whose previous training job has not ended is refused. If the name of the next
        attempt is taken (a crash between create and record), the attempt after it is tried.
        """
        self._warn_ignored(job)
        paths = job.paths
        previous = _read_submission(paths)
        attempt = int(previous.get("attempt", 0)) + 1 if previous else 1
        request = render_training_job(job, self.spec, attempt=attempt)  # refuses bad input before writes
        paths.job_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_if_running(paths, previous)
        paths.cancelled.unlink(missing_ok=True)
        for _ in range(_NAME_ATTEMPTS):
            try:
                response = self.client.create_training_job(**request)
                break
            except Exception as exc:
                if _error_code(exc) != "ResourceInUse":
                    raise _translate(exc, f"create sagemaker training job for {job.name}") from exc
                attempt += 1
                request = render_training_job(job, self.spec, attempt=attempt)
        else:
            raise JobError(f"training job names for {job.name} up to attempt {attempt} are all taken")
        job_id = request["TrainingJobName"]
        write_bytes_atomic(paths.job_dir / REQUEST_NAME, json.dumps(request, indent=2).encode())
        record = {
            "job_id": job_id,
            "name": job.name,
            "attempt": attempt,
            "arn": response.get("TrainingJobArn", ""),
            "checkpoint_s3_uri": request.get("CheckpointConfig", {}).get("S3Uri"),
            "submitted_at": _now(),
        }
        write_bytes_atomic(paths.submission, json.dumps(record, indent=2).encode())
        return self._handle(job_id, paths.job_dir)

    def attach(self, job_id: str, job_dir: Path) -> SageMakerJob:
        """A handle on a training job submitted earlier (no AWS call here)."""
        recorded = _read_submission(JobPaths(job_dir)).get("job_id")
        if recorded is not None and recorded != job_id:
            raise JobError(
                f"cannot attach to sagemaker training job {job_id}: {JobPaths(job_dir).submission} names "
                f"{recorded} (the job dir was reused by a later submission); attach to {recorded} instead"
            )
        return self._handle(job_id, job_dir)

    def _handle(self, job_id: str, job_dir: Path) -> SageMakerJob:
        return SageMakerJob(
            job_id,
            job_dir,
            client=self.client,
            cache=self.cache,
            log_reader=self.log_reader,
            cancel_timeout_s=self.cancel_timeout_s,
            poll_s=self.poll_s,
        )

    def _refuse_if_running(self, paths: JobPaths, previous: Mapping[str, Any]) -> None:
        job_id = previous.get("job_id")
        if not job_id:
            return
        status = self.cache.status(str(job_id), max_age_s=0)
        if not status.job_state.is_terminal:
            raise JobError(
                f"job dir {paths.job_dir} belongs to {status.describe(str(job_id))}, which has not ended; "
                "stop it (aws sagemaker stop-training-job) or wait for it before submitting again"
            )

    def _warn_ignored(self, job: JobSpec) -> None:
        messages = dict(ignored_resources(job.resources))
        if not checkpoints_on_fsx(self.spec):
            messages["fsx"] = (
                "no read-write fsx on the launcher: jobs write metrics and results to /opt/ml/output/data "
                "and checkpoints to S3, where the orchestrator cannot read them; fix: mount FSx with "
                "access_mode rw to run whole pipelines"
            )
        for key, message in messages.items():
            with self._warn_lock:
                if key in self._warned:
                    continue
                self._warned.add(key)
            logger.warning("sagemaker launcher: %s", message)


def sagemaker_client(region: str | None) -> Any:
    """A boto3 SageMaker client; raises ``TunepodError`` naming the extra when boto3 is missing."""
    return aws_client("sagemaker", region)


def aws_client(service: str, region: str | None) -> Any:
    """A boto3 client for ``service``; raises ``TunepodError`` naming the extra when boto3 is missing.

    boto3 applies its usual configuration, ``AWS_ENDPOINT_URL_<SERVICE>`` variables included.
    """
    try:
        import boto3  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TunepodError(f"the sagemaker launcher needs boto3; fix: {INSTALL_HINT}") from exc
    return boto3.session.Session().client(service, region_name=region)


def _error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ``ClientError`` (read by shape: botocore stays optional)."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        error = response.get("Error")
        if isinstance(error, Mapping):
            return str(error.get("Code", "")) or None
    return None


_TRANSIENT_CODES = frozenset({"ThrottlingException", "Throttling", "ServiceUnavailable", "InternalFailure"})


def _translate(exc: Exception, doing: str) -> TunepodError:
    """A boto3 failure as a tunepod error: ``TransientError`` when a retry may help, else ``JobError``."""
    code = _error_code(exc)
    name = type(exc).__name__
    if code in _TRANSIENT_CODES or name in (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
    ):
        return TransientError(f"could not {doing}: {exc}")
    return JobError(f"could not {doing}: {exc}")


def _read_submission(paths: JobPaths) -> dict[str, Any]:
    """``submission.json`` as a dict ({} when there is none, or it is unreadable)."""
    try:
        record = json.loads(paths.submission.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
