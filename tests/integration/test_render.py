"""``tunepod render``: what a trial would send, sent nowhere, and the same as what a run sends.

Here, the local launcher end to end (``tunepod render`` then ``tunepod run`` of the same spec: the
command line and the environment the trial's process really got), and the command's errors. Each
remote launcher's rendering is compared with what its backend received in that launcher's tests
(``test_slurm_launcher``: the batch script slurmctld stored; ``test_hyperpod_eks_launcher``: the
object the API server stored; ``test_sagemaker_contract``: the CreateTrainingJob request).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_study import REPO, write_tiny_study

from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.preview import RUN_ID_PLACEHOLDER

ENV_ECHO = REPO / "tests" / "fixtures" / "trainers" / "env_echo.py"
SECRET = "rEnder-s3cret"


def tunepod(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "COLUMNS": "200", "TUNEPOD_RUNNER": "off", **env}
    return subprocess.run(
        [sys.executable, "-m", "tunepod.cli", *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def exports_and_command(rendered: str) -> tuple[dict[str, str], list[str]]:
    """The local rendering read back: its ``export`` lines, and its command line (the lines after)."""
    env, command = {}, []
    lines = [line for line in rendered.splitlines() if not line.startswith("#")]
    exports = [line for line in lines if line.startswith("export ")]
    for line in exports:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0] if value else ""
    command = shlex.split("\n".join(lines[len(exports) :]))
    return env, command


@pytest.mark.slow
def test_render_shows_the_command_and_environment_tunepod_run_gives_the_first_trial(
    prefect_api: None, tmp_path: Path
) -> None:
    spec, jobs, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, trainer=ENV_ECHO)
    rendered = tunepod("render", str(spec))
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.startswith(
        f"# step search: trial 0 of study tiny, launcher local, job dir {jobs}/trial-0"
    )
    shown_env, shown_command = exports_and_command(rendered.stdout)

    from prefect.settings import PREFECT_API_URL

    ran = tunepod(
        "run", str(spec), "--home", str(tmp_path / "no-stack"), PREFECT_API_URL=str(PREFECT_API_URL.value())
    )
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    record = read_submission(JobPaths(jobs / "trial-0"))
    assert record is not None and record.attempt == 1
    given = json.loads((jobs / "trial-0" / "env.json").read_text())

    def as_run(value: str) -> str:
        shown_id = shown_env["TUNEPOD_SUBMISSION_ID"]
        return value.replace(shown_id, record.submission_id).replace(
            RUN_ID_PLACEHOLDER, given["MLFLOW_RUN_ID"]
        )

    assert {key: as_run(value) for key, value in shown_env.items()} == {key: given[key] for key in shown_env}
    assert [as_run(arg) for arg in shown_command] == record.details["argv"]
    assert json.loads(shown_env["TUNEPOD_PARAMS"])["x"] == json.loads(given["TUNEPOD_PARAMS"])["x"]


def test_render_hides_store_passwords(tmp_path: Path) -> None:
    spec, _, _ = write_tiny_study(tmp_path, f"postgresql://tunepod:{SECRET}@db.example:5432/mlflow", 1)
    rendered = tunepod("render", str(spec))
    assert rendered.returncode == 0, rendered.stderr
    assert "MLFLOW_TRACKING_URI=postgresql://tunepod:***@db.example:5432/mlflow" in rendered.stdout
    assert SECRET not in rendered.stdout + rendered.stderr


def test_render_of_a_step_that_is_no_tune_step_names_the_tune_steps(tmp_path: Path) -> None:
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1)
    rendered = tunepod("render", str(spec), "--step", "data")
    assert rendered.returncode == 2
    assert "--step 'data' is not a tune step of pipeline tiny; fix: name one of search" in rendered.stderr
    assert rendered.stdout == ""


def test_render_for_hyperpod_eks_reads_no_kubeconfig_and_refuses_what_a_run_would(tmp_path: Path) -> None:
    """A platform team reviews the manifest on a machine without the cluster's kubeconfig; the code must
    be under the claim's mount, as a run would say at its first submit."""
    code = tmp_path / "shared" / "code"
    code.mkdir(parents=True)
    (code / "env_echo.py").write_text(ENV_ECHO.read_text())
    image = "123456789012.dkr.ecr.us-west-2.amazonaws.com/train:1"
    eks = {"kind": "hyperpod_eks", "image": image, "claim_name": "fsx-claim"}
    spec, _, _ = write_tiny_study(
        tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, launcher=eks, trainer=code / "env_echo.py"
    )
    nowhere = {"KUBECONFIG": str(tmp_path / "no-kubeconfig"), "KUBERNETES_SERVICE_HOST": ""}
    rendered = tunepod("render", str(spec), **nowhere)
    assert rendered.returncode == 0, rendered.stderr
    assert "kind: HyperPodPyTorchJob" in rendered.stdout
    assert f"- {code / 'env_echo.py'}" in rendered.stdout

    outside, _, _ = write_tiny_study(
        tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, launcher=eks, trainer=ENV_ECHO
    )
    refused = tunepod("render", str(outside), **nowhere)
    assert refused.returncode == 2
    assert "kind: HyperPodPyTorchJob" in refused.stdout, "a dry run shows the manifest it refuses"
    assert f"- {ENV_ECHO}" in refused.stdout
    assert refused.stderr.startswith("tunepod run would refuse this (1 problem):\n- step search: ")
    assert f"entrypoint {ENV_ECHO} of job 'tiny-trial-0' is outside the launcher root" in refused.stderr


