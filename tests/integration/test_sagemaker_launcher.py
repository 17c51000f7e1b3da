"""``SageMakerLauncher`` against a real moto server (create, describe, attach: moto's jobs complete at
once) and, for what moto cannot do (StopTrainingJob, jobs in progress, failures), a real botocore
client driven by Stubber, which still validates every request against the API model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto_server import MotoServer, moto_server

from tunepod.errors import JobError
from tunepod.launch.base import JobSpec, JobState, wait
from tunepod.launch.sagemaker import SageMakerLauncher
from tunepod.spec.models import SageMakerLauncherSpec


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


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
    launcher = SageMakerLauncher(launcher_spec(tmp_path), client, poll_s=0.05)
    job = a_job(tmp_path)
    handle = launcher.submit(job)
    assert handle.job_id == "digits-trial-1"
    assert wait(handle, poll_s=0.05, timeout_s=30) is JobState.SUCCEEDED
    described = client.describe_training_job(TrainingJobName=handle.job_id)
    assert described["HyperParameters"]["lr"] == "0.1"
    assert described["ResourceConfig"]["InstanceType"] == "ml.m5.xlarge"
    assert "Completed" in handle.describe()
    assert "/aws/sagemaker/TrainingJobs" in handle.logs()
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


def test_unknown_job_is_a_job_error(moto: MotoServer, tmp_path: Path) -> None:
    launcher = SageMakerLauncher(launcher_spec(tmp_path), moto.client("sagemaker"))
    handle = launcher.attach("never-submitted", tmp_path / "nowhere")
    with pytest.raises(JobError, match="never-submitted"):
        handle.state()


def stubbed() -> tuple[Any, Stubber]:
    client = boto3.client(
        "sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
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
    stub.add_response("describe_training_job", describe("trial-3", "Stopped", "Stopped"), name)
    with stub:
        handle = SageMakerLauncher(launcher_spec(tmp_path), client, poll_s=0.01).attach("trial-3", tmp_path)
        handle.cancel()
        assert handle.state() is JobState.CANCELLED
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
        handle = SageMakerLauncher(launcher_spec(tmp_path), client, poll_s=0.01).attach("trial-4", tmp_path)
        handle.cancel()
        stub.assert_no_pending_responses()


def test_failure_reason_and_log_hint_in_logs(tmp_path: Path) -> None:
    client, stub = stubbed()
    name = {"TrainingJobName": "trial-5"}
    reason = "AlgorithmError: ExecuteUserScriptError: exit code 1"
    for _ in range(3):
        stub.add_response("describe_training_job", describe("trial-5", "Failed", "Failed", reason), name)
    with stub:
        handle = SageMakerLauncher(launcher_spec(tmp_path), client).attach("trial-5", tmp_path)
        assert handle.state() is JobState.FAILED
        logs = handle.logs()
        assert reason in logs
        assert "/aws/sagemaker/TrainingJobs" in logs
        assert reason in handle.describe()


def test_submit_refuses_a_job_dir_whose_job_still_runs(tmp_path: Path) -> None:
    client, stub = stubbed()
    job = a_job(tmp_path, "trial-6")
    job.job_dir.mkdir(parents=True)
    (job.job_dir / "submission.json").write_text(json.dumps({"job_id": "trial-6", "attempt": 1}))
    stub.add_response(
        "describe_training_job", describe("trial-6", "InProgress", "Training"), {"TrainingJobName": "trial-6"}
    )
    with stub, pytest.raises(JobError, match="has not ended"):
        SageMakerLauncher(launcher_spec(tmp_path), client).submit(job)
