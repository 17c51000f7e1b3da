"""A SageMaker stand-in: no SageMaker can run here, so this emulates the part tunepod talks to.

It serves the real AWS JSON protocol (``X-Amz-Target``) over real HTTP on 127.0.0.1, so the launcher
uses real boto3 clients pointed at ``endpoint_url`` (or ``AWS_ENDPOINT_URL_SAGEMAKER`` and
``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS``). Requests are not authenticated.

Emulated:

- SageMaker ``CreateTrainingJob`` / ``DescribeTrainingJob`` / ``StopTrainingJob`` and CloudWatch Logs
  ``DescribeLogStreams`` / ``GetLogEvents`` (group ``/aws/sagemaker/TrainingJobs``), with AWS's error
  codes (ResourceInUse, ValidationException, ResourceNotFoundException);
- the lifecycle: InProgress Starting -> Downloading -> Training -> Uploading -> Completed | Failed
  (FailureReason in the toolkit's words, ``ExitCode N``) | Stopping -> Stopped, and Stopped with
  MaxRuntimeExceeded once ``StoppingCondition.MaxRuntimeInSeconds`` of training has passed;
- ``InstanceCount`` instances, ``algo-1`` .. ``algo-N``, each a local process tree with a folder of its
  own standing for its ``/opt/ml`` (``<work_dir>/<job>/algo-<n>``: code, checkpoints, model, output);
- on each, the PyTorch container's sagemaker-training toolkit: ``sagemaker_submit_directory`` is
  copied to the instance's code folder (``/opt/ml/code``) and ``sagemaker_program`` runs from there
  under torchrun with P processes (the instance type's GPUs from ``GPUS_PER_INSTANCE``, at most
  ``max_procs`` since each GPU is a CPU process here; CPU types 1; unknown types ``default_gpus``).
  Several instances get the toolkit's command (sagemaker-training-toolkit,
  ``torch_distributed.py``): ``--nnodes N --nproc_per_node P --master_addr algo-1 --master_port 7777
  --node_rank <index of the host in SM_HOSTS>``, except that the master is 127.0.0.1 and the port a
  free one per job, since every instance shares this machine's network; one instance gets
  ``--standalone --nproc-per-node=P`` instead (the toolkit passes no rendezvous there, and its
  default port would clash between concurrent jobs here). The environment: the request's Environment
  plus ``SM_HPS`` (the decoded hyperparameters but the ``sagemaker_*`` ones), ``SM_CHANNEL_<NAME>``,
  ``SM_NUM_GPUS``, ``SM_HOSTS``, ``SM_CURRENT_HOST``, ``TRAINING_JOB_NAME``; the argv ``--key value``
  per hyperparameter, sorted, as the toolkit builds it;
- the mounts, as a path mapping: a FileSystemDataSource channel (file system id + DirectoryPath) is the
  local folder configured in ``file_systems``; env values and hyperparameters that start with
  ``/opt/ml/input/data/<channel>``, ``/opt/ml/checkpoints`` (the LocalPath), ``/opt/ml/code``,
  ``/opt/ml/model`` or ``/opt/ml/output`` are rewritten to the instance's local folders;
- checkpoints: each instance's checkpoint folder is synced with ``CheckpointConfig.S3Uri`` through
  real S3 calls against ``s3_endpoint_url`` (moto): downloaded before the script starts, new or
  changed files uploaded every ``sync_s`` while it runs and once more at the end;
- each instance's output lines (stdout and stderr together) as events of its own stream
  ``<job>/algo-<n>-<epoch s>``;
- the end: Completed once every instance's script exited 0; Failed as soon as one exits non-zero
  (FailureReason from that instance's exit code and log), the other instances then SIGKILLed;
- StopTrainingJob: SIGTERM to the job's processes, SIGKILL after ``stop_grace_s``; ``crash(job)``:
  SIGKILL, ending Failed like an instance failure (no final checkpoint upload). Like an instance going
  away, every process the job left is killed when it ends (found by ``INSTANCE_ENV``);
- a reply lost on the network, on demand (``lose_replies``): the request is carried out, then the
  connection is closed without an answer, as when a reply times out; botocore then retries the call
  itself, as it does against AWS.

Not emulated: images (jobs run this machine's Python; TrainingImage is ignored), IAM, VPC, the
instances' network (hostnames, EFA: every instance is 127.0.0.1), S3 channels and ``s3://`` code
tarballs, the output upload (model.tar.gz), RetryStrategy and spot, SMP (``mp_parameters`` is passed
on, not acted on), deleting in S3 what the job deleted locally, paging of DescribeLogStreams,
server-side request validation (botocore validates requests against the real model on the client
side).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
from ports import free_port

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
CONTAINER_DATA = "/opt/ml/input/data"
# Every process of a job inherits this variable, which is how the stand-in finds them all: torchrun
# starts its workers in sessions of their own, so no process group holds a whole job.
INSTANCE_ENV = "STANDIN_INSTANCE_ID"
TERMINAL = ("Completed", "Failed", "Stopped")
INSTANCE_FAILURE = "InternalServerError: We encountered an internal error.  Please try again."
# GPUs per instance (AWS instance type pages). CPU families (ml.m, ml.c, ml.r, ml.t) have none.
GPUS_PER_INSTANCE = {
    "ml.g4dn.xlarge": 1, "ml.g4dn.12xlarge": 4, "ml.g5.xlarge": 1, "ml.g5.2xlarge": 1,
    "ml.g5.12xlarge": 4, "ml.g5.48xlarge": 8, "ml.g6.xlarge": 1, "ml.g6.12xlarge": 4,
    "ml.p3.2xlarge": 1, "ml.p3.8xlarge": 4, "ml.p3.16xlarge": 8, "ml.p4d.24xlarge": 8,
    "ml.p4de.24xlarge": 8, "ml.p5.48xlarge": 8,
}  # fmt: skip
_CPU_FAMILIES = re.compile(r"^ml\.(m|c|r|t)\d")


class ApiError(Exception):
    """An AWS error answer: HTTP 400 with ``__type`` and ``message``, as botocore parses them."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _JobFailed(Exception):
    """The job cannot go on; ``str(exc)`` is its FailureReason."""