NO_AWS = {
    "HOME": "/nonexistent-home",
    "AWS_CONFIG_FILE": "/nonexistent-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent-aws-credentials",
    "AWS_REGION": "",
    "AWS_DEFAULT_REGION": "",
}
NO_CLUSTER = {"KUBECONFIG": "/nonexistent-kubeconfig", "KUBERNETES_SERVICE_HOST": ""}


def without_configuration() -> dict[str, str]:
    """The environment of a machine with no AWS and no cluster configuration: ``tunepod`` below merges
    it over os.environ, so the AWS variables are emptied (boto3 reads an empty one as unset)."""
    return {**NO_AWS, **NO_CLUSTER}


@pytest.mark.parametrize("example", sorted(str(p.relative_to(REPO)) for p in REPO.glob("examples/*/*.yaml")))
def test_every_shipped_example_renders_its_submission_without_aws_or_cluster_configuration(
    example: str,
) -> None:
    """From a checkout anywhere: the payload always shows; the examples meant to run from a checkout on
    FSx list that as the problem a run would refuse, with exit 2, and never a traceback."""
    rendered = tunepod("render", example, **without_configuration())
    assert rendered.stdout.startswith("# step "), rendered.stderr
    assert "Traceback" not in rendered.stdout + rendered.stderr
    if rendered.returncode != 0:
        assert rendered.returncode == 2
        assert rendered.stderr.startswith("tunepod run would refuse this ("), rendered.stderr
        assert "launcher root /fsx/tunepod" in rendered.stderr or "under root /fsx/tunepod" in rendered.stderr


CREDENTIALS = {
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY",
    "HF_TOKEN": "hf_rEnderTokenValue",
    "WANDB_API_KEY": "wandb-'quoted\"key",
}
SAGEMAKER_BLOCK = {
    "kind": "sagemaker",
    "role_arn": "arn:aws:iam::123456789012:role/tunepod",
    "output_s3_uri": "s3://bucket/out/",
    "instance_type": "ml.m5.xlarge",
    "image_uri": "123456789012.dkr.ecr.us-west-2.amazonaws.com/train:1",
    "fsx": {"file_system_id": "fs-0123456789abcdef0", "directory_path": "/abcdefgh/tunepod"},
    "subnets": ["subnet-0123456789abcdef0"],
    "security_group_ids": ["sg-0123456789abcdef0"],
}
LAUNCHERS = {
    "slurm": {"kind": "slurm"},
    "hyperpod_eks": {
        "kind": "hyperpod_eks",
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/t:1",
        "claim_name": "fsx-claim",
    },
    "sagemaker": SAGEMAKER_BLOCK,
}


