"""``SageMakerLauncher`` against a real moto server (create, describe, attach: moto's jobs complete at
once) and, for what moto cannot do (StopTrainingJob, jobs in progress, failures, throttling), a real
botocore client driven by Stubber, which still validates every request against the API model. The
launcher contract itself, and the exactly-once cases, run against the SageMaker stand-in in
``test_sagemaker_contract.py``: moto (5.x) drops a request's ``Environment`` (DescribeTrainingJob
returns none, so no job can be shown to carry its submission id) and silently replaces a training job
created twice under one name instead of answering ResourceInUse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto_server import MotoServer

from tunepod.errors import JobError, TransientError
from tunepod.launch.base import JobSpec, JobState, wait
from tunepod.launch.sagemaker import SageMakerLauncher, render_training_job
from tunepod.launch.submission import Submission, read_submission, write_submission
from tunepod.spec.models import SageMakerLauncherSpec


def launcher_spec(root: Path) -> SageMakerLauncherSpec:
    return SageMakerLauncherSpec.model_validate(
        {
            "kind": "sagemaker",
            "root": str(root),
            "role_arn": "arn:aws:iam::123456789012:role/tunepod-training",
            "image_uri": "123456789012.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:latest",
            "output_s3_uri": "s3://bucket/output",
            "checkpoint_s3_uri": "s3://bucket/checkpoints",
            "code_uri": "s3://bucket/code/sourcedir.tar.gz",
            "instance_type": "ml.m5.xlarge",
        }
    )


def a_job(tmp_path: Path, name: str = "digits-trial-1") -> JobSpec:
    return JobSpec(
        name=name,
        entrypoint=tmp_path / "train.py",
        job_dir=tmp_path / "jobs" / name,
        env={"TUNEPOD_PARAMS": json.dumps({"lr": 0.1}), "TUNEPOD_TRIAL": "1"},
    )


def test_submit_describe_attach_and_resubmit_on_moto(moto: MotoServer, tmp_path: Path) -> None:
    client = moto.client("sagemaker")
    launcher = SageMakerLauncher(
        launcher_spec(tmp_path), client, logs_client=moto.client("logs"), cancel_poll_s=0.05
    )
    job = a_job(tmp_path)
    handle = launcher.submit(job)
    assert handle.job_id == "digits-trial-1"
    assert wait(handle, poll_s=0.05, timeout_s=30) is JobState.SUCCEEDED
    described = client.describe_training_job(TrainingJobName=handle.job_id)
    assert described["HyperParameters"]["lr"] == "0.1"
    assert described["ResourceConfig"]["InstanceType"] == "ml.m5.xlarge"
    assert described["CheckpointConfig"]["S3Uri"] == "s3://bucket/checkpoints/jobs/digits-trial-1/checkpoints"
    assert "Completed" in handle.describe()
    logs = handle.logs()  # moto has no log group for its jobs: said, not raised
    assert "cannot read CloudWatch Logs for digits-trial-1" in logs
    assert "/aws/sagemaker/TrainingJobs" in logs
    again = launcher.attach(handle.job_id, job.job_dir)
    assert again.state() is JobState.SUCCEEDED
    handle.cancel()  # a finished job keeps its outcome; no StopTrainingJob is sent
    assert handle.state() is JobState.SUCCEEDED
    # A second submission of the same tunepod job is a new training job (names are never reused).
    second = launcher.submit(job)
    assert second.job_id == "digits-trial-1-r2"
    assert json.loads((job.job_dir / "submission.json").read_text())["attempt"] == 2
    with pytest.raises(JobError, match="digits-trial-1-r2"):
        launcher.attach("digits-trial-1", job.job_dir)


def test_a_job_sagemaker_does_not_know_has_failed_and_says_why(moto: MotoServer, tmp_path: Path) -> None:
    launcher = SageMakerLauncher(launcher_spec(tmp_path), moto.client("sagemaker"))
    handle = launcher.attach("never-submitted", tmp_path / "nowhere")
    assert handle.state() is JobState.FAILED
    assert handle.describe().startswith(
        "sagemaker training job never-submitted NotFound (SageMaker knows no training job never-submitted "
        "in this account and region; fix: check the launcher's region"
    )


def test_attach_refuses_what_cannot_be_a_training_job_name(tmp_path: Path) -> None:
    client, _ = stubbed()
    with pytest.raises(JobError, match="not a SageMaker training job name"):
        SageMakerLauncher(launcher_spec(tmp_path), client).attach("local-00000000000000aa_x", tmp_path)


def stubbed(service: str = "sagemaker") -> tuple[Any, Stubber]:
    client = boto3.client(service, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def describe(name: str, status: str, secondary: str, reason: str = "") -> dict[str, Any]:
    response: dict[str, Any] = {
        "TrainingJobName": name,
        "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}",
        "ModelArtifacts": {"S3ModelArtifacts": "s3://bucket/output/model.tar.gz"},
        "TrainingJobStatus": status,
        "SecondaryStatus": secondary,
        "AlgorithmSpecification": {"TrainingInputMode": "File"},
        "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50},
        "StoppingCondition": {"MaxRuntimeInSeconds": 60},
        "CreationTime": "2025-01-01T00:00:00Z",
    }
    if reason:
        response["FailureReason"] = reason
    return response


def test_cancel_stops_and_waits_until_stopped(tmp_path: Path) -> None:
    client, stub = stubbed()
    name = {"TrainingJobName": "trial-3"}
    stub.add_response("describe_training_job", describe("trial-3", "InProgress", "Training"), name)
    stub.add_response("stop_training_job", {}, name)
    stub.add_response("describe_training_job", describe("trial-3", "Stopping", "Stopping"), name)
    stub.add_response("describe_training_job", describe("trial-3", "Stopped", "Stopped"), name)
    with stub:
        handle = SageMakerLauncher(launcher_spec(tmp_path), client, cancel_poll_s=0.01).attach(
            "trial-3", tmp_path
        )
        handle.cancel()
        assert handle.state() is JobState.CANCELLED  # the final state is kept: no call more
        stub.assert_no_pending_responses()
    assert (tmp_path / "cancelled").exists()


def test_stop_racing_the_end_keeps_the_real_outcome(tmp_path: Path) -> None:
    client, stub = stubbed()
    name = {"TrainingJobName": "trial-4"}
    stub.add_response("describe_training_job", describe("trial-4", "InProgress", "Uploading"), name)
    stub.add_client_error(
        "stop_training_job", "ValidationException", "The job status is Completed", expected_params=name
    )
    stub.add_response("describe_training_job", describe("trial-4", "Completed", "Completed"), name)
    with stub:
        handle = SageMakerLauncher(launcher_spec(tmp_path), client, cancel_poll_s=0.01).attach(
            "trial-4", tmp_path
        )
        handle.cancel()
        # The stop was refused because the job had ended: its outcome is SageMaker's Completed, not a
        # cancellation, and it is kept (no DescribeTrainingJob more).
        assert handle.state() is JobState.SUCCEEDED
        assert wait(handle, poll_s=0.01, timeout_s=1) is JobState.SUCCEEDED
        assert handle.describe() == "sagemaker training job trial-4 Completed (Completed)"
        stub.assert_no_pending_responses()


def test_cloudwatch_tail_failure_reason_and_log_hint_in_logs(tmp_path: Path) -> None:
    client, stub = stubbed()
    logs_client, logs_stub = stubbed("logs")
    reason = 'AlgorithmError: ExecuteUserScriptError:\nExitCode 1\nErrorMessage "ValueError: boom"'
    failed = describe("trial-5", "Failed", "Failed", reason)
    # Once: a final state is never asked again.
    stub.add_response("describe_training_job", failed, {"TrainingJobName": "trial-5"})
    group = "/aws/sagemaker/TrainingJobs"
    streams = ["trial-5/algo-2-1700000000", "trial-5/algo-1-1700000000"]
    logs_stub.add_response(
        "describe_log_streams",
        {"logStreams": [{"logStreamName": stream} for stream in streams]},
        {"logGroupName": group, "logStreamNamePrefix": "trial-5/"},
    )
    for stream in sorted(streams):  # algo-1 first
        host = stream.split("/")[1][:6]
        events = [{"timestamp": 1, "message": f"{host} line {i}", "ingestionTime": 1} for i in range(3)]
        logs_stub.add_response(
            "get_log_events",
            {"events": events},
            {"logGroupName": group, "logStreamName": stream, "startFromHead": False, "limit": 2},
        )
    with stub, logs_stub:
        launcher = SageMakerLauncher(launcher_spec(tmp_path), client, logs_client=logs_client)
        handle = launcher.attach("trial-5", tmp_path)
        assert handle.state() is JobState.FAILED
        assert handle.logs(tail=2).splitlines() == [
            "==> trial-5/algo-1-1700000000 <==",
            "algo-1 line 1",
            "algo-1 line 2",
            "==> trial-5/algo-2-1700000000 <==",
            "algo-2 line 1",
            "algo-2 line 2",
            # A reason of several lines becomes one.
            "FailureReason: " + " ".join(reason.split()),
            f"Full logs: CloudWatch Logs group {group}, streams trial-5/algo-<n>-<timestamp>",
        ]
        assert handle.describe() == (
            "sagemaker training job trial-5 Failed (exit code 1; Failed: AlgorithmError: "
            'ExecuteUserScriptError: ExitCode 1 ErrorMessage "ValueError: boom")'
        )
        stub.assert_no_pending_responses()
        logs_stub.assert_no_pending_responses()


def test_logs_without_permission_say_so(tmp_path: Path) -> None:
    client, stub = stubbed()
    logs_client, logs_stub = stubbed("logs")
    stub.add_response("describe_training_job", describe("trial-8", "InProgress", "Training"))
    logs_stub.add_client_error("describe_log_streams", "AccessDeniedException", "not authorized")
    with stub, logs_stub:
        handle = SageMakerLauncher(launcher_spec(tmp_path), client, logs_client=logs_client).attach(
            "trial-8", tmp_path
        )
        assert handle.logs().splitlines()[0] == (
            "(cannot read CloudWatch Logs for trial-8: access denied; fix: allow logs:DescribeLogStreams and "
            "logs:GetLogEvents on it)"
        )


def test_max_runtime_exceeded_is_a_failure(tmp_path: Path) -> None:
    client, stub = stubbed()
    stub.add_response("describe_training_job", describe("trial-9", "Stopped", "MaxRuntimeExceeded"))
    with stub:
        handle = SageMakerLauncher(launcher_spec(tmp_path), client).attach("trial-9", tmp_path)
        assert handle.state() is JobState.FAILED
        assert "exit code" not in handle.describe()


def transitions(*statuses: str) -> list[dict[str, Any]]:
    """``SecondaryStatusTransitions`` through ``statuses``, a minute each."""
    return [{"Status": status, "StartTime": f"2025-01-01T00:0{n}:00Z"} for n, status in enumerate(statuses)]


def test_a_stop_that_came_while_the_output_uploaded_stopped_no_training(tmp_path: Path) -> None:
    """The script exited 0 and SageMaker was uploading (``Uploading``: "training is complete") when a
    stop reached the job (a pruning decided on its last report): it ends Stopped, yet its training
    finished by itself, so it SUCCEEDED, as a job that beat a stop to its end does elsewhere. A stop
    during Training stays a cancellation, even when the SIGTERM'd script's output is uploaded after."""
    client, stub = stubbed()
    late = describe("trial-13", "Stopped", "Stopped")
    late["SecondaryStatusTransitions"] = transitions(
        "Starting", "Downloading", "Training", "Uploading", "Stopping", "Stopped"
    )
    stopped = describe("trial-14", "Stopped", "Stopped")
    stopped["SecondaryStatusTransitions"] = transitions(
        "Starting", "Downloading", "Training", "Stopping", "Uploading", "Stopped"
    )
    stub.add_response("describe_training_job", late, {"TrainingJobName": "trial-13"})
    stub.add_response("describe_training_job", stopped, {"TrainingJobName": "trial-14"})
    with stub:
        launcher = SageMakerLauncher(launcher_spec(tmp_path), client)
        assert launcher.attach("trial-13", tmp_path / "late").state() is JobState.SUCCEEDED
        assert launcher.attach("trial-14", tmp_path / "stopped").state() is JobState.CANCELLED
        stub.assert_no_pending_responses()


def test_submit_refuses_a_job_dir_whose_job_still_runs(tmp_path: Path) -> None:
    client, stub = stubbed()
    job = a_job(tmp_path, "trial-6")
    job.job_dir.mkdir(parents=True)
    record = Submission(
        backend="sagemaker", name="trial-6", attempt=1, submission_id="00000000000000ab", intent_at="then"
    )
    write_submission(job.paths, record.accepted("trial-6", {}))
    stub.add_response(
        "describe_training_job", describe("trial-6", "InProgress", "Training"), {"TrainingJobName": "trial-6"}
    )
    with stub, pytest.raises(JobError, match="has not ended"):
        SageMakerLauncher(launcher_spec(tmp_path), client).submit(job)


def test_a_throttled_describe_is_transient_never_a_state(tmp_path: Path) -> None:
    client, stub = stubbed()
    stub.add_client_error("describe_training_job", "ThrottlingException", "Rate exceeded")
    with stub:
        handle = SageMakerLauncher(launcher_spec(tmp_path), client).attach("trial-10", tmp_path)
        with pytest.raises(TransientError, match="describe sagemaker training job trial-10"):
            handle.state()


def test_a_taken_name_sagemaker_cannot_describe_yet_is_an_unknown_outcome(tmp_path: Path) -> None:
    """ResourceInUse, then no such job (a lagging read): the job may be ours, so submit fails
    transiently, leaves the intent for the next try, and creates nothing under another name."""
    client, stub = stubbed()
    job = a_job(tmp_path, "trial-11")
    not_found = ("ValidationException", "Requested resource not found.")
    stub.add_client_error("create_training_job", "ResourceInUse", "Training job trial-11 already exists")
    stub.add_client_error(
        "describe_training_job", *not_found, expected_params={"TrainingJobName": "trial-11"}
    )
    stub.add_client_error(
        "describe_training_job", *not_found, expected_params={"TrainingJobName": "trial-11"}
    )
    with stub, pytest.raises(TransientError, match="in use but describes no such job"):
        SageMakerLauncher(launcher_spec(tmp_path), client).submit(job)
    stub.assert_no_pending_responses()
    intent = read_submission(job.paths)
    assert intent is not None and intent.is_intent and intent.name == "trial-11"


def test_the_request_kept_in_the_job_dir_is_what_was_sent_and_owner_only(
    moto: MotoServer, tmp_path: Path
) -> None:
    launcher = SageMakerLauncher(launcher_spec(tmp_path), moto.client("sagemaker"))
    job = a_job(tmp_path, "trial-12")
    launcher.submit(job)
    record = read_submission(job.paths)
    assert record is not None
    kept = job.job_dir / "training-job.json"
    sent = render_training_job(job.with_env({"TUNEPOD_SUBMISSION_ID": record.submission_id}), launcher.spec)
    assert json.loads(kept.read_text()) == sent
    assert kept.stat().st_mode & 0o777 == 0o600
