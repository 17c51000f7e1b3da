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
the orchestrator reads what the job writes, as on Slurm. Checkpoints go to ``/opt/ml/checkpoints``,
which SageMaker syncs with ``<checkpoint_s3_uri>/<job name>``: a resubmitted job (a new training job
name, same tunepod job name) starts from the checkpoints of the one before.

Names: a training job name is unique in an account and region for good, so attempt N > 1 of one
tunepod job is ``<name>-rN``; the attempt is counted in ``<job_dir>/submission.json``.

Tested against moto's server (create and describe; its jobs complete at once and cannot be stopped)
and with botocore's Stubber for StopTrainingJob and the statuses moto never reports (InProgress with
each SecondaryStatus, Stopping, Stopped, Failed with a FailureReason, MaxRuntimeExceeded).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Mapping
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


def container_path(path: Path, spec: SageMakerLauncherSpec) -> str | None:
    """Where the job sees ``path`` (a path under ``spec.root``), or None when it cannot see it."""
    if spec.fsx is None:
        return None
    try:
        relative = PurePosixPath(path).relative_to(PurePosixPath(spec.root))
    except ValueError:
        return None
    return str(CHANNEL_MOUNT / relative)


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

    The parameters travel as hyperparameters instead; checkpoints always go to the folder SageMaker
    syncs with S3.
    """
    env = {**spec.env, **job.env}
    env.pop(runtime.PARAMS_ENV, None)
    for name in _PATH_ENVS:
        if name in env:
            mounted = container_path(Path(env[name]), spec)
            if mounted is None:
                del env[name]
            else:
                env[name] = mounted
    if runtime.CHECKPOINT_DIR_ENV in env:
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
        "CheckpointConfig": {
            # Keyed by the tunepod job, not the attempt: a resubmitted job resumes from these.
            "S3Uri": f"{spec.checkpoint_s3_uri.rstrip('/')}/{training_job_name(job.name)}",
            "LocalPath": CHECKPOINT_LOCAL_PATH,
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": max_runtime_s(job.resources, spec)},
        "RetryStrategy": {"MaximumRetryAttempts": spec.max_retry_attempts},
    }
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

    def describe(self, job_id: str) -> str:
        """One line: ``sagemaker training job x Failed (Failed: AlgorithmError: ...)``."""
        details = [part for part in (self.secondary_status, self.failure_reason) if part]
        suffix = f" ({': '.join(details)})" if details else ""
        return f"sagemaker training job {job_id} {self.status}{suffix}"


def log_hint(job_id: str) -> str:
    """Where a training job's output is: CloudWatch Logs, one stream per instance."""
    return f"CloudWatch Logs group {LOG_GROUP}, streams {job_id}/algo-<n>-<timestamp>"


class SageMakerJob:
    """A submitted SageMaker training job; every query is one DescribeTrainingJob call.

    Thread safety: boto3 clients are thread-safe, so every method may be called from several threads;
    concurrent ``cancel`` calls are serialized and all return once the job has ended.
    """

    def __init__(
        self, job_id: str, job_dir: Path, *, client: Any, cancel_timeout_s: float, poll_s: float
    ) -> None:
        self.job_id = job_id
        self.job_dir = job_dir
        self._client = client
        self._cancel_timeout_s = cancel_timeout_s
        self._poll_s = poll_s
        self._paths = JobPaths(job_dir)
        self._cancel_lock = threading.Lock()

    def status(self) -> TrainingJobStatus:
        """SageMaker's own view of the job; raises ``JobError`` when it does not know the job."""
        try:
            response = self._client.describe_training_job(TrainingJobName=self.job_id)
        except Exception as exc:
            raise _translate(exc, f"describe sagemaker training job {self.job_id}") from exc
        return TrainingJobStatus.from_describe(response)

    def state(self) -> JobState:
        return self.status().job_state

    def cancel(self) -> None:
        """Mark the job cancelled, StopTrainingJob it and wait until SageMaker says it ended.

        Idempotent; a job that has already ended keeps its real outcome. Raises ``JobError`` when it is
        still not over after ``cancel_timeout_s``.
        """
        with self._cancel_lock:
            if self.state().is_terminal:
                return
            self._paths.job_dir.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self._paths.cancelled, f"cancelled at {_now()}\n".encode())
            self._stop()
            self._wait_until_ended()

    def logs(self, tail: int = 50) -> str:
        """SageMaker's failure reason and where the full logs are (the job's output is in CloudWatch)."""
        status = self.status()
        lines = [f"FailureReason: {status.failure_reason}"] if status.failure_reason else []
        lines.append(f"Logs: {log_hint(self.job_id)}")
        return "\n".join(lines[-tail:]) if tail > 0 else ""

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
        while not (status := self.status()).job_state.is_terminal:
            if time.monotonic() > deadline:
                raise JobError(
                    f"{status.describe(self.job_id)} {self._cancel_timeout_s:.0f}s after StopTrainingJob; "
                    f"check it in the SageMaker console; logs: {log_hint(self.job_id)}"
                )
            time.sleep(self._poll_s)


# ------------------------------------------------------------------------------------------ launcher


class SageMakerLauncher:
    """Submits jobs as SageMaker training jobs with boto3 and follows them with DescribeTrainingJob.

    ``client`` is a boto3 ``sagemaker`` client (default: a new one for ``spec.region``). Thread
    safety: ``submit`` and ``attach`` may be called from several threads.
    """

    kind = "sagemaker"

    def __init__(
        self,
        spec: SageMakerLauncherSpec,
        client: Any | None = None,
        *,
        cancel_timeout_s: float = 900.0,
        poll_s: float = _CANCEL_POLL_S,
    ) -> None:
        self.spec = spec
        self.client = client if client is not None else sagemaker_client(spec.region)
        self.cancel_timeout_s = cancel_timeout_s
        self.poll_s = poll_s
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
            job_id, job_dir, client=self.client, cancel_timeout_s=self.cancel_timeout_s, poll_s=self.poll_s
        )

    def _refuse_if_running(self, paths: JobPaths, previous: Mapping[str, Any]) -> None:
        job_id = previous.get("job_id")
        if not job_id:
            return
        status = self._handle(str(job_id), paths.job_dir).status()
        if not status.job_state.is_terminal:
            raise JobError(
                f"job dir {paths.job_dir} belongs to {status.describe(str(job_id))}, which has not ended; "
                "stop it (aws sagemaker stop-training-job) or wait for it before submitting again"
            )

    def _warn_ignored(self, job: JobSpec) -> None:
        messages = dict(ignored_resources(job.resources))
        if self.spec.fsx is None:
            messages["fsx"] = (
                "no fsx on the launcher: jobs write metrics and results to /opt/ml/output/data (S3 output), "
                "where the orchestrator cannot read them while they run"
            )
        for key, message in messages.items():
            with self._warn_lock:
                if key in self._warned:
                    continue
                self._warned.add(key)
            logger.warning("sagemaker launcher: %s", message)


def sagemaker_client(region: str | None) -> Any:
    """A boto3 SageMaker client; raises ``TunepodError`` naming the extra when boto3 is missing."""
    try:
        import boto3  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TunepodError(f"the sagemaker launcher needs boto3; fix: {INSTALL_HINT}") from exc
    return boto3.session.Session().client("sagemaker", region_name=region)


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
