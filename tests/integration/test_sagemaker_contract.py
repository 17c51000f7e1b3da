"""The launcher contract against ``SageMakerLauncher`` and the SageMaker stand-in
(``tests/standins/sagemaker_api.py``: the real AWS JSON protocol over HTTP, jobs as local torchrun
processes, FSx as a local folder), plus SageMaker-only tests: the state cache, CloudWatch logs, the exit
code in ``describe``, an evaluation job finding a trial's checkpoints, checkpoints synced with a real
moto S3 server when the channel is read-only, MaxRuntimeExceeded, exactly-once creation (a create whose
reply is lost and that botocore retries, a name held by another submission, a crash between create and
record), and 2-instance jobs that form one gloo process group across the instances or fail as a whole
when one instance fails.

The launcher is built as the factory builds it, ``SageMakerLauncher(spec)``, and finds the stand-in
through ``AWS_ENDPOINT_URL_SAGEMAKER`` / ``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS``. ``tmp_path`` is the
launcher's root and the folder the stand-in mounts as the FSx file system, so the contract's job dirs
are on "FSx"; the fixture scripts are copied there too, as a user's code would be.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from launcher_contract import JOBS, LauncherContract, finish, fixture_job, is_alive, recorded_pids, wait_until
from moto_server import MotoServer, moto_server
from standins.sagemaker_api import SageMakerStandIn
from tiny_study import QUADRATIC, as_submitted, preview_first_trial

from tunepod import runtime
from tunepod.errors import JobError, TransientError
from tunepod.launch import base
from tunepod.launch.base import SUBMISSION_ID_ENV, JobHandle, JobSpec, JobState, Launcher, Resources
from tunepod.launch.paths import JobPaths
from tunepod.launch.sagemaker import SageMakerJob, SageMakerLauncher
from tunepod.launch.submission import Submission, read_submission
from tunepod.spec.models import SageMakerLauncherSpec

pytestmark = pytest.mark.timeout(180)

BUCKET = "tunepod-test"
FILE_SYSTEM = ("fs-0123456789abcdef0", "/abcdefgh/tunepod")
# Instance types by processes: a CPU type runs one; the GPU type has 4 GPUs, which the stand-in
# caps at 2 processes (this machine's cores).
INSTANCE_TYPES = {1: "ml.m5.xlarge", 2: "ml.g5.12xlarge"}


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with moto_server() as server:
        server.client("s3").create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def standin(
    moto: MotoServer,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[SageMakerStandIn]:
    instances = tmp_path_factory.mktemp("instances")
    with SageMakerStandIn(
        file_systems={FILE_SYSTEM: tmp_path}, work_dir=instances, s3_endpoint_url=moto.endpoint_url
    ) as server:
        for name, value in server.client_environment().items():
            monkeypatch.setenv(name, value)
        yield server


def sagemaker_spec(root: Path, **fields: object) -> SageMakerLauncherSpec:
    values = {
        "kind": "sagemaker",
        "root": str(root),
        "role_arn": "arn:aws:iam::123456789012:role/tunepod-test",
        "image_uri": "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.5.1-cpu-py311",
        "output_s3_uri": f"s3://{BUCKET}/output",
        # One prefix per test: the moto server outlives the test, and job dirs repeat across tests.
        "checkpoint_s3_uri": f"s3://{BUCKET}/{root.name}/checkpoints",
        "fsx": {"file_system_id": FILE_SYSTEM[0], "directory_path": FILE_SYSTEM[1]},
        "subnets": ["subnet-0a1b2c3d"],
        "security_group_ids": ["sg-0a1b2c3d"],
        "poll_cache_s": 0.2,
        **fields,
    }
    return SageMakerLauncherSpec.model_validate(values)


def sagemaker_job(job_dir: Path, script: str, *args: str, procs: int = 1, **resources: Any) -> JobSpec:
    """A fixture job as SageMaker takes it: its code on FSx, its argv as the parameter ``args``."""
    code = job_dir.parent / "code"
    shutil.copytree(JOBS, code, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    spec = fixture_job(job_dir, script, resources=Resources(instance_type=INSTANCE_TYPES[procs], **resources))
    env = {**spec.env, runtime.PARAMS_ENV: json.dumps({"args": list(args)})}
    return dataclasses.replace(spec, entrypoint=code / script, env=env)


def checkpoint_s3_uri(job: JobSpec) -> str | None:
    """Where the launcher said the job's checkpoints go (``submission.json``), None before submit."""
    record = read_submission(job.paths)
    return None if record is None else record.details["checkpoint_s3_uri"]


