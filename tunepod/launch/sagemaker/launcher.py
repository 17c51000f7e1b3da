"""Run jobs as SageMaker training jobs: the ``LauncherBase`` hooks over boto3.

Render, then execute: ``render.render_training_job`` is a pure function from a ``JobSpec`` to the
``CreateTrainingJob`` request (its module docstring says how a job runs there, where its paths and
checkpoints go and how attempts are named); ``send`` creates it. A job's id is its training job name.

Exactly once: the request's ``Environment`` carries the attempt's ``TUNEPOD_SUBMISSION_ID``, and
DescribeTrainingJob returns it, so a job found under the recorded name is ours only when it carries
our submission id. That settles the two ways a create can look refused or lost although SageMaker
took it: botocore retries a create whose reply timed out, and the retry meets ``ResourceInUse`` on our
own job (``send`` adopts it); or the reply never comes back at all (the template calls ``find``). A
name held by another submission's job is ``NameTaken``, and the template renders the next variant.

States: one DescribeTrainingJob per open job per ``spec.poll_cache_s``, described concurrently. No
call lists the states of just the jobs we follow: ListTrainingJobs pages through every job of the
account (filters: a name substring, times, one status) and carries no FailureReason. Logs: CloudWatch
(``logs.py``).

Tested against the SageMaker stand-in of ``tests/standins/sagemaker_api.py`` (the launcher contract
suite: real boto3 clients over HTTP, local torchrun processes, checkpoints synced to moto's S3),
against moto's server (create and describe; its jobs complete at once, cannot be stopped, and it
neither returns ``Environment`` nor refuses a taken name) and with botocore's Stubber for what neither
reaches (Stopping, MaxRuntimeExceeded, racing a stop).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunepod import world
from tunepod.errors import JobError, TransientError, TunepodError
from tunepod.launch.base import SUBMISSION_ID_ENV, Accepted, Job, JobSpec, LauncherBase, NameTaken, Rendered
from tunepod.launch.sagemaker.clients import (
    aws_client,
    aws_error,
    configured_region,
    error_code,
    is_not_found,
    sagemaker_client,
)
from tunepod.launch.sagemaker.images import training_image
from tunepod.launch.sagemaker.logs import CloudWatchLogReader, log_hint
from tunepod.launch.sagemaker.render import (
    REQUEST_FILE,
    checkpoints_on_fsx,
    ignored_resources,
    render_training_job,
)
from tunepod.launch.sagemaker.states import TrainingJobStatus
from tunepod.launch.status_cache import TrackedJob
from tunepod.launch.submission import Submission
from tunepod.spec.models import SageMakerLauncherSpec

logger = logging.getLogger(__name__)

_CANCEL_POLL_S = 2.0
# Concurrent DescribeTrainingJob calls per refresh: enough for a study's trials, well under the
# API's request rate (throttling would only turn into stale states).
_DESCRIBE_THREADS = 8
# Any CPU type: a framework version's image is checked against it when the spec sets no instance type.
_ANY_CPU_INSTANCE = "ml.c5.xlarge"
_JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


class SageMakerJob(Job[TrainingJobStatus]):
    """A SageMaker training job (its id is its name); adds what its submission record knows of it."""

    @property
    def arn(self) -> str | None:
        return self._detail("arn")

    @property
    def checkpoint_s3_uri(self) -> str | None:
        """Where its ``/opt/ml/checkpoints`` syncs; None when checkpoints stay on FSx (or unrecorded)."""
        return self._detail("checkpoint_s3_uri")

    def _detail(self, key: str) -> str | None:
        value = self.record.details.get(key) if self.record is not None else None
        return str(value) if value else None


class SageMakerLauncher(LauncherBase[TrainingJobStatus]):
    """Submits jobs as SageMaker training jobs with boto3 and follows them with DescribeTrainingJob.

    ``client`` is a boto3 ``sagemaker`` client and ``logs_client`` a ``logs`` one (default: new ones
    for ``spec.region``, else the region boto3's configuration names, made by boto3 on first use, so
    ``AWS_ENDPOINT_URL_SAGEMAKER`` and ``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS`` apply). ``connect=False``:
    the image of a ``framework_version`` is not checked up front (``render`` refuses what it cannot
    find), for ``tunepod render`` on a machine without AWS configuration. Thread safety: as
    ``LauncherBase``; boto3 clients are thread-safe.
    """

    kind = "sagemaker"
    # Containers may write the job dir as another user; the files holding the environment stay 0600.
    private_job_dirs = False
    stop_hint = "stop it (aws sagemaker stop-training-job --training-job-name {job_id})"

    def __init__(
        self,
        spec: SageMakerLauncherSpec,
        client: Any | None = None,
        *,
        logs_client: Any | None = None,
        cancel_timeout_s: float = 900.0,
        cancel_poll_s: float = _CANCEL_POLL_S,
        connect: bool = True,
    ) -> None:
        super().__init__(
            poll_cache_s=spec.poll_cache_s, cancel_timeout_s=cancel_timeout_s, cancel_poll_s=cancel_poll_s
        )
        self.spec = spec
        self._client = client
        region = spec.region or getattr(getattr(client, "meta", None), "region_name", None)
        self.region: str | None = region or configured_region()
        self.log_reader = CloudWatchLogReader(
            (lambda: logs_client) if logs_client is not None else (lambda: aws_client("logs", self.region))
        )
        if connect and spec.framework_version is not None:
            # A version with no image fails here, before any job is sent (the default type's image).
            training_image(spec, spec.instance_type or _ANY_CPU_INSTANCE, self.region)

    @functools.cached_property
    def client(self) -> Any:
        """The SageMaker client, made on first use (``render`` needs none)."""
        return self._client if self._client is not None else sagemaker_client(self.region)

    # ------------------------------------------------------------------------------------ hooks

    def render(self, job: JobSpec, attempt: int, variant: int = 0) -> Rendered:
        request = render_training_job(job, self.spec, attempt=attempt, variant=variant, region=self.region)
        return Rendered(
            name=request["TrainingJobName"],
            payload=request,
            files={REQUEST_FILE: json.dumps(request, indent=2)},
        )

    def send(self, job: JobSpec, rendered: Rendered, intent: Submission) -> Accepted:
        """CreateTrainingJob. ``ResourceInUse`` is our own job when it carries our submission id: botocore
        retried a create that SageMaker had taken before the reply timed out. Otherwise ``NameTaken``."""
        name = rendered.name
        try:
            response = self.client.create_training_job(**rendered.payload)
        except Exception as exc:
            if error_code(exc) != "ResourceInUse":
                raise aws_error(exc, f"create sagemaker training job {name} for {job.job_dir}") from exc
            return self._adopt_taken_name(name, intent)
        return Accepted(name, _details(response.get("TrainingJobArn"), rendered.payload))

    def find(self, intent: Submission, job_dir: Path) -> Accepted | None:
        description = self._describe(intent.name)
        if description is None or _submission_of(description) != intent.submission_id:
            return None
        return _accepted(description)

    def poll(self, jobs: Mapping[str, TrackedJob]) -> dict[str, TrainingJobStatus]:
        """One DescribeTrainingJob per job, concurrently. ``TransientError`` when any of them was throttled
        or unanswered; ``JobError`` when SageMaker refused one (access denied)."""
        names = list(jobs)
        statuses = world.map_concurrently(self._status, names, _DESCRIBE_THREADS)
        return dict(zip(names, statuses, strict=True))

    def stop(self, job: Job[TrainingJobStatus]) -> None:
        try:
            self.client.stop_training_job(TrainingJobName=job.job_id)
        except Exception as exc:
            # It ended between our look and the stop (SageMaker then answers ValidationException):
            # the wait that follows sees its real outcome.
            if error_code(exc) != "ValidationException":
                raise aws_error(exc, f"stop sagemaker training job {job.job_id}") from exc

    def read_logs(self, job: Job[TrainingJobStatus], tail: int) -> str:
        """The CloudWatch tail, SageMaker's FailureReason, and where the full logs are. Never raises:
        what cannot be read is said instead."""
        lines = self.log_reader.tail(job.job_id, tail)
        try:
            reason = job.status().reason_line()
        except TunepodError as exc:
            lines.append(f"(could not describe the job: {exc})")
        else:
            if reason:
                lines.append(reason)
        lines.append(f"Full logs: {log_hint(job.job_id)}")
        return "\n".join(lines)

    @property
    def job_writes_job_dir(self) -> bool:  # type: ignore[override]
        return checkpoints_on_fsx(self.spec)

    def ignored_settings(self, job: JobSpec) -> dict[str, str]:
        ignored = ignored_resources(job.resources)
        if not checkpoints_on_fsx(self.spec):
            ignored["fsx"] = (
                "no read-write fsx on the launcher: jobs write metrics and results to /opt/ml/output/data "
                "and checkpoints to S3, where the orchestrator cannot read them; fix: mount FSx with "
                "access_mode rw to run whole pipelines"
            )
        return ignored

    def check_job_id(self, job_id: str) -> None:
        if not _JOB_NAME.match(job_id):
            raise JobError(
                f"{job_id!r} is not a SageMaker training job name (1 to 63 letters, digits and inner "
                "hyphens); attach with the name the job dir's submission.json records"
            )

    def make_job(self, job_id: str, job_dir: Path, record: Submission | None) -> SageMakerJob:
        return SageMakerJob(self, job_id, job_dir, record)

    # ------------------------------------------------------------------------------------ internals

    def _adopt_taken_name(self, name: str, intent: Submission) -> Accepted:
        description = self._describe(name)
        if description is None:
            # Taken, yet not described: say the outcome is unknown, so that nothing is created twice.
            raise TransientError(
                f"SageMaker says training job name {name} is in use but describes no such job yet; "
                "try again in a moment"
            )
        if _submission_of(description) != intent.submission_id:
            raise NameTaken(
                f"training job name {name} is held by another submission "
                f"({SUBMISSION_ID_ENV}={_submission_of(description) or 'unset'}): a job dir deleted and made "
                "again, or another tunepod job whose name cleans to the same"
            )
        logger.warning(
            "training job %s: the create's reply was lost and botocore's retry met the job it had created "
            "(ResourceInUse); adopted it",
            name,
        )
        return _accepted(description)

    def _describe(self, name: str) -> Mapping[str, Any] | None:
        """DescribeTrainingJob's answer; None when SageMaker knows no such job."""
        try:
            response: Mapping[str, Any] = self.client.describe_training_job(TrainingJobName=name)
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise aws_error(exc, f"describe sagemaker training job {name}") from exc
        return response

    def _status(self, name: str) -> TrainingJobStatus:
        description = self._describe(name)
        return (
            TrainingJobStatus.not_found(name)
            if description is None
            else TrainingJobStatus.from_describe(description)
        )


def _submission_of(description: Mapping[str, Any]) -> str | None:
    submission_id = (description.get("Environment") or {}).get(SUBMISSION_ID_ENV)
    return None if submission_id is None else str(submission_id)


def _accepted(description: Mapping[str, Any]) -> Accepted:
    """The job a DescribeTrainingJob answer describes."""
    return Accepted(
        str(description["TrainingJobName"]), _details(description.get("TrainingJobArn"), description)
    )


def _details(arn: object, request: Mapping[str, Any]) -> dict[str, Any]:
    """What the submission record keeps of a job: its ARN, and where its checkpoints sync (None: on FSx)."""
    return {"arn": str(arn or ""), "checkpoint_s3_uri": (request.get("CheckpointConfig") or {}).get("S3Uri")}
