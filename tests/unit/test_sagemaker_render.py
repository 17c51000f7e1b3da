"""``render_training_job`` against stored requests in ``tests/unit/golden`` and against botocore's
model of CreateTrainingJob (Stubber validates every parameter's name, type and required fields), plus
the pure helpers: job names, path rewriting, what is refused, and the state table.

Regenerate the stored requests after an intended change with
``TUNEPOD_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_sagemaker_render.py`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from pydantic import ValidationError

from tunepod.errors import SpecError, TunepodError
from tunepod.launch.base import SUBMISSION_ID_ENV, JobSpec, JobState, Resources
from tunepod.launch.contract import contract_env
from tunepod.launch.factory import make_launcher
from tunepod.launch.paths import JobPaths
from tunepod.launch.sagemaker import (
    NOT_FOUND,
    TrainingJobStatus,
    checkpoint_s3_uri,
    exit_code_of,
    map_training_job_state,
    render_training_job,
    training_job_name,
)
from tunepod.preview import preview_trials
from tunepod.runtime import Parallelism
from tunepod.spec.loader import load_spec
from tunepod.spec.models import PipelineSpec, SageMakerLauncherSpec

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
UPDATE = os.environ.get("TUNEPOD_UPDATE_GOLDEN") == "1"
JOB_DIR = Path("/fsx/tunepod/jobs/digits/trial-7")
SUBMISSION_ID = "0123456789abcdef"


def assert_matches_golden(name: str, request: dict[str, Any]) -> None:
    path = GOLDEN / f"{name}.training-job.json"
    text = json.dumps(request, indent=2, sort_keys=True) + "\n"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} is missing; create it with TUNEPOD_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{path} differs; if intended, regenerate with TUNEPOD_UPDATE_GOLDEN=1"


def assert_valid_request(request: dict[str, Any]) -> None:
    """botocore checks ``request`` against the real CreateTrainingJob model (no network)."""
    client = boto3.client(
        "sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stub:
        stub.add_response("create_training_job", {"TrainingJobArn": "arn:x"}, expected_params=request)
        client.create_training_job(**request)
        stub.assert_no_pending_responses()


def spec(**fields: object) -> SageMakerLauncherSpec:
    base = {
        "kind": "sagemaker",
        "root": "/fsx/tunepod",
        "role_arn": "arn:aws:iam::123456789012:role/tunepod-training",
        "image_uri": "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.5.1-gpu-py311",
        "output_s3_uri": "s3://tunepod-bucket/output",
        "checkpoint_s3_uri": "s3://tunepod-bucket/checkpoints/",
        "instance_type": "ml.g5.xlarge",
    }
    return SageMakerLauncherSpec.model_validate({**base, **fields})


FSX = {
    "fsx": {"file_system_id": "fs-0123456789abcdef0", "directory_path": "/abcdefgh/tunepod"},
    "subnets": ["subnet-0a1b2c3d"],
    "security_group_ids": ["sg-0a1b2c3d"],
}
FSX_READ_ONLY = {**FSX, "fsx": {**FSX["fsx"], "access_mode": "ro"}}


def job(
    params: dict[str, object] | None = None, parallelism: Parallelism | None = None, **fields: Any
) -> JobSpec:
    paths = JobPaths(JOB_DIR)
    env = contract_env(
        paths,
        params=params or {"lr": 0.01, "hidden": 64, "optimizer": "adam"},
        data_dir="/fsx/tunepod/datasets/digits",
        trial="7",
        tracking_uri="http://mlflow.internal:5000",
        run_id="abc123",
        parallelism=parallelism,
    )
    env[SUBMISSION_ID_ENV] = SUBMISSION_ID  # as the launcher template hands every job over
    base = JobSpec(
        name="digits-trial-7", entrypoint=Path("/fsx/tunepod/code/train.py"), job_dir=JOB_DIR, env=env
    )
    return dataclasses.replace(base, **fields)


def test_minimal_request_with_code_in_s3() -> None:
    request = render_training_job(job(), spec(code_uri="s3://tunepod-bucket/code/sourcedir.tar.gz"))
    assert_matches_golden("minimal", request)
    assert_valid_request(request)
    # Without FSx the orchestrator's paths mean nothing in the job: the runtime's SageMaker defaults rule.
    assert "TUNEPOD_DATA_DIR" not in request["Environment"]
    assert "TUNEPOD_PARAMS" not in request["Environment"]
    # DescribeTrainingJob returns it: how the launcher tells its own job from another submission's.
    assert request["Environment"][SUBMISSION_ID_ENV] == SUBMISSION_ID


def test_full_request_on_fsx_with_tensor_parallelism() -> None:
    resources = Resources(num_nodes=2, gpus_per_node=8, instance_type="ml.p4d.24xlarge", timeout_min=90.5)
    full = spec(max_retry_attempts=3, env={"NCCL_DEBUG": "WARN"}, **FSX)
    layout = Parallelism(data=4, tensor=4)
    request = render_training_job(job(parallelism=layout, resources=resources), full, attempt=2)
    assert_matches_golden("full_fsx", request)
    assert_valid_request(request)
    env, hps = request["Environment"], request["HyperParameters"]
    assert env["TUNEPOD_DATA_DIR"] == "/opt/ml/input/data/train/datasets/digits"
    assert env["TUNEPOD_RESULT_FILE"] == "/opt/ml/input/data/train/jobs/digits/trial-7/result.json"
    # A read-write FSx channel keeps checkpoints in the trial's folder, where the orchestrator reads them.
    assert env["TUNEPOD_CHECKPOINT_DIR"] == "/opt/ml/input/data/train/jobs/digits/trial-7/checkpoints"
    assert "CheckpointConfig" not in request
    assert json.loads(hps["mp_parameters"]) == {"tensor_parallel_degree": 4}
    # The runtime reads the layout itself (ctx.parallelism, ctx.device_mesh()).
    assert Parallelism(**json.loads(env["TUNEPOD_PARALLELISM"])) == layout
    assert hps["sagemaker_submit_directory"] == '"/opt/ml/input/data/train/code"'
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 5430}
    assert request["TrainingJobName"] == "digits-trial-7-r2"


def test_a_read_only_channel_syncs_checkpoints_with_s3_and_leaves_results_to_sagemaker() -> None:
    request = render_training_job(job(), spec(**FSX_READ_ONLY), attempt=2)
    assert_valid_request(request)
    env = request["Environment"]
    assert env["TUNEPOD_DATA_DIR"] == "/opt/ml/input/data/train/datasets/digits"
    assert env["TUNEPOD_CHECKPOINT_DIR"] == "/opt/ml/checkpoints"
    # The job could not write them on the channel: the runtime falls back to /opt/ml/output/data.
    assert "TUNEPOD_RESULT_FILE" not in env and "TUNEPOD_METRICS_FILE" not in env
    # The checkpoint prefix follows the checkpoint dir, not the attempt, so a resubmission resumes.
    expected = "s3://tunepod-bucket/checkpoints/jobs/digits/trial-7/checkpoints"
    assert request["CheckpointConfig"] == {"S3Uri": expected, "LocalPath": "/opt/ml/checkpoints"}


def test_without_a_writable_channel_the_checkpoint_prefix_is_required_and_named() -> None:
    with pytest.raises(ValidationError, match=r"checkpoints sync with S3; fix: set checkpoint_s3_uri"):
        spec(checkpoint_s3_uri=None, **FSX_READ_ONLY)


def test_a_read_write_channel_needs_no_checkpoint_prefix() -> None:
    launcher = spec(checkpoint_s3_uri=None, **FSX)
    assert "CheckpointConfig" not in render_training_job(job(), launcher)


def test_jobs_handed_one_checkpoint_dir_share_one_checkpoint_prefix() -> None:
    trial = job()
    evaluation_dir = Path("/fsx/tunepod/jobs/check/trial-7")
    evaluation_env = contract_env(
        JobPaths(evaluation_dir), params={}, data_dir="/x", trial="e", checkpoint_dir=JOB_DIR / "checkpoints"
    )
    evaluation = job(name="digits-check-trial-7", job_dir=evaluation_dir, env=evaluation_env)
    shared = "s3://tunepod-bucket/checkpoints/jobs/digits/trial-7/checkpoints"
    uris = {
        render_training_job(trial, spec(**FSX_READ_ONLY))["CheckpointConfig"]["S3Uri"],
        render_training_job(trial, spec(**FSX_READ_ONLY), attempt=3)["CheckpointConfig"]["S3Uri"],
        render_training_job(evaluation, spec(**FSX_READ_ONLY))["CheckpointConfig"]["S3Uri"],
        checkpoint_s3_uri(evaluation, spec(**FSX_READ_ONLY)),
    }
    assert uris == {shared}
    # Without the contract's variable, the job's own checkpoints folder is the key.
    bare = job(env={"TUNEPOD_PARAMS": "{}"})
    assert checkpoint_s3_uri(bare, spec()) == shared


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (
            'AlgorithmError: ExecuteUserScriptError:\nExitCode 1\nErrorMessage "ValueError: boom"\n'
            'Command "/opt/conda/bin/python3.11 -m torch.distributed.run train.py", exit code: 1',
            1,
        ),
        ("AlgorithmError: ExecuteUserScriptError: exit code: 137", 137),
        ("InternalServerError: We encountered an internal error.  Please try again.", None),
        ("", None),
    ],
)
def test_exit_code_is_read_from_the_failure_reason(reason: str, code: int | None) -> None:
    status = TrainingJobStatus("Failed", "Failed", reason)
    assert exit_code_of(reason) == code
    described = status.describe("trial-7")
    assert "\n" not in described
    assert ("exit code" in described) is (code is not None)
    if code is not None:
        assert described.startswith(f"sagemaker training job trial-7 Failed (exit code {code}; Failed: ")


def test_hyperparameters_are_json_strings_that_decode_to_the_params() -> None:
    params = {"lr": 0.001, "hidden": 128, "optimizer": "sgd", "nesterov": True}
    hps = render_training_job(job(params), spec(**FSX))["HyperParameters"]
    assert all(isinstance(value, str) for value in hps.values())
    assert {name: json.loads(hps[name]) for name in params} == params
    assert json.loads(hps["sagemaker_torch_distributed_enabled"]) is True
    assert json.loads(hps["sagemaker_program"]) == "train.py"


NAME_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


@pytest.mark.parametrize(
    "name",
    ["digits-trial-7", "study_a.trial 3", "x" * 200, "--weird--", "__", "a" * 62 + "_b"],
)
@pytest.mark.parametrize("attempt", [1, 2, 130])
def test_job_names_follow_sagemaker_rules_and_are_stable(name: str, attempt: int) -> None:
    rendered = training_job_name(name, attempt)
    assert NAME_PATTERN.match(rendered), rendered
    assert rendered == training_job_name(name, attempt)
    assert rendered != training_job_name(name, attempt + 1)


@pytest.mark.parametrize("name", ["digits-trial-7", "x" * 200, "study_a.trial 3"])
def test_name_variants_are_valid_and_distinct_from_every_attempt(name: str) -> None:
    names = {training_job_name(name, attempt, variant) for attempt in (1, 2, 3) for variant in range(6)}
    assert len(names) == 18
    assert all(NAME_PATTERN.match(rendered) for rendered in names), names
    assert training_job_name("digits-trial-7", 2, 1) == "digits-trial-7-r2-v1"
    request = render_training_job(job(), spec(**FSX), attempt=1, variant=3)
    assert request["TrainingJobName"] == "digits-trial-7-v3"


def test_names_that_clean_to_the_same_text_stay_distinct() -> None:
    assert training_job_name("a_b") != training_job_name("a.b")
    assert training_job_name("x" * 100 + "1") != training_job_name("x" * 100 + "2")
    assert training_job_name("plain-name-1") == "plain-name-1"


@pytest.mark.parametrize(
    ("make_job", "launcher", "fragment"),
    [
        (lambda: job(args=("--epochs", "3")), spec(**FSX), "pass them as parameters"),
        (lambda: job({"sagemaker_program": "x"}), spec(**FSX), "reserved"),
        (lambda: job(), spec(instance_type=None, **FSX), "instance type"),
        (lambda: job(), spec(), "not visible to SageMaker jobs"),
        (lambda: job(entrypoint=Path("/home/me/train.py")), spec(**FSX), "under root /fsx/tunepod"),
        (
            lambda: job(env={"TUNEPOD_CHECKPOINT_DIR": "/scratch/ckpt"}),
            spec(code_uri="s3://b/code.tar.gz"),
            "outside root /fsx/tunepod",
        ),
        (
            lambda: job(env={"TUNEPOD_CHECKPOINT_DIR": "/scratch/ckpt"}),
            spec(**FSX),
            "checkpoint dir /scratch/ckpt is not visible to SageMaker jobs",
        ),
        (
            # The spec checked 2 x 16 procs_per_node, but the container starts one process per GPU.
            lambda: job(
                parallelism=Parallelism(data=8, tensor=4),
                resources=Resources(num_nodes=2, procs_per_node=16, gpus_per_node=8),
            ),
            spec(**FSX),
            "data 8 x tensor 4 x pipeline 1 = 32 processes, but the job runs 16",
        ),
    ],
)
def test_what_a_training_job_cannot_express_is_refused(
    make_job: Any, launcher: SageMakerLauncherSpec, fragment: str
) -> None:
    with pytest.raises(TunepodError, match="fix:") as caught:
        render_training_job(make_job(), launcher)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"fsx": FSX["fsx"]},  # FSx without a VPC
        {"subnets": ["subnet-1"]},  # half a VpcConfig
        {"checkpoint_s3_uri": None},  # checkpoints would sync with S3, but to where?
        {"checkpoint_s3_uri": None, **FSX_READ_ONLY},
        {"role_arn": "tunepod-training"},
        {"unknown": 1},
    ],
)
def test_spec_rejects_inconsistent_settings(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        spec(**fields)


@pytest.mark.parametrize(
    ("status", "secondary", "expected"),
    [
        ("InProgress", "Starting", JobState.PENDING),
        ("InProgress", "LaunchingMLInstances", JobState.PENDING),
        ("InProgress", "PreparingTrainingStack", JobState.PENDING),
        ("InProgress", "Downloading", JobState.PENDING),
        ("InProgress", "DownloadingTrainingImage", JobState.PENDING),
        ("InProgress", "Interrupted", JobState.PENDING),
        ("InProgress", "Restarting", JobState.PENDING),
        ("InProgress", "Training", JobState.RUNNING),
        ("InProgress", "Uploading", JobState.RUNNING),
        ("InProgress", "SomethingNew", JobState.RUNNING),
        ("Stopping", "Stopping", JobState.RUNNING),
        ("Completed", "Completed", JobState.SUCCEEDED),
        ("Failed", "Failed", JobState.FAILED),
        ("Stopped", "Stopped", JobState.CANCELLED),
        ("Stopped", "MaxRuntimeExceeded", JobState.FAILED),
        ("Stopped", "MaxWaitTimeExceeded", JobState.FAILED),
        ("Brand-new", "", JobState.RUNNING),
        (NOT_FOUND, "", JobState.FAILED),
    ],
)
def test_state_table(status: str, secondary: str, expected: JobState) -> None:
    assert map_training_job_state(status, secondary) is expected


@pytest.mark.parametrize(
    ("secondaries", "expected"),
    [
        # The script exited 0 (Uploading: "training is complete"); the stop cut the upload short.
        (("Starting", "Downloading", "Training", "Uploading", "Stopping", "Stopped"), JobState.SUCCEEDED),
        # Stopped while training; the SIGTERM'd script's output was uploaded after.
        (("Starting", "Downloading", "Training", "Stopping", "Uploading", "Stopped"), JobState.CANCELLED),
        (("Starting", "Downloading", "Training", "Stopping", "Stopped"), JobState.CANCELLED),
        (("Starting", "Stopping", "Stopped"), JobState.CANCELLED),
    ],
)
def test_a_job_stopped_after_its_training_completed_succeeded(
    secondaries: tuple[str, ...], expected: JobState
) -> None:
    described = {
        "TrainingJobStatus": "Stopped",
        "SecondaryStatus": "Stopped",
        "SecondaryStatusTransitions": [{"Status": status} for status in secondaries],
    }
    assert TrainingJobStatus.from_describe(described).job_state is expected


def test_the_stubber_check_can_fail() -> None:
    from botocore.exceptions import ParamValidationError

    request = render_training_job(job(), spec(**FSX))
    request["ResourceConfig"]["InstanceCount"] = "2"  # a string where the model wants an integer
    with pytest.raises(ParamValidationError):
        assert_valid_request(request)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (None, None),  # no layout: plain data parallelism, SMP off
        (Parallelism(data=16), None),
        # Pipeline stages are the script's (torch.distributed.pipelining), not a refusal.
        (Parallelism(data=4, tensor=2, pipeline=2), {"tensor_parallel_degree": 2}),
        (
            Parallelism(data=8, tensor=2, sharding="hybrid", shard=4),
            {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4},
        ),
        (Parallelism(data=16, sharding="hybrid", shard=8), {"hybrid_shard_degree": 8}),
    ],
)
def test_the_job_layout_renders_smp_v2_parameters(
    layout: Parallelism | None, expected: dict[str, int] | None
) -> None:
    resources = Resources(num_nodes=2, procs_per_node=8, gpus_per_node=8, instance_type="ml.p4d.24xlarge")
    hps = render_training_job(job(parallelism=layout, resources=resources), spec(**FSX))["HyperParameters"]
    rendered = json.loads(hps["mp_parameters"]) if "mp_parameters" in hps else None
    assert rendered == expected


def test_the_launcher_level_parallelism_is_refused_with_where_it_moved() -> None:
    with pytest.raises(
        ValidationError, match=r"parallelism moved from the sagemaker launcher to the train job"
    ):
        spec(parallelism={"tensor": 4}, **FSX)


# ---------------------------------------------------------------------------------------- SMP v2's image

P4D = Resources(num_nodes=1, procs_per_node=8, gpus_per_node=8, instance_type="ml.p4d.24xlarge")
SMP_IMAGE = "smdistributed-modelparallel:2.5.1-gpu-py311-cu124"


def test_a_job_under_smp_v2_runs_on_the_smp_image_of_its_framework_version() -> None:
    """The SDK's lookup for an estimator with SMP on (``pytorch-smp``, its CUDA build); a job without
    SMP's settings keeps the plain PyTorch image of the same version."""
    looked_up = spec(image_uri=None, framework_version="2.5.1", region="us-west-2", **FSX)
    tensor = render_training_job(job(parallelism=Parallelism(data=4, tensor=2), resources=P4D), looked_up)
    image = tensor["AlgorithmSpecification"]["TrainingImage"]
    assert (
        image
        == "658645717510.dkr.ecr.us-west-2.amazonaws.com/smdistributed-modelparallel:2.5.1-gpu-py311-cu124"
    )
    hybrid = Parallelism(data=16, sharding="hybrid", shard=8)
    two_nodes = P4D.model_copy(update={"num_nodes": 2})
    sharded = render_training_job(job(parallelism=hybrid, resources=two_nodes), looked_up)
    assert json.loads(sharded["HyperParameters"]["mp_parameters"]) == {"hybrid_shard_degree": 8}
    assert sharded["AlgorithmSpecification"]["TrainingImage"] == image
    plain = render_training_job(job(parallelism=Parallelism(data=8), resources=P4D), looked_up)
    assert plain["AlgorithmSpecification"]["TrainingImage"] == (
        "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.5.1-gpu-py311"
    )
    assert_valid_request(tensor)


