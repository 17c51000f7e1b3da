"""Run jobs as SageMaker training jobs: submit the request ``sagemaker_request`` renders, follow it, stop it.

Render, then execute: ``sagemaker_request.render_training_job`` is a pure function from a ``JobSpec`` to
the ``CreateTrainingJob`` request (its module docstring says how a job runs there, where its paths and
checkpoints go and how attempts are named); ``SageMakerLauncher.submit`` sends it with boto3.

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
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunepod.errors import JobError, TransientError, TunepodError
from tunepod.launch.base import JobSpec, JobState
from tunepod.launch.paths import JobPaths
from tunepod.launch.sagemaker_request import checkpoints_on_fsx, ignored_resources, render_training_job
from tunepod.runtime.files import write_bytes_atomic
from tunepod.spec.models import SageMakerLauncherSpec

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tunepod[aws]'"
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
REQUEST_NAME = "training-job.json"
_NAME_ATTEMPTS = 5
_CANCEL_POLL_S = 2.0


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