class Instance:
    """One instance of a job, ``algo-<n>``: its ``/opt/ml`` folder, its log stream and, through
    ``instance_id`` in their environment, its processes. The job's lock guards ``events``."""

    def __init__(self, job_name: str, host: str, created: float, job_dir: Path) -> None:
        self.host = host
        self.dir = job_dir / host  # the instance's /opt/ml
        self.stream = f"{job_name}/{host}-{int(created)}"
        self.instance_id = f"{job_name}-{host}-{secrets.token_hex(4)}"
        self.events: list[dict[str, Any]] | None = None  # None until the instance starts
        self.command: list[str] = []


class TrainingJob:
    """One training job: its request, where it stands, and its instances."""

    def __init__(self, request: dict[str, Any], work_dir: Path) -> None:
        self.name: str = request["TrainingJobName"]
        self.request = request
        self.arn = f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{self.name.lower()}"
        self.status, self.secondary, self.failure_reason = "InProgress", "Starting", ""
        self.transitions: list[dict[str, Any]] = [{"Status": "Starting", "StartTime": time.time()}]
        self.created = time.time()
        count = request["ResourceConfig"]["InstanceCount"]
        self.instances = [
            Instance(self.name, f"algo-{n}", self.created, work_dir / self.name) for n in range(1, count + 1)
        ]
        self.stop_requested, self.crashed, self.max_runtime_exceeded = threading.Event(), False, False
        self.lock = threading.Lock()
        hps = {key: _decode(value) for key, value in request.get("HyperParameters", {}).items()}
        self.hyperparameters: dict[str, Any] = hps
        self.checkpoint_uri: str | None = request.get("CheckpointConfig", {}).get("S3Uri")
        self.synced: dict[str, tuple[int, int]] = {}  # checkpoint file -> (mtime_ns, size) in S3

    def set(self, status: str, secondary: str, reason: str = "") -> None:
        with self.lock:
            # A stopping job only ends: its last steps (the upload) happen under Stopping.
            if self.status in TERMINAL or (self.status == "Stopping" and status not in TERMINAL):
                return
            now = time.time()
            self.transitions[-1]["EndTime"] = now
            self.transitions.append({"Status": secondary, "StartTime": now})
            self.status, self.secondary, self.failure_reason = status, secondary, reason

    @property
    def dir(self) -> Path:
        """algo-1's ``/opt/ml``."""
        return self.instances[0].dir

    @property
    def hosts(self) -> list[str]:
        return [instance.host for instance in self.instances]

    def log(self, instance: Instance, line: str) -> None:
        with self.lock:
            if instance.events is None:
                instance.events = []
            stamp = int(time.time() * 1000)
            instance.events.append({"timestamp": stamp, "message": line, "ingestionTime": stamp})

    def describe(self) -> dict[str, Any]:
        fields = ("TrainingJobName", "HyperParameters", "AlgorithmSpecification", "RoleArn", "Environment")
        fields += ("InputDataConfig", "OutputDataConfig", "ResourceConfig", "StoppingCondition")
        with self.lock:
            answer = {key: self.request[key] for key in (*fields, "CheckpointConfig") if key in self.request}
            output = self.request["OutputDataConfig"]["S3OutputPath"].rstrip("/")
            answer |= {
                "TrainingJobArn": self.arn,
                "TrainingJobStatus": self.status,
                "SecondaryStatus": self.secondary,
                "SecondaryStatusTransitions": [dict(t) for t in self.transitions],
                "ModelArtifacts": {"S3ModelArtifacts": f"{output}/{self.name}/output/model.tar.gz"},
                "CreationTime": self.created,
                "LastModifiedTime": self.transitions[-1]["StartTime"],
            }
            if self.failure_reason:
                answer["FailureReason"] = self.failure_reason
        return answer