def latest_step_in_s3(s3: Any, uri: str, scratch: Path) -> int | None:
    """The latest whole checkpoint under ``uri``: downloaded, then checked as the runtime checks it."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    shutil.rmtree(scratch, ignore_errors=True)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for item in page.get("Contents", []):
            target = scratch / item["Key"][len(prefix) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, item["Key"], str(target))
    latest = runtime.latest_checkpoint(scratch)
    return None if latest is None else latest.step


class TestSageMakerContract(LauncherContract):
    """On a read-write FSx channel, as a pipeline runs: checkpoints, metrics and results on FSx."""

    standin: SageMakerStandIn

    @pytest.fixture
    def launcher(self, standin: SageMakerStandIn) -> Launcher:
        self.standin = standin
        root = standin.file_systems[FILE_SYSTEM]
        return SageMakerLauncher(sagemaker_spec(root), cancel_poll_s=0.05)

    def restart(self, launcher: Launcher) -> Launcher:
        assert isinstance(launcher, SageMakerLauncher)
        return SageMakerLauncher(launcher.spec, cancel_poll_s=launcher.cancel_poll_s)

    def kill_hard(self, handle: JobHandle) -> None:
        self.standin.crash(handle.job_id)

    def make_job(self, job_dir: Path, script: str, *args: str, procs: int = 1) -> JobSpec:
        return sagemaker_job(job_dir, script, *args, procs=procs)

    def jobs_named(self, launcher: Launcher, name: str) -> list[str]:
        return jobs_named(self.standin, name)


def jobs_named(standin: SageMakerStandIn, name: str) -> list[str]:
    """Every training job the stand-in holds under ``name`` or a name derived from it (``<name>-r2``,
    ``<name>-v1``): SageMaker never gives one name twice, so a second job for one submission would
    stand under a sibling name."""
    return sorted(job for job in standin.jobs if job == name or job.startswith(f"{name}-"))


# ---------------------------------------------------------------------------------- SageMaker only


def test_launcher_finds_the_endpoints_in_the_environment(standin: SageMakerStandIn, tmp_path: Path) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path))
    assert launcher.client.meta.endpoint_url == standin.endpoint_url
    launcher.attach("no-such-job", tmp_path / "nowhere").logs()
    assert standin.count("DescribeLogStreams") == 1  # the logs client found the stand-in too


def test_one_describe_per_job_per_cache_window_and_a_final_state_for_good(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path, poll_cache_s=3600), cancel_poll_s=0.05)
    handle = launcher.submit(sagemaker_job(tmp_path / "job", "succeed.py", str(tmp_path / "never")))
    attached = launcher.attach(handle.job_id, handle.job_dir)
    states: list[JobState] = []

    def poll() -> None:
        states.extend(h.state() for h in (handle, attached) for _ in range(3))

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(states) == 24 and not any(state.is_terminal for state in states)
    assert standin.count("DescribeTrainingJob", handle.job_id) == 1
    handle.cancel()  # asks afresh despite the hour-long cache, until the job has ended
    assert handle.state() is JobState.CANCELLED
    described = standin.count("DescribeTrainingJob", handle.job_id)
    assert described > 1
    assert attached.state() is JobState.CANCELLED
    assert "Stopped" in attached.describe()
    assert standin.count("DescribeTrainingJob", handle.job_id) == described


def test_one_refresh_describes_every_followed_job_once(standin: SageMakerStandIn, tmp_path: Path) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path, poll_cache_s=3600), cancel_poll_s=0.05)
    never = str(tmp_path / "never")
    handles = [launcher.submit(sagemaker_job(tmp_path / f"job{n}", "succeed.py", never)) for n in range(3)]
    assert not handles[0].state().is_terminal
    assert [standin.count("DescribeTrainingJob", handle.job_id) for handle in handles] == [1, 1, 1]
    assert not any(handle.state().is_terminal for handle in handles[1:])  # answered by that refresh
    assert standin.count("DescribeTrainingJob") == 3


def test_failed_script_shows_its_traceback_from_cloudwatch_and_its_exit_code(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    handle = launcher.submit(sagemaker_job(tmp_path / "job", "fail.py", "boom in the cloud"))
    assert finish(handle) is JobState.FAILED
    logs = handle.logs()
    # Lines only the job's output has (FailureReason carries the error line alone).
    assert "fixture job starting" in logs
    assert "Traceback (most recent call last):" in logs
    assert 'fail.py", line' in logs
    assert "FailureReason: AlgorithmError: ExecuteUserScriptError: ExitCode 1" in logs
    assert standin.count("GetLogEvents") >= 1
    assert "exit code 1" in handle.describe()
    assert "\n" not in handle.describe()
    short = handle.logs(tail=2).splitlines()
    assert len(short) == 4 and short[-1].startswith("Full logs: CloudWatch Logs group")
    not_started = launcher.attach("not-started", tmp_path / "other").logs()
    assert "no CloudWatch log streams for not-started yet" in not_started


def test_logs_before_any_stream_exists_say_so_instead_of_failing(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    logs = SageMakerLauncher(sagemaker_spec(tmp_path)).attach("early", tmp_path / "early").logs()
    assert "cannot read CloudWatch Logs for early: /aws/sagemaker/TrainingJobs does not exist yet" in logs
    assert "(SageMaker knows no training job early in this account and region; fix: " in logs
    assert logs.splitlines()[-1] == (
        "Full logs: CloudWatch Logs group /aws/sagemaker/TrainingJobs, streams early/algo-<n>-<timestamp>"
    )


def test_evaluation_job_finds_the_trials_checkpoints_on_fsx(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    trial = sagemaker_job(tmp_path / "jobs" / "trial-3", "count.py", "3", "99")  # 3 steps, no pause
    assert finish(launcher.submit(trial)) is JobState.SUCCEEDED
    assert runtime.latest_checkpoint(trial.paths.checkpoints) is not None  # where the orchestrator reads
    # An evaluation: another job, another job dir, handed the trial's checkpoint dir.
    evaluation = sagemaker_job(tmp_path / "jobs" / "eval-3", "count.py", "3", "99")
    env = {**evaluation.env, runtime.CHECKPOINT_DIR_ENV: str(trial.paths.checkpoints)}
    handle = launcher.submit(dataclasses.replace(evaluation, env=env))
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    result = runtime.read_result(evaluation.paths.result)
    assert result is not None
    assert result.metrics == {"resumed_from": 3, "count": 3}  # it started after the trial's last step


def test_without_a_writable_channel_checkpoints_sync_with_s3_and_a_resubmit_resumes(
    standin: SageMakerStandIn, moto: MotoServer, tmp_path: Path
) -> None:
    read_only = {"file_system_id": FILE_SYSTEM[0], "directory_path": FILE_SYSTEM[1], "access_mode": "ro"}
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path, fsx=read_only), cancel_poll_s=0.05)
    job = sagemaker_job(tmp_path / "jobs" / "trial-5", "count.py", "4", "1")  # pauses after step 1
    crashed = launcher.submit(job)
    uri = checkpoint_s3_uri(job)
    assert uri == f"s3://{BUCKET}/{tmp_path.name}/checkpoints/jobs/trial-5/checkpoints"
    s3 = moto.client("s3")
    wait_until(lambda: latest_step_in_s3(s3, uri, tmp_path / "s3") == 1, "checkpoint step 1 in S3")
    standin.crash(crashed.job_id)
    assert finish(crashed) is JobState.FAILED
    resumed = launcher.submit(job)  # a new training job, the same checkpoint prefix
    assert finish(resumed) is JobState.SUCCEEDED, resumed.logs()
    # Results stay in the job's own output folder (the orchestrator cannot see them in this mode).
    result = runtime.read_result(standin.jobs[resumed.job_id].dir / "output" / "data" / "result.json")
    assert result is not None
    assert result.metrics == {"resumed_from": 2, "count": 4}
    assert not job.paths.result.exists()


def test_max_runtime_exceeded_is_a_failure(standin: SageMakerStandIn, tmp_path: Path) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    job = sagemaker_job(tmp_path / "job", "hang.py", str(tmp_path / "pids"), timeout_min=1 / 60)
    handle = launcher.submit(job)  # MaxRuntimeInSeconds=1
    assert isinstance(handle, SageMakerJob)
    assert finish(handle) is JobState.FAILED
    assert handle.status().secondary_status == "MaxRuntimeExceeded"
    assert "Stopped (MaxRuntimeExceeded)" in handle.describe()
    assert not (job.job_dir / "cancelled").exists()


# ---------------------------------------------------------------------------------- exactly once


def test_resource_in_use_of_our_own_create_adopts_the_job(standin: SageMakerStandIn, tmp_path: Path) -> None:
    """botocore's retry of a create that timed out after SageMaker accepted it meets ResourceInUse on our
    own job (stand-in: the first CreateTrainingJob is carried out and its reply lost; botocore retries
    by itself, as against AWS). Exactly one training job exists, and submit returns it."""
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    release = tmp_path / "release"
    job = sagemaker_job(tmp_path / "job", "succeed.py", str(release))
    standin.lose_replies("CreateTrainingJob")
    handle = launcher.submit(job)
    assert standin.count("CreateTrainingJob") == 2  # the one whose reply was lost, and botocore's retry
    assert jobs_named(standin, "job") == [handle.job_id] == ["job"]
    record = read_submission(job.paths)
    assert record is not None and (record.job_id, record.attempt) == ("job", 1)
    assert standin.jobs["job"].request["Environment"][SUBMISSION_ID_ENV] == record.submission_id
    assert record.details["arn"] == standin.jobs["job"].arn
    release.touch()
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()


def test_a_submit_retried_after_a_lost_create_reply_and_a_failed_look_up_returns_that_job(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    """CreateTrainingJob took effect but its reply was lost, and the look-up that follows failed too
    (botocore's retries spent, as in an outage): submit fails transiently and leaves the intent. The
    caller's retry (the driver waits out transient errors) finds that attempt's job and returns it:
    one training job, followed to its end, rather than a refusal of a job dir "whose job has not
    ended", which failed the whole tune step."""
    no_retries = Config(retries={"total_max_attempts": 1})
    client = boto3.client("sagemaker", config=no_retries)
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), client, cancel_poll_s=0.05)
    release = tmp_path / "release"
    job = sagemaker_job(tmp_path / "job", "succeed.py", str(release))
    standin.lose_replies("CreateTrainingJob")
    standin.lose_replies("DescribeTrainingJob")
    with pytest.raises(TransientError, match="describe sagemaker training job job"):
        launcher.submit(job)
    intent = read_submission(job.paths)
    assert intent is not None and intent.is_intent and jobs_named(standin, "job") == ["job"]
    handle = launcher.submit(job)
    assert handle.job_id == "job" and jobs_named(standin, "job") == ["job"]
    record = read_submission(job.paths)
    assert record is not None and (record.job_id, record.attempt) == ("job", 1)
    assert record.submission_id == intent.submission_id
    release.touch()
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()