def test_smp_v2_on_a_cpu_instance_or_a_version_without_an_smp_image_is_refused_with_the_fix() -> None:
    looked_up = spec(image_uri=None, framework_version="2.5.1", region="us-west-2")
    cpu = Resources(num_nodes=1, procs_per_node=4, instance_type="ml.m5.4xlarge")
    with pytest.raises(
        TunepodError, match=r"SMP v2, whose images are GPU only, and ml.m5.4xlarge has no GPU"
    ):
        render_training_job(job(parallelism=Parallelism(data=2, tensor=2), resources=cpu), looked_up)
    older = spec(image_uri=None, framework_version="1.13.1", region="us-west-2")
    with pytest.raises(
        TunepodError,
        match=r"no SMP v2 image for PyTorch 1.13.1 .*fix: set framework_version to one of .*2\.5\.1",
    ):
        render_training_job(job(parallelism=Parallelism(data=4, tensor=2), resources=P4D), older)


def tiny_llm_tp(*overrides: str) -> PipelineSpec:
    return load_spec(
        REPO / "examples/tiny_llm/pipeline-sagemaker-tp.yaml", [f"launcher.root={REPO.parent}", *overrides]
    )


def test_the_tiny_llm_tensor_parallel_spec_renders_the_smp_image() -> None:
    spec_ = tiny_llm_tp()
    [preview] = preview_trials(spec_, make_launcher(spec_.launcher, connect=False))
    request = preview.rendered.payload
    assert (
        "/smdistributed-modelparallel:2.5.1-gpu-py311-cu124"
        in request["AlgorithmSpecification"]["TrainingImage"]
    )
    assert json.loads(request["HyperParameters"]["mp_parameters"]) == {"tensor_parallel_degree": 2}