class SageMakerStandIn:
    """The stand-in server; a context manager that serves on 127.0.0.1 while it is open.

    ``file_systems`` maps (FileSystemId, DirectoryPath) to the local folder that stands for it;
    ``work_dir`` holds each instance's ``/opt/ml``, ``<work_dir>/<job>/algo-<n>``. ``calls`` records
    every ``(operation, job or stream name)`` received, for tests that count calls. Thread safe.
    """

    def __init__(
        self,
        *,
        file_systems: Mapping[tuple[str, str], Path],
        work_dir: Path,
        s3_endpoint_url: str,
        max_procs: int = 2,
        default_gpus: int = 1,
        phase_s: float = 0.05,
        sync_s: float = 0.1,
        stop_grace_s: float = 5.0,
    ) -> None:
        self.file_systems = dict(file_systems)
        self.work_dir = work_dir
        self.max_procs, self.default_gpus = max_procs, default_gpus
        self.phase_s, self.sync_s, self.stop_grace_s = phase_s, sync_s, stop_grace_s
        self.s3 = boto3.client(
            "s3", endpoint_url=s3_endpoint_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip
        self.jobs: dict[str, TrainingJob] = {}
        self.calls: list[tuple[str, str]] = []
        self._replies_to_lose: dict[str, int] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.standin = self  # type: ignore[attr-defined]
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def client_environment(self) -> dict[str, str]:
        """What points tunepod's own boto3 clients here: the endpoint variables botocore reads, and
        credentials (never checked)."""
        return {
            "AWS_ENDPOINT_URL_SAGEMAKER": self.endpoint_url,
            "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def __enter__(self) -> SageMakerStandIn:
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        for job in list(self.jobs.values()):
            if job.status not in TERMINAL:
                job.stop_requested.set()
                self.crash(job.name)
        for thread in self._threads:
            thread.join(timeout=30)

    def count(self, operation: str, name: str | None = None) -> int:
        with self._lock:
            return sum(1 for op, on in self.calls if op == operation and name in (None, on))

    def lose_replies(self, operation: str, count: int = 1) -> None:
        """Carry out the next ``count`` calls of ``operation`` (``CreateTrainingJob``), then close the
        connection without answering them."""
        with self._lock:
            self._replies_to_lose[operation] = count

    def reply_is_lost(self, target: str) -> bool:
        """Whether the answer to this call of ``target`` is to be lost (counts it down)."""
        operation = target.split(".")[-1]
        with self._lock:
            left = self._replies_to_lose.get(operation, 0)
            if left:
                self._replies_to_lose[operation] = left - 1
            return left > 0

    def crash(self, name: str) -> None:
        """Kill the job's processes as an instance failure would; the job ends Failed."""
        job = self.jobs[name]
        job.crashed = True
        _kill_instances(job, signal.SIGKILL)

    # ---------------------------------------------------------------------------------- the API

    def dispatch(self, target: str, body: dict[str, Any]) -> dict[str, Any]:
        operations: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "SageMaker.CreateTrainingJob": self._create,
            "SageMaker.DescribeTrainingJob": lambda b: self._job(b).describe(),
            "SageMaker.StopTrainingJob": self._stop,
            "Logs_20140328.DescribeLogStreams": self._describe_log_streams,
            "Logs_20140328.GetLogEvents": self._get_log_events,
        }
        if target not in operations:
            raise ApiError("UnknownOperationException", f"the stand-in does not emulate {target}")
        with self._lock:
            name = body.get("TrainingJobName") or body.get("logStreamName") or body.get("logStreamNamePrefix")
            self.calls.append((target.split(".")[-1], str(name or "")))
        return operations[target](body)

    def _job(self, body: dict[str, Any]) -> TrainingJob:
        job = self.jobs.get(body["TrainingJobName"])
        if job is None:
            raise ApiError("ValidationException", "Requested resource not found.")
        return job

    def _create(self, request: dict[str, Any]) -> dict[str, Any]:
        for channel in request.get("InputDataConfig", []):
            if "FileSystemDataSource" not in channel["DataSource"]:
                raise ApiError(
                    "ValidationException", "the stand-in mounts FileSystemDataSource channels only"
                )
        with self._lock:
            if request["TrainingJobName"] in self.jobs:
                raise ApiError("ResourceInUse", f"Training job {request['TrainingJobName']} already exists")
            job = self.jobs[request["TrainingJobName"]] = TrainingJob(request, self.work_dir)
            thread = threading.Thread(target=self._run, args=(job,), name=f"job-{job.name}", daemon=True)
            self._threads.append(thread)
        thread.start()
        return {"TrainingJobArn": job.arn}

    def _stop(self, body: dict[str, Any]) -> dict[str, Any]:
        job = self._job(body)
        if job.status in TERMINAL:
            raise ApiError("ValidationException", f"The training job is in status {job.status}")
        job.set("Stopping", "Stopping")
        job.stop_requested.set()
        return {}

    def _started(self) -> list[tuple[TrainingJob, Instance]]:
        """Every instance that has a log stream (it has started), with its job."""
        return [(j, i) for j in list(self.jobs.values()) for i in j.instances if i.events is not None]

    def _describe_log_streams(self, body: dict[str, Any]) -> dict[str, Any]:
        streams = self._started()
        if body["logGroupName"] != LOG_GROUP or not streams:
            raise ApiError("ResourceNotFoundException", "The specified log group does not exist.")
        prefix = body.get("logStreamNamePrefix", "")
        return {
            "logStreams": [
                {
                    "logStreamName": i.stream,
                    "creationTime": int(j.created * 1000),
                    "arn": f"{j.arn}:{i.stream}",
                }
                for j, i in streams
                if i.stream.startswith(prefix)
            ]
        }

    def _get_log_events(self, body: dict[str, Any]) -> dict[str, Any]:
        found = next(((j, i) for j, i in self._started() if i.stream == body["logStreamName"]), None)
        if body["logGroupName"] != LOG_GROUP or found is None:
            raise ApiError("ResourceNotFoundException", "The specified log stream does not exist.")
        job, instance = found
        with job.lock:
            events = list(instance.events or [])
        limit, token = int(body.get("limit", 10_000)), body.get("nextToken", "")
        if token.startswith("f/") or (not token and body.get("startFromHead")):
            start = int(token[2:]) if token else 0
            end = min(len(events), start + limit)
        else:  # backwards from the token, or from the newest event
            end = int(token[2:]) if token else len(events)
            start = max(0, end - limit)
        return {
            "events": events[start:end],
            "nextForwardToken": f"f/{end}",
            "nextBackwardToken": f"b/{start}",
        }

    # ---------------------------------------------------------------------------------- a job's life

    def _run(self, job: TrainingJob) -> None:
        try:
            final = self._lifecycle(job)
        except _JobFailed as exc:
            final = ("Failed", "Failed", str(exc))
        except Exception as exc:  # a stand-in bug must end the job visibly, not hang the test
            final = ("Failed", "Failed", f"InternalServerError: stand-in: {type(exc).__name__}: {exc}")
        # The instances go away with everything they ran before the job is seen to end.
        _kill_instances(job, signal.SIGKILL)
        job.set(*final)

    def _lifecycle(self, job: TrainingJob) -> tuple[str, str, str]:
        """Walk the job through its statuses; its final (status, secondary status, reason)."""
        time.sleep(self.phase_s)
        if not job.stop_requested.is_set():
            job.set("InProgress", "Downloading")
            port = free_port()
            envs = [self._prepare(job, instance, port) for instance in job.instances]
            time.sleep(self.phase_s)
        if not job.stop_requested.is_set():
            job.set("InProgress", "Training")
            failure = self._train(job, envs)
            if job.crashed:
                raise _JobFailed(INSTANCE_FAILURE)
            job.set("InProgress", "Uploading")
            self._upload_checkpoints(job)
            if failure is not None and not job.stop_requested.is_set():
                raise _JobFailed(_script_error(job, *failure))
        if job.max_runtime_exceeded:
            return ("Stopped", "MaxRuntimeExceeded", "")
        if job.stop_requested.is_set():
            return ("Stopped", "Stopped", "")
        return ("Completed", "Completed", "")

    def _prepare(self, job: TrainingJob, instance: Instance, port: int) -> dict[str, str]:
        """Mount, fetch the code and the checkpoints on ``instance``; set its toolkit command
        (``instance.command``) and return its environment."""
        mounts = self._mounts(job, instance)
        for folder in ("code", "checkpoints", "model", "output/data"):
            (instance.dir / folder).mkdir(parents=True, exist_ok=True)
        hps = {key: _map_paths(value, mounts) for key, value in job.hyperparameters.items()}
        source = Path(str(hps["sagemaker_submit_directory"]))
        if not source.is_dir():
            raise _JobFailed(f"ClientError: sagemaker_submit_directory {source} is not a folder here")
        shutil.copytree(source, instance.dir / "code", dirs_exist_ok=True)
        self._download_checkpoints(job, instance)
        user = {key: value for key, value in hps.items() if not key.startswith("sagemaker_")}
        gpus = self._gpus(job.request["ResourceConfig"]["InstanceType"])
        env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TMPDIR") if name in os.environ}
        env |= {
            name: str(_map_paths(value, mounts)) for name, value in job.request.get("Environment", {}).items()
        }
        env |= {f"SM_CHANNEL_{c.upper()}": str(mounts[f"{CONTAINER_DATA}/{c}"]) for c in self._channels(job)}
        env |= {
            "SM_HPS": json.dumps(user),
            "SM_CHANNELS": json.dumps(sorted(self._channels(job))),
            "SM_NUM_GPUS": str(gpus),
            "SM_CURRENT_HOST": instance.host,
            "SM_HOSTS": json.dumps(job.hosts),
            "SM_MODEL_DIR": str(instance.dir / "model"),
            "SM_OUTPUT_DATA_DIR": str(instance.dir / "output" / "data"),
            "TRAINING_JOB_NAME": job.name,
            INSTANCE_ENV: instance.instance_id,
        }
        procs = min(max(gpus, 1), self.max_procs)
        launch = [sys.executable, "-m", "torch.distributed.run", *_torchrun_flags(job, instance, procs, port)]
        instance.command = [*launch, str(hps["sagemaker_program"]), *_cmd_args(user)]
        return env

    def _mounts(self, job: TrainingJob, instance: Instance) -> dict[str, Path]:
        """Container path -> local folder on ``instance``, longest first."""
        local_path = job.request.get("CheckpointConfig", {}).get("LocalPath", "/opt/ml/checkpoints")
        mounts = {local_path: instance.dir / "checkpoints", "/opt/ml/code": instance.dir / "code"}
        mounts |= {"/opt/ml/model": instance.dir / "model", "/opt/ml/output": instance.dir / "output"}
        for channel in job.request.get("InputDataConfig", []):
            source = channel["DataSource"]["FileSystemDataSource"]
            key = (source["FileSystemId"], source["DirectoryPath"])
            if key not in self.file_systems:
                raise _JobFailed(
                    f"ClientError: Unable to mount file system: {key[0]} directory path: {key[1]}. "
                    "Incorrect file system directory path."
                )
            mounts[f"{CONTAINER_DATA}/{channel['ChannelName']}"] = self.file_systems[key]
        return dict(sorted(mounts.items(), key=lambda item: -len(item[0])))

    def _channels(self, job: TrainingJob) -> list[str]:
        return [channel["ChannelName"] for channel in job.request.get("InputDataConfig", [])]

    def _gpus(self, instance_type: str) -> int:
        if _CPU_FAMILIES.match(instance_type):
            return 0
        return GPUS_PER_INSTANCE.get(instance_type, self.default_gpus)

    def _train(self, job: TrainingJob, envs: list[dict[str, str]]) -> tuple[Instance, int] | None:
        """Run every instance's command to its end; the first instance to fail and its exit code.

        The first failure stops the other instances (SIGKILL). A stop request or the max runtime
        stops them all (SIGTERM, then SIGKILL after ``stop_grace_s``). Checkpoints are synced every
        ``sync_s`` meanwhile.
        """
        exits: queue.Queue[tuple[Instance, int]] = queue.Queue()
        pumps = [
            self._start(job, instance, env, exits) for instance, env in zip(job.instances, envs, strict=True)
        ]
        deadline = time.monotonic() + job.request["StoppingCondition"]["MaxRuntimeInSeconds"]
        failure: tuple[Instance, int] | None = None
        for _ in job.instances:
            instance, code = self._next_exit(job, exits, deadline)
            if code != 0 and failure is None and not job.stop_requested.is_set() and not job.crashed:
                failure = (instance, code)
                _kill_instances(job, signal.SIGKILL)
        for pump in pumps:
            pump.join(timeout=10)
        return failure

    def _start(
        self,
        job: TrainingJob,
        instance: Instance,
        env: dict[str, str],
        exits: queue.Queue[tuple[Instance, int]],
    ) -> threading.Thread:
        """Start ``instance``'s command and a thread that puts ``(instance, exit code)`` on ``exits``
        when it exits; the thread that pumps its output into its log stream (which may outlive the
        command while an orphan holds the pipe, until the instance is killed)."""
        job.log(instance, f"Invoking script with the following command: {' '.join(instance.command)}")
        process = subprocess.Popen(
            instance.command, cwd=instance.dir / "code", env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a container of its own: the test's Ctrl-C does not reach it
        )  # fmt: skip
        waiter = threading.Thread(target=lambda: exits.put((instance, process.wait())), daemon=True)
        waiter.start()
        pump = threading.Thread(target=_pump, args=(job, instance, process), daemon=True)
        pump.start()
        return pump

    def _next_exit(
        self, job: TrainingJob, exits: queue.Queue[tuple[Instance, int]], deadline: float
    ) -> tuple[Instance, int]:
        """Wait for the next instance to end, meanwhile syncing checkpoints and acting on a stop
        request or the max runtime."""
        while True:
            try:
                return exits.get(timeout=self.sync_s)
            except queue.Empty:
                pass
            if not job.stop_requested.is_set() and time.monotonic() > deadline:
                job.max_runtime_exceeded = True
                job.set("Stopping", "Stopping")
                job.stop_requested.set()
            if job.stop_requested.is_set():
                _terminate(job, self.stop_grace_s)  # again until every instance has ended: cheap then
            elif not job.crashed:
                self._upload_checkpoints(job)

    # ---------------------------------------------------------------------------------- checkpoint sync

    def _bucket_and_prefix(self, job: TrainingJob) -> tuple[str, str]:
        assert job.checkpoint_uri is not None
        bucket, _, prefix = job.checkpoint_uri.removeprefix("s3://").partition("/")
        return bucket, prefix.strip("/")

    def _download_checkpoints(self, job: TrainingJob, instance: Instance) -> None:
        if job.checkpoint_uri is None:
            return
        bucket, prefix = self._bucket_and_prefix(job)
        try:
            for key in _keys(self.s3, bucket, prefix):
                target = instance.dir / "checkpoints" / key[len(prefix) :].lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                self.s3.download_file(bucket, key, str(target))
                stat = target.stat()
                job.synced[str(target)] = (stat.st_mtime_ns, stat.st_size)
        except Exception as exc:
            raise _JobFailed(
                f"ClientError: cannot download checkpoints from {job.checkpoint_uri}: {exc}"
            ) from exc

    def _upload_checkpoints(self, job: TrainingJob) -> None:
        """Upload what is new or changed in every instance's checkpoint folder."""
        if job.checkpoint_uri is None:
            return
        bucket, prefix = self._bucket_and_prefix(job)
        for instance in job.instances:
            root = instance.dir / "checkpoints"
            for path in _files_under(root):
                try:
                    stat = path.stat()
                    if not path.is_file() or job.synced.get(str(path)) == (stat.st_mtime_ns, stat.st_size):
                        continue
                    key = f"{prefix}/{path.relative_to(root).as_posix()}".lstrip("/")
                    self.s3.upload_file(str(path), bucket, key)
                except FileNotFoundError:  # a save in progress renamed it away: the next pass sees it
                    continue
                job.synced[str(path)] = (stat.st_mtime_ns, stat.st_size)


def _files_under(root: Path) -> list[Path]:
    """Every file below ``root``. os.walk skips a folder that vanishes while it walks (a checkpoint
    save renames its temp folder away), where Path.rglob raises FileNotFoundError."""
    return sorted(Path(folder, name) for folder, _, names in os.walk(root) for name in names)


def _torchrun_flags(job: TrainingJob, instance: Instance, procs: int, port: int) -> list[str]:
    """The toolkit's torchrun flags (see the module docstring for where the stand-in differs)."""
    if len(job.instances) == 1:
        return ["--standalone", f"--nproc-per-node={procs}"]
    node = ["--nnodes", str(len(job.instances)), "--nproc_per_node", str(procs)]
    master = ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    return [*node, *master, "--node_rank", str(job.hosts.index(instance.host))]


def _keys(s3: Any, bucket: str, prefix: str) -> Iterator[str]:
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/" if prefix else ""
    ):
        yield from (item["Key"] for item in page.get("Contents", []))