@pytest.mark.parametrize("kind", sorted(LAUNCHERS))
def test_render_shows_no_credential_of_the_jobs_environment(kind: str, tmp_path: Path) -> None:
    """Credentials set in launcher.env, and one more by --set, render as *** on every launcher that
    takes an env (the local one takes none: its jobs inherit tunepod's own environment, never shown)."""
    block = {**LAUNCHERS[kind], "env": dict(CREDENTIALS)}
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, launcher=block)
    more = "launcher.env.GITHUB_AUTH=gh-SetTokenValue"
    rendered = tunepod("render", str(spec), "--set", more, **without_configuration())
    shown = rendered.stdout + rendered.stderr
    assert "# step search: trial 0" in rendered.stdout, rendered.stderr
    for name in [*CREDENTIALS, "GITHUB_AUTH"]:
        assert name in rendered.stdout
    for secret in [*CREDENTIALS.values(), "gh-SetTokenValue", "rEnderTokenValue", "EXAMPLEKEY"]:
        assert secret not in shown
    assert "***" in rendered.stdout


def test_a_set_override_quoted_by_an_error_shows_no_credential(tmp_path: Path) -> None:
    """The local launcher has no env: the "unknown key" error quotes the override, credentials hidden."""
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1)
    value = json.dumps({**CREDENTIALS, "DATABASE_URL": f"postgresql://u:{SECRET}@db/x", "DEBUG": "1"})
    refused = tunepod("validate", str(spec), "--set", f"launcher.env={value}")
    assert refused.returncode == 2
    assert "launcher.env: unknown key 'env'" in refused.stderr
    assert '"DEBUG": "1"' in refused.stderr, "what is no credential still shows"
    for secret in [*CREDENTIALS.values(), SECRET, "EXAMPLEKEY"]:
        assert secret not in refused.stderr
    broken = tunepod("validate", str(spec), "--set", "launcher.env={HF_TOKEN: hf_rEnderTokenValue, A: [}")
    assert "the value is not valid YAML" in broken.stderr
    assert "hf_rEnderTokenValue" not in broken.stderr


def test_render_of_a_sagemaker_spec_without_a_region_shows_the_request_and_names_the_fix(
    tmp_path: Path,
) -> None:
    """No region in the spec or on the machine: rendering needs no AWS client; the image of a
    framework_version does need a region, and the problem says how to set one."""
    block = {
        **SAGEMAKER_BLOCK,
        "image_uri": None,
        "framework_version": "2.5",
        "py_version": "py311",
        "code_uri": "s3://bucket/code/sourcedir.tar.gz",  # the trainer is outside root
    }
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, launcher=block)
    rendered = tunepod("render", str(spec), **without_configuration())
    assert "Traceback" not in rendered.stdout + rendered.stderr
    assert rendered.returncode == 2
    request = json.loads(rendered.stdout.split("\n", 2)[2])
    assert request["ResourceConfig"]["InstanceType"] == "ml.m5.xlarge"
    assert "launcher.region" in request["AlgorithmSpecification"]["TrainingImage"]
    assert rendered.stderr.startswith("tunepod run would refuse this (1 problem):")
    assert "fix: set launcher.region (or AWS_REGION), or set launcher.image_uri" in rendered.stderr

    with_region = tunepod(
        "render", str(spec), "--set", "launcher.region=us-west-2", **without_configuration()
    )
    assert with_region.returncode == 0, with_region.stderr
    image = json.loads(with_region.stdout.split("\n", 2)[2])["AlgorithmSpecification"]["TrainingImage"]
    assert image.startswith("763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.5")