@pytest.mark.parametrize(
    "image",
    [
        "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.5.1-gpu-py311-cu124-ubuntu22.04-sagemaker",
        "763104351884.dkr.ecr.us-west-2.amazonaws.com/huggingface-pytorch-training:2.1.0-transformers4.36.0-gpu-py310-cu121-ubuntu20.04",
    ],
)
def test_sagemakers_plain_pytorch_image_is_refused_for_jobs_under_smp_v2(image: str) -> None:
    with pytest.raises(SpecError) as raised:
        tiny_llm_tp("launcher.framework_version=null", f"launcher.image_uri={image}")
    shown = str(raised.value)
    assert f"launcher.image_uri {image} is SageMaker's plain PyTorch image, which has no SMP v2" in shown
    assert "step(s) search use tensor parallelism or hybrid sharding" in shown
    assert "fix: leave image_uri out and set framework_version" in shown


def rendered_request(spec_: PipelineSpec) -> dict[str, Any]:
    """The CreateTrainingJob request of the spec's first trial, as ``tunepod render`` shows it."""
    [preview] = preview_trials(spec_, make_launcher(spec_.launcher, connect=False))
    request: dict[str, Any] = preview.rendered.payload
    return request


def test_an_smp_or_own_image_or_a_job_without_smp_keeps_its_explicit_image() -> None:
    """The spec accepts each image, and the rendered request runs exactly that image: an explicit
    ``image_uri`` is never replaced by the SMP lookup, for a job under SMP v2 or one without it."""
    smp = "658645717510.dkr.ecr.us-west-2.amazonaws.com/smdistributed-modelparallel:2.5.1-gpu-py311-cu124"
    own = "123456789012.dkr.ecr.us-west-2.amazonaws.com/team/llm-train:7"
    for image in (smp, own):
        request = rendered_request(
            tiny_llm_tp("launcher.framework_version=null", f"launcher.image_uri={image}")
        )
        assert request["AlgorithmSpecification"]["TrainingImage"] == image
        # Still a job under SMP v2: the image is kept although the job needs SMP's.
        assert json.loads(request["HyperParameters"]["mp_parameters"]) == {"tensor_parallel_degree": 2}
    plain = "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.5.1-gpu-py311"
    without_smp = load_spec(
        REPO / "examples/tiny_llm/pipeline-sagemaker.yaml",
        [f"launcher.root={REPO.parent}", f"launcher.image_uri={plain}"],
    )
    request = rendered_request(without_smp)
    assert request["AlgorithmSpecification"]["TrainingImage"] == plain
    assert "mp_parameters" not in request["HyperParameters"]