def _decode(value: str) -> Any:
    # The toolkit decodes each hyperparameter as JSON and keeps what does not parse as a string.
    try:
        return json.loads(value)
    except ValueError:
        return value


def _map_paths(value: Any, mounts: Mapping[str, Path]) -> Any:
    """``value`` with every string that starts with a container path rewritten to the local folder."""
    if isinstance(value, list):
        return [_map_paths(item, mounts) for item in value]
    if isinstance(value, str):
        for container, local in mounts.items():
            if value == container or value.startswith(container + "/"):
                return str(local) + value[len(container) :]
    return value


def _cmd_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    """The toolkit's argv: ``--key value`` per hyperparameter, sorted; a dict as ``k=v,k=v``."""

    def text(value: Any) -> str:
        if isinstance(value, dict):
            return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        return str(value)

    pairs = ((f"--{key}", text(hyperparameters[key])) for key in sorted(hyperparameters))
    return list(itertools.chain.from_iterable(pairs))


def _pump(job: TrainingJob, instance: Instance, process: subprocess.Popen[bytes]) -> None:
    assert process.stdout is not None
    for raw in process.stdout:
        job.log(instance, raw.decode("utf-8", errors="replace").rstrip("\n"))


def _script_error(job: TrainingJob, instance: Instance, code: int) -> str:
    """The toolkit's FailureReason for a script that exited ``code`` on ``instance``, with its last
    error line."""
    with job.lock:
        lines = [event["message"] for event in instance.events or []]
    errors = [line for line in lines if re.match(r"^\w[\w.]*(Error|Exception): ", line)]
    message = next((line for line in reversed(errors) if "ChildFailedError" not in line), "")
    return (
        f'AlgorithmError: ExecuteUserScriptError:\nExitCode {code}\nErrorMessage "{message}"\n'
        f'Command "{" ".join(instance.command)}", exit code: {code}'
    )


