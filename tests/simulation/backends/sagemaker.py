"""A simulated SageMaker behind the real ``SageMakerLauncher``: a client object with boto3's methods
(``create_training_job``, ``describe_training_job``, ``stop_training_job``; the logs client's
``describe_log_streams``, ``get_log_events``) whose answers and errors are botocore's, so the
launcher's rendering, error reading (``clients.py``) and state mapping (``states.py``) run as on AWS.

Modelled, as SageMaker does it:

- ``CreateTrainingJob``: the request is checked as boto3 checks it before sending (botocore's own
  validator and service model: ``ParamValidationError``) and as SageMaker checks it on arrival (the
  model's lengths, patterns, ranges: ``ValidationException``); a name is unique in the account and
  region for good, ended jobs included (``ResourceInUse``);
- the lifecycle, with its ``SecondaryStatusTransitions``: ``InProgress`` through ``Starting``,
  ``Downloading``, ``Training`` (the program runs on a node), then, once the program exited 0,
  ``Uploading`` ("training is complete") and ``Completed``; a program that exits non-zero ends the
  job ``Failed`` with the toolkit's ``FailureReason`` (``ExitCode N``) at once;
- ``StoppingCondition.MaxRuntimeInSeconds``: counted from the first instance start, over every
  attempt (as with a RetryStrategy), not while the final upload runs; past it the job is stopped
  (``Stopping``) and ends ``Stopped`` / ``MaxRuntimeExceeded``;
- ``RetryStrategy.MaximumRetryAttempts``: an internal error (an instance lost, while faults are on)
  kills the run; the job starts again under its name (``Restarting`` or ``Starting``) while retries
  are left, else ends ``Failed`` with ``InternalServerError``;
- ``StopTrainingJob``: an ``InProgress`` job (``Uploading`` too) goes ``Stopping`` (its program
  killed: it does not trap SIGTERM) and ends ``Stopped`` a while later; any other status answers
  ``ValidationException`` (an unknown name: ``ResourceNotFound``, as the API model lists);
- ``DescribeTrainingJob``: the job as created (``Environment`` included, which is how the launcher
  tells its submission's job) with its status; an unknown name answers ``ValidationException:
  Requested resource not found.``;
- where the program writes is its container's contract (``tunepod.runtime.read_contract`` over the
  request's ``Environment``, ``SM_HPS`` and the toolkit's variables), with SageMaker's mounts: the
  FSx channel is the seed's root (so a read-write channel writes the job dir, a read-only one cannot),
  ``/opt/ml/checkpoints`` is the ``CheckpointConfig.S3Uri`` prefix, ``/opt/ml/output`` an instance's
  own folder the orchestrator never reads;
- faults while ``faults_on``: a call that fails before any effect (``ThrottlingException``, or a
  ``ReadTimeoutError``); a create or stop whose reply is lost after it took effect, which reaches the
  launcher as botocore's retry meeting the job (``ResourceInUse``, or ``ValidationException`` for a
  stop) or as its ``ReadTimeoutError`` once its retries are spent; internal errors of running jobs.

Not modelled: images, IAM, VPC, S3 itself (the checkpoint prefix is a folder the instance writes
directly: no sync lag), spot capacity, several instances, a job's SIGTERM grace (the program never
saves on a stop), account quotas (``ResourceLimitExceeded``), eventual consistency of describes (a
job is described as soon as its create took effect), the retired provisioning statuses
(``LaunchingMLInstances`` and friends), log paging.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import botocore.session  # type: ignore[import-untyped]
from botocore.exceptions import (  # type: ignore[import-untyped]
    ClientError,
    ParamValidationError,
    ReadTimeoutError,
)
from botocore.validate import ParamValidator  # type: ignore[import-untyped]

from simulation.backends import Machine, Outage, ServiceFaults, rate, service_faults
from simulation.cluster import Cluster, JobRun
from simulation.invariants import Referee
from simulation.scheduler import Host, Scheduler
from tunepod.launch.base import SUBMISSION_ID_ENV, Launcher
from tunepod.launch.paths import JobPaths
from tunepod.launch.sagemaker.launcher import SageMakerLauncher
from tunepod.runtime.contract import read_contract
from tunepod.runtime.progress import progress_dir
from tunepod.spec.models import SageMakerLauncherSpec

REGION = "us-east-1"
ACCOUNT = "123456789012"
BUCKET = "tunepod-sim"
CHECKPOINT_PREFIX = f"s3://{BUCKET}/checkpoints"
FILE_SYSTEM = ("fs-0123456789abcdef0", "/abcdefgh/tunepod")
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
ENDPOINT = f"https://api.sagemaker.{REGION}.amazonaws.com/"
# SageMaker's own container paths (the twin's, not tunepod's constants: the twin checks those).
CONTAINER_DATA = "/opt/ml/input/data"
CONTAINER_CHECKPOINTS = "/opt/ml/checkpoints"
CONTAINER_OUTPUT = "/opt/ml/output"
_ENDED = ("Completed", "Failed", "Stopped")
_INTERNAL_ERROR = "InternalServerError: We encountered an internal error.  Please try again."
# What DescribeTrainingJob returns of the request (Environment too: how the launcher knows its job).
_DESCRIBED = (
    "TrainingJobName",
    "HyperParameters",
    "AlgorithmSpecification",
    "RoleArn",
    "Environment",
    "InputDataConfig",
    "OutputDataConfig",
    "ResourceConfig",
    "StoppingCondition",
    "RetryStrategy",
    "CheckpointConfig",
)


@dataclass(frozen=True)
class SageMakerFaults(ServiceFaults):
    """The API's (throttled, a request lost once botocore's retries are spent; a create's or stop's
    reply lost), and internal errors."""

    internal_error_per_s: float = 0.0
    """Per training job and second of training: an internal error (an instance lost)."""


@dataclass(frozen=True)
class SageMakerSettings:
    """The simulated account's configuration (as the launcher's spec renders it) and faults."""

    faults: SageMakerFaults
    fsx: str
    """``rw`` (jobs write the job dir), ``ro`` (they read it only) or ``none`` (no channel)."""
    max_retry_attempts: int
    max_runtime_s: int
    """The spec's ``max_runtime_s``: a job's limit when the study sets no ``timeout_min``."""
    kind: str = "sagemaker"

    def describe(self) -> str:
        return (
            f"sagemaker: fsx {self.fsx}, RetryStrategy {self.max_retry_attempts}, max_runtime_s "
            f"{self.max_runtime_s}, faults {self.faults}"
        )

    def quiet(self) -> SageMakerSettings:
        return replace(self, faults=SageMakerFaults())

    def make(self, machine: Machine) -> SageMakerBackend:
        return SageMakerBackend(SageMakerApi(machine, self))


def draw(random_: random.Random) -> SageMakerSettings:
    return SageMakerSettings(
        faults=SageMakerFaults(
            **service_faults(random_),
            internal_error_per_s=rate(random_, 0.002),
        ),
        fsx=random_.choice(["rw", "rw", "ro", "none"]),
        max_retry_attempts=random_.randint(1, 3),
        max_runtime_s=random_.choice([600, 900]),
    )


class SageMakerBackend:
    """The real ``SageMakerLauncher`` of each orchestrator, all reaching one simulated account."""

    def __init__(self, api: SageMakerApi) -> None:
        self.api = api

    def launcher(self) -> Launcher:
        api = self.api
        spec = SageMakerLauncherSpec.model_validate(
            {**api.spec_fields(), "poll_cache_s": api.sim.choices.pick([0.0, 5.0])}
        )
        return SageMakerLauncher(spec, SimSageMakerClient(api), logs_client=SimLogsClient(api))

    def faults_stop(self) -> None:
        self.api.faults_on = False


@dataclass
class TrainingJob:
    """One training job of the account, kept for good (names are never freed)."""

    name: str
    request: dict[str, Any]
    created_at: float
    job_dir: Path
    """The trial's job dir: the referee's knowledge, never SageMaker's."""
    retries_left: int
    status: str = "InProgress"
    secondary: str = "Starting"
    failure_reason: str = ""
    next_at: float = 0.0
    """When the current phase (a provisioning status, Uploading, Stopping) ends."""
    phases: list[str] = field(default_factory=list)
    """The provisioning statuses still to come before Training."""
    started_at: float | None = None
    """When its first instance came up: MaxRuntimeInSeconds counts from here, over every attempt."""
    attempts: int = 0
    ending: tuple[str, str, str] = ("Completed", "Completed", "")
    """(status, secondary status, reason) once Uploading or Stopping is over."""
    run: JobRun | None = field(default=None, repr=False)
    transitions: list[dict[str, Any]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    stream: str | None = None

    @property
    def arn(self) -> str:
        return f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/{self.name.lower()}"

    @property
    def ended(self) -> bool:
        return self.status in _ENDED


class SageMakerApi:
    """The account's training jobs and the service that runs them; see the module docstring."""

    def __init__(self, machine: Machine, settings: SageMakerSettings) -> None:
        self.sim: Scheduler = machine.sim
        self.cluster: Cluster = machine.cluster
        self.referee: Referee = machine.referee
        self.root = machine.root
        self.nodes: list[Host] = list(machine.nodes)
        self.settings = settings
        self.faults = settings.faults
        self.faults_on = True
        self.outage = Outage()
        self.jobs: dict[str, TrainingJob] = {}
        self.live: dict[str, TrainingJob] = {}
        """The jobs not ended yet, in creation order: the only ones the service still works on."""
        service = self.sim.start_process("sagemaker", Host("aws", "boot-aws", "pid:[aws]"))
        service.spawn("control", self._control)

    def spec_fields(self) -> dict[str, Any]:
        """The launcher spec of this account: a valid ``SageMakerLauncherSpec`` but for ``poll_cache_s``."""
        fields: dict[str, Any] = {
            "kind": "sagemaker",
            "root": str(self.root),
            "role_arn": f"arn:aws:iam::{ACCOUNT}:role/tunepod-sim",
            "image_uri": f"763104351884.dkr.ecr.{REGION}.amazonaws.com/pytorch-training:2.5.1-gpu-py311",
            "output_s3_uri": f"s3://{BUCKET}/output",
            "checkpoint_s3_uri": CHECKPOINT_PREFIX,
            # The study's entrypoint lies outside root (the simulation's working directory): code from S3.
            "code_uri": f"s3://{BUCKET}/code/sourcedir.tar.gz",
            "instance_type": "ml.g5.xlarge",
            "region": REGION,
            "max_retry_attempts": self.settings.max_retry_attempts,
            "max_runtime_s": self.settings.max_runtime_s,
        }
        if self.settings.fsx != "none":
            fields["fsx"] = {
                "file_system_id": FILE_SYSTEM[0],
                "directory_path": FILE_SYSTEM[1],
                "access_mode": self.settings.fsx,
            }
            fields["subnets"], fields["security_group_ids"] = ["subnet-0a1b2c3d"], ["sg-0a1b2c3d"]
        return fields

    # ------------------------------------------------------------------------------ the service

    def _control(self) -> None:
        while True:
            self.sim.sleep(1.0)
            for job in list(self.live.values()):
                self._tick(job)

    def _tick(self, job: TrainingJob) -> None:
        now = self.sim.now
        # The final upload is not cut short by MaxRuntimeInSeconds (an assumption: the docs leave it open).
        if job.status == "Stopping" or job.secondary == "Uploading":
            if now >= job.next_at:
                self._end(job, *job.ending)
        elif self._over_max_runtime(job):
            self._stopping(job, ("Stopped", "MaxRuntimeExceeded", ""), "MaxRuntimeInSeconds")
        elif job.secondary == "Training":
            if self.faults_on and self.sim.choices.chance(self.faults.internal_error_per_s):
                self._internal_error(job)
        elif now >= job.next_at:
            self._next_phase(job)

    def _over_max_runtime(self, job: TrainingJob) -> bool:
        limit = float(job.request["StoppingCondition"]["MaxRuntimeInSeconds"])
        return job.started_at is not None and self.sim.now - job.started_at >= limit

    def _provision(self, job: TrainingJob, first: str) -> None:
        """Start (again) from ``first`` (``Starting``, ``Restarting``), then Downloading, then Training."""
        job.phases = ["Downloading"]
        self._set(job, "InProgress", first)
        job.next_at = self.sim.now + self.sim.choices.uniform(1.0, 30.0)

    def _next_phase(self, job: TrainingJob) -> None:
        if not job.phases:
            self._start_training(job)
            return
        phase = job.phases.pop(0)
        if phase == "Downloading" and job.started_at is None:
            job.started_at = self.sim.now
        self._set(job, "InProgress", phase)
        job.next_at = self.sim.now + self.sim.choices.uniform(1.0, 15.0)

    def _start_training(self, job: TrainingJob) -> None:
        job.attempts += 1
        self._set(job, "InProgress", "Training")
        node = self.sim.choices.pick(self.nodes)
        env, paths = self._container(job)
        if job.stream is None:
            job.stream = f"{job.name}/algo-1-{int(self.sim.now)}"
        job.log.append(f"Invoking script: torchrun train.py (attempt {job.attempts})")
        job.run = self.cluster.start(
            job.job_dir, job.name, env, node, lambda run: self._exited(job, run), paths=paths
        )
        self.referee.job_started(job.job_dir)

    def _exited(self, job: TrainingJob, run: JobRun) -> None:
        """The program ended by itself: the output is uploaded, then the job ends as it did."""
        if job.run is not run:
            return
        code = run.exit_code or 0
        job.run = None
        job.log.append(f"training script exited with code {code}")
        if code != 0:
            reason = (
                f'AlgorithmError: ExecuteUserScriptError:\nExitCode {code}\nErrorMessage ""\n'
                f'Command "/opt/conda/bin/torchrun train.py", exit code: {code}'
            )
            self._end(job, "Failed", "Failed", reason)
            return
        # "Uploading: training is complete and the model artifacts are being uploaded" (the API docs).
        job.ending = ("Completed", "Completed", "")
        self._set(job, "InProgress", "Uploading")
        job.next_at = self.sim.now + self.sim.choices.uniform(1.0, 10.0)

    def _internal_error(self, job: TrainingJob) -> None:
        sim = self.sim
        sim.trace.event(sim.now, "fault", f"sagemaker: internal error in training job {job.name}")
        self._kill(job, "instance lost")
        if job.retries_left > 0:
            job.retries_left -= 1
            self._provision(job, sim.choices.pick(["Restarting", "Starting"]))
        else:
            self._end(job, "Failed", "Failed", _INTERNAL_ERROR)

    def _stopping(self, job: TrainingJob, ending: tuple[str, str, str], why: str) -> None:
        self._kill(job, why)
        job.ending = ending
        self._set(job, "Stopping", "Stopping")
        job.next_at = self.sim.now + self.sim.choices.uniform(2.0, 60.0)

    def _kill(self, job: TrainingJob, why: str) -> None:
        if job.run is not None:
            self.cluster.kill(job.run, f"sagemaker: {why}")
            job.run = None

    def _set(self, job: TrainingJob, status: str, secondary: str, reason: str = "") -> None:
        now = self.sim.now
        if job.transitions:
            job.transitions[-1]["EndTime"] = now
        job.transitions.append({"Status": secondary, "StartTime": now})
        job.status, job.secondary, job.failure_reason = status, secondary, reason

    def _end(self, job: TrainingJob, status: str, secondary: str, reason: str) -> None:
        self._set(job, status, secondary, reason)
        del self.live[job.name]
        self.sim.trace.event(self.sim.now, "job", f"sagemaker: training job {job.name} {status}/{secondary}")

    # ------------------------------------------------------------------------------ the container

    def _container(self, job: TrainingJob) -> tuple[dict[str, str], JobPaths]:
        """What ``Cluster.start`` needs: the program's parameters and submission id, and where its
        contract (as the toolkit sets it up) makes it write, on this side."""
        request = job.request
        instance = self.root / ".sagemaker" / job.name / f"attempt-{job.attempts}"
        hyperparameters = {
            key: _decoded(value)
            for key, value in request.get("HyperParameters", {}).items()
            if not key.startswith("sagemaker_")
        }
        env = dict(request.get("Environment", {}))
        env |= {
            "SM_HPS": json.dumps(hyperparameters),
            "SM_OUTPUT_DATA_DIR": f"{CONTAINER_OUTPUT}/data",
            "TRAINING_JOB_NAME": job.name,
        }
        env |= {f"SM_CHANNEL_{name.upper()}": f"{CONTAINER_DATA}/{name}" for name in self._channels(job)}
        contract = read_contract(env, cwd=instance)
        mounts = self._mounts(job, instance)
        paths = ContainerPaths(
            job_dir=instance,
            checkpoint_dir=_local(contract.checkpoint_dir.as_posix(), mounts),
            metrics_file=_local(contract.metrics_file.as_posix(), mounts),
            result_file=_local(contract.result_file.as_posix(), mounts),
        )
        program = {"TUNEPOD_PARAMS": json.dumps(contract.params), SUBMISSION_ID_ENV: env[SUBMISSION_ID_ENV]}
        return program, paths

    def _channels(self, job: TrainingJob) -> list[str]:
        return [str(channel["ChannelName"]) for channel in job.request.get("InputDataConfig", [])]

    def _mounts(self, job: TrainingJob, instance: Path) -> dict[str, Path]:
        """Container path -> local folder, longest first. The FSx channel is the seed's root."""
        checkpoint = job.request.get("CheckpointConfig")
        mounts = {CONTAINER_OUTPUT: instance / "output", "/opt/ml/model": instance / "model"}
        if checkpoint is not None:
            local_path = checkpoint.get("LocalPath", CONTAINER_CHECKPOINTS)
            mounts[local_path] = self._s3_folder(str(checkpoint["S3Uri"]))
        for channel in job.request.get("InputDataConfig", []):
            source = channel["DataSource"]["FileSystemDataSource"]
            assert (source["FileSystemId"], source["DirectoryPath"]) == FILE_SYSTEM, source
            mounts[f"{CONTAINER_DATA}/{channel['ChannelName']}"] = self.root
        return dict(sorted(mounts.items(), key=lambda item: -len(item[0])))

    def _s3_folder(self, uri: str) -> Path:
        return self.root / ".s3" / uri.removeprefix("s3://")

    def trial_dir(self, request: Mapping[str, Any]) -> Path:
        """The job dir a request was rendered for (for the referee): its checkpoint folder is the job
        dir's ``checkpoints``, on the FSx channel or under the checkpoint prefix."""
        configured = str(request.get("Environment", {}).get("TUNEPOD_CHECKPOINT_DIR", ""))
        channel = f"{CONTAINER_DATA}/train/"
        if configured.startswith(channel):
            return (self.root / configured[len(channel) :]).parent
        uri = str(request["CheckpointConfig"]["S3Uri"])
        assert uri.startswith(CHECKPOINT_PREFIX + "/"), uri
        return (self.root / uri[len(CHECKPOINT_PREFIX) + 1 :]).parent

    # ------------------------------------------------------------------------------ the API

    def create(self, request: dict[str, Any]) -> dict[str, Any]:
        name = str(request["TrainingJobName"])
        if name in self.jobs:
            raise _client_error(
                "ResourceInUse",
                "Training job names must be unique within an AWS account and region, and a training job "
                f"with this name already exists ({self.jobs[name].arn})",
                "CreateTrainingJob",
            )
        job_dir = self.trial_dir(request)
        live = [job.name for job in self.live.values() if job.job_dir == job_dir]
        self.referee.job_created(job_dir, live)
        retries = int(request.get("RetryStrategy", {}).get("MaximumRetryAttempts", 0))
        job = TrainingJob(name, copy.deepcopy(request), self.sim.now, job_dir, retries_left=retries)
        self.jobs[name] = self.live[name] = job
        self._provision(job, "Starting")
        self.cluster.created[job_dir] = self.cluster.created.get(job_dir, 0) + 1
        by = self.sim.process
        self.sim.trace.event(
            self.sim.now, "job", f"sagemaker: training job {name} ({job_dir.name}) created by {by}"
        )
        return {"TrainingJobArn": job.arn}

    def describe(self, name: str) -> dict[str, Any]:
        job = self._known(name, "DescribeTrainingJob", "ValidationException", "Requested resource not found.")
        answer = {key: copy.deepcopy(job.request[key]) for key in _DESCRIBED if key in job.request}
        answer |= {
            "TrainingJobArn": job.arn,
            "TrainingJobStatus": job.status,
            "SecondaryStatus": job.secondary,
            "SecondaryStatusTransitions": copy.deepcopy(job.transitions),
            "CreationTime": job.created_at,
        }
        if job.failure_reason:
            answer["FailureReason"] = job.failure_reason
        return answer

    def stop(self, name: str) -> None:
        job = self._known(name, "StopTrainingJob", "ResourceNotFound", "Resource being access is not found.")
        if job.status != "InProgress":
            raise _client_error(
                "ValidationException",
                f"The training job is in status {job.status}; only an InProgress job can be stopped",
                "StopTrainingJob",
            )
        self.referee.stop_requested(job.job_dir, name)
        self.sim.trace.event(self.sim.now, "job", f"sagemaker: StopTrainingJob {name} by {self.sim.process}")
        self._stopping(job, ("Stopped", "Stopped", ""), "StopTrainingJob")

    def _known(self, name: str, operation: str, code: str, message: str) -> TrainingJob:
        job = self.jobs.get(name)
        if job is None:
            raise _client_error(code, message, operation)
        return job

    # ------------------------------------------------------------------------------ a call

    def call(self, operation: str, params: Mapping[str, Any]) -> None:
        """What every call meets before it takes effect: boto3's own check, then the service's (or its
        throttling), after a moment on the network."""
        sim = self.sim
        _validated(operation, params)
        sim.takes(f"sagemaker {operation}", sim.latency.api)
        if self.faults_on and (self.outage.on(sim) or sim.choices.chance(self.faults.transient)):
            if self.outage.on(sim) or sim.choices.chance(0.5):
                sim.trace.event(sim.now, "fault", f"{sim.process}: {operation} times out before AWS has it")
                raise ReadTimeoutError(endpoint_url=ENDPOINT)
            sim.trace.event(sim.now, "fault", f"{sim.process}: {operation} is throttled")
            raise _client_error("ThrottlingException", "Rate exceeded", operation)

    def reply(self, operation: str) -> bool:
        """After a call took effect: whether its reply is lost (it then takes a moment more)."""
        sim = self.sim
        lost = self.faults_on and sim.choices.chance(self.faults.lost_reply)
        if lost:
            sim.trace.event(sim.now, "fault", f"{sim.process}: {operation} took effect; its reply is lost")
            self.outage.begins(sim, self.faults)
        sim.takes(f"sagemaker {operation}'s reply", sim.latency.api)
        return lost

    def log_streams(self, prefix: str) -> list[TrainingJob]:
        return [job for job in self.jobs.values() if job.stream is not None and job.stream.startswith(prefix)]


@dataclass(frozen=True)
class ContainerPaths(JobPaths):
    """Where a job's program writes, as its contract says, on this side of SageMaker's mounts."""

    checkpoint_dir: Path
    metrics_file: Path
    result_file: Path

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir

    @property
    def metrics(self) -> Path:
        return self.metrics_file

    @property
    def result(self) -> Path:
        return self.result_file

    @property
    def progress(self) -> Path:
        return progress_dir(self.metrics_file)


class SimSageMakerClient:
    """The boto3 ``sagemaker`` client an orchestrator's launcher uses (what reaches it once botocore's
    own retries are done)."""

    def __init__(self, api: SageMakerApi) -> None:
        self.api = api

    def create_training_job(self, **request: Any) -> dict[str, Any]:
        api = self.api
        api.call("CreateTrainingJob", request)
        answer = api.create(request)
        if not api.reply("CreateTrainingJob"):
            return answer
        if api.sim.choices.chance(0.5):
            api.create(request)  # botocore's retry meets the job its first try created: ResourceInUse
        raise ReadTimeoutError(endpoint_url=ENDPOINT)

    def describe_training_job(self, *, TrainingJobName: str) -> dict[str, Any]:
        self.api.call("DescribeTrainingJob", {"TrainingJobName": TrainingJobName})
        return self.api.describe(TrainingJobName)

    def stop_training_job(self, *, TrainingJobName: str) -> dict[str, Any]:
        api = self.api
        api.call("StopTrainingJob", {"TrainingJobName": TrainingJobName})
        api.stop(TrainingJobName)
        if not api.reply("StopTrainingJob"):
            return {}
        if api.sim.choices.chance(0.5):
            api.stop(TrainingJobName)  # botocore's retry finds it Stopping: ValidationException
        raise ReadTimeoutError(endpoint_url=ENDPOINT)


class SimLogsClient:
    """The boto3 ``logs`` client: one stream per job that started training, its lines the service's."""

    def __init__(self, api: SageMakerApi) -> None:
        self.api = api

    def describe_log_streams(
        self,
        *,
        logGroupName: str,
        logStreamNamePrefix: str = "",
        nextToken: str | None = None,
    ) -> dict[str, Any]:
        self.api.sim.takes("logs DescribeLogStreams", self.api.sim.latency.api)
        jobs = self.api.log_streams(logStreamNamePrefix)
        if logGroupName != LOG_GROUP or not self.api.log_streams(""):
            raise _client_error(
                "ResourceNotFoundException", "The specified log group does not exist.", "DescribeLogStreams"
            )
        return {"logStreams": [{"logStreamName": job.stream} for job in jobs]}

    def get_log_events(
        self,
        *,
        logGroupName: str,
        logStreamName: str,
        startFromHead: bool = False,
        limit: int = 10_000,
    ) -> dict[str, Any]:
        self.api.sim.takes("logs GetLogEvents", self.api.sim.latency.api)
        found = [job for job in self.api.log_streams(logStreamName) if job.stream == logStreamName]
        if logGroupName != LOG_GROUP or not found:
            raise _client_error(
                "ResourceNotFoundException", "The specified log stream does not exist.", "GetLogEvents"
            )
        lines = found[0].log[:limit] if startFromHead else found[0].log[-limit:]
        return {"events": [{"timestamp": 0, "message": line, "ingestionTime": 0} for line in lines]}


# ---------------------------------------------------------------------------------- botocore


def _client_error(code: str, message: str, operation: str) -> ClientError:
    """An error answer as botocore raises it (``response["Error"]["Code"]`` is what tunepod reads)."""
    response = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": 400}}
    return ClientError(response, operation)


@functools.cache
def _service_model() -> Any:
    """botocore's own SageMaker model (loaded once per process: a second's read)."""
    return botocore.session.get_session().get_service_model("sagemaker")


def _validated(operation: str, params: Mapping[str, Any]) -> None:
    """boto3's check before sending (``ParamValidationError``), then SageMaker's on arrival: the
    model's maximum lengths and sizes, patterns and ranges, which botocore leaves to the service
    (``ValidationException``)."""
    shape = _service_model().operation_model(operation).input_shape
    report = ParamValidator().validate(dict(params), shape)
    if report.has_errors():
        raise ParamValidationError(report=report.generate_report())
    refusals = _refusals(shape, params, _lower_first(operation))
    if refusals:
        count = f"{len(refusals)} validation error{'s' if len(refusals) > 1 else ''} detected: "
        raise _client_error("ValidationException", count + "; ".join(refusals), operation)


def _refusals(shape: Any, value: Any, where: str) -> list[str]:
    """What the service refuses in ``value`` of ``shape`` (botocore checked types and minimums)."""
    meta, kind = shape.metadata, shape.type_name
    if kind == "structure":
        return [
            refusal
            for name, member in shape.members.items()
            if name in value
            for refusal in _refusals(member, value[name], f"{where}.{_lower_first(name)}")
        ]
    if kind == "map":
        found = _too_many(meta, len(value), where)
        for key, item in value.items():
            found += _refusals(shape.key, key, f"{where} key")
            found += _refusals(shape.value, item, f"{where}.{key}")
        return found
    if kind == "list":
        found = _too_many(meta, len(value), where)
        for index, item in enumerate(value):
            found += _refusals(shape.member, item, f"{where}.{index + 1}")
        return found
    if kind == "string":
        return _string_refusals(shape, value, where)
    if kind in ("integer", "long") and "max" in meta and value > meta["max"]:
        return [f"Value {value} at '{where}' failed to satisfy constraint: Member must be <= {meta['max']}"]
    return []


def _string_refusals(shape: Any, value: str, where: str) -> list[str]:
    meta = shape.metadata
    if "max" in meta and len(value) > meta["max"]:
        return [f"Value at '{where}' failed to satisfy constraint: Member must have length <= {meta['max']}"]
    if shape.enum and value not in shape.enum:
        return [f"Value '{value}' at '{where}' failed to satisfy constraint: Member must be in {shape.enum}"]
    pattern = _pattern(meta.get("pattern", ""))
    if pattern is not None and not pattern.fullmatch(value):
        return [
            f"Value '{value}' at '{where}' failed to satisfy constraint: Member must satisfy regular "
            f"expression pattern: {meta['pattern']}"
        ]
    return []


@functools.cache
def _pattern(text: str) -> re.Pattern[str] | None:
    """The model's pattern (Java syntax): None where Python's ``re`` reads it otherwise."""
    try:
        return re.compile(text, re.DOTALL) if text else None
    except re.error:
        return None


def _too_many(meta: Mapping[str, Any], count: int, where: str) -> list[str]:
    if "max" in meta and count > meta["max"]:
        return [
            f"Value at '{where}' failed to satisfy constraint: Member must have at most {meta['max']} entries"
        ]
    return []


def _lower_first(name: str) -> str:
    return name[:1].lower() + name[1:]


def _decoded(value: str) -> Any:
    """A hyperparameter as the training toolkit hands it to the script: JSON decoded, else the string."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def _local(container_path: str, mounts: Mapping[str, Path]) -> Path:
    """The local folder of a path inside the container (``mounts``: longest first)."""
    for inside, local in mounts.items():
        if container_path == inside or container_path.startswith(inside + "/"):
            return local / container_path[len(inside) :].lstrip("/")
    raise AssertionError(f"{container_path} is on no mount of the simulated container ({list(mounts)})")