def test_a_name_taken_by_another_submission_moves_to_the_next_variant(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    """A study deleted and made again under the same name: its job dir starts over at attempt 1, while
    SageMaker keeps the old study's training job under that name for good. The new job takes the next
    variant of the name; the old study's job is left alone, never adopted."""
    job = sagemaker_job(tmp_path / "job", "succeed.py")
    old = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05).submit(job)
    assert finish(old) is JobState.SUCCEEDED, old.logs()
    old_record = read_submission(job.paths)
    shutil.rmtree(job.job_dir)  # the study is deleted, then made again by a new orchestrator

    again = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05).submit(job)
    record = read_submission(job.paths)
    assert record is not None and old_record is not None
    assert (again.job_id, record.job_id, record.name, record.attempt) == ("job-v1", "job-v1", "job-v1", 1)
    assert record.submission_id != old_record.submission_id
    assert jobs_named(standin, "job") == ["job", "job-v1"]
    assert standin.jobs["job-v1"].request["Environment"][SUBMISSION_ID_ENV] == record.submission_id
    assert finish(again) is JobState.SUCCEEDED, again.logs()
    assert standin.jobs["job"].status == "Completed"


def test_crash_between_create_and_record_is_found_by_recorded(
    standin: SageMakerStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator dies right after SageMaker took the job, before its id reached submission.json
    (stand-in for the crash: writing the completed record raises). Only the intent is left: a restarted
    launcher's recorded() finds the job by name and submission id, and a new submit is refused while
    it runs, so the job dir never gets a second training job."""
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    release = tmp_path / "release"
    job = sagemaker_job(tmp_path / "job", "succeed.py", str(release))
    write_submission = base.write_submission

    def die_before_the_job_id_is_written(paths: JobPaths, record: Submission) -> None:
        if record.job_id is not None:
            raise KeyboardInterrupt("orchestrator killed between create and record")
        write_submission(paths, record)

    with monkeypatch.context() as patch:
        patch.setattr(base, "write_submission", die_before_the_job_id_is_written)
        with pytest.raises(KeyboardInterrupt):
            launcher.submit(job)
    intent = read_submission(job.paths)
    assert intent is not None and intent.is_intent and intent.name == "job"

    restarted = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    found = restarted.recorded(job.job_dir)
    assert isinstance(found, SageMakerJob) and found.job_id == "job"
    assert found.arn == standin.jobs["job"].arn
    record = read_submission(job.paths)
    assert record is not None and (record.job_id, record.submission_id) == ("job", intent.submission_id)
    with pytest.raises(JobError, match="has not ended"):
        restarted.submit(job)
    assert jobs_named(standin, "job") == ["job"]
    release.touch()
    assert finish(found) is JobState.SUCCEEDED, found.logs()


# ---------------------------------------------------------------------------------- several instances


def two_instance_job(job_dir: Path, script: str, *args: str) -> JobSpec:
    """A job on 2 CPU instances (one process each) running the fixture ``script``."""
    return sagemaker_job(job_dir, script, *args, num_nodes=2)


def stream_sections(logs: str) -> dict[str, str]:
    """``logs()`` of a several-instance job, by host (``algo-1``), in the order it shows them."""
    parts = re.split(r"^==> \S+/(algo-\d+)-\d+ <==$", logs, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_a_two_instance_job_forms_one_process_group(standin: SageMakerStandIn, tmp_path: Path) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    job = two_instance_job(tmp_path / "job", "all_reduce.py")
    handle = launcher.submit(job)
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    result = runtime.read_result(job.paths.result)
    assert result is not None
    assert result.metrics == {"world_size": 2.0, "rank_sum": 3.0}  # ranks 0 and 1 reduced together
    sections = stream_sections(handle.logs())
    assert list(sections) == ["algo-1", "algo-2"]
    # The toolkit's node rank is the host's index in SM_HOSTS.
    assert "rank 0/2 on algo-1: sum 3" in sections["algo-1"]
    assert "rank 1/2 on algo-2: sum 3" in sections["algo-2"]


def test_one_failing_instance_fails_the_job_and_the_other_is_stopped(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    launcher = SageMakerLauncher(sagemaker_spec(tmp_path), cancel_poll_s=0.05)
    pid_dir = tmp_path / "pids"
    handle = launcher.submit(two_instance_job(tmp_path / "job", "rank_1_fails.py", str(pid_dir)))
    assert finish(handle) is JobState.FAILED
    # torchrun exits 1 when a worker fails; the FailureReason is algo-2's (node rank 1).
    described = handle.describe()
    assert "Failed (exit code 1; Failed: AlgorithmError: ExecuteUserScriptError: ExitCode 1" in described
    assert "--node_rank 1 rank_1_fails.py" in described
    sections = stream_sections(handle.logs())
    assert "rank 1 fails on purpose" in sections["algo-2"]
    assert recorded_pids(pid_dir)
    assert [pid for pid in recorded_pids(pid_dir) if is_alive(pid)] == []


def test_render_is_the_create_training_job_request_sagemaker_received(
    standin: SageMakerStandIn, tmp_path: Path
) -> None:
    """``tunepod render``'s request for a trial is the CreateTrainingJob request the service got (but
    for the submission id, drawn anew by each submit), shown as the JSON ``--cli-input-json`` takes."""
    code = tmp_path / "code"
    shutil.copytree(QUADRATIC.parent, code)
    block = sagemaker_spec(tmp_path, instance_type=INSTANCE_TYPES[1]).model_dump(
        mode="json", exclude_unset=True
    )
    preview, launcher = preview_first_trial(tmp_path, block, SageMakerLauncher, trainer=code / QUADRATIC.name)
    handle = launcher.submit(preview.job)
    handle.cancel()
    record = read_submission(preview.job.paths)
    assert record is not None
    received = standin.jobs[handle.job_id].request
    assert received == json.loads(
        as_submitted(json.dumps(preview.rendered.payload), preview, record.submission_id)
    )
    shown = preview.text()
    assert json.loads(shown[shown.index("{") :]) == preview.rendered.payload