def _instance_pids(instance_id: str) -> list[int]:
    """Live processes that inherited ``INSTANCE_ENV=instance_id`` (a zombie's environ reads empty)."""
    needle = f"{INSTANCE_ENV}={instance_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                pids.append(int(entry))
    return pids


def _kill_instances(job: TrainingJob, sig: signal.Signals) -> None:
    """Signal every process of every instance of ``job``; with SIGKILL, until none is left."""
    for _ in range(100):
        pids = [pid for instance in job.instances for pid in _instance_pids(instance.instance_id)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if not pids or sig != signal.SIGKILL:
            return
        time.sleep(0.02)


def _terminate(job: TrainingJob, grace_s: float) -> None:
    """SIGTERM to every process of the job, SIGKILL to those left after ``grace_s``."""
    _kill_instances(job, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_instance_pids(i.instance_id) for i in job.instances):
        time.sleep(0.05)
    _kill_instances(job, signal.SIGKILL)


class _Handler(BaseHTTPRequestHandler):
    """One AWS JSON-protocol request: the operation in ``X-Amz-Target``, the input as the JSON body."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        standin: SageMakerStandIn = self.server.standin  # type: ignore[attr-defined]
        target = self.headers.get("X-Amz-Target", "")
        try:
            status, answer = 200, standin.dispatch(target, body)
        except ApiError as exc:
            status, answer = 400, {"__type": exc.code, "message": exc.message}
        if standin.reply_is_lost(target):
            self.close_connection = True  # no answer at all: the client cannot tell what happened
            return
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the test output is for the tests."""
