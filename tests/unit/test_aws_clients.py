"""Making boto3 clients for the SageMaker launcher: what is wrong with the machine's AWS configuration
is said with the fix, never a botocore traceback (boto3 itself runs: no AWS call is made)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunepod.errors import TunepodError
from tunepod.launch.sagemaker.clients import aws_client, configured_region


@pytest.fixture
def no_aws_configuration(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    return config


def test_no_region_anywhere_names_launcher_region(no_aws_configuration: Path) -> None:
    assert configured_region() is None
    with pytest.raises(
        TunepodError, match=r"sagemaker\) in a region, and none is set; fix: set launcher.region"
    ):
        aws_client("sagemaker", None)


def test_the_region_of_the_profile_is_read_without_a_client(
    no_aws_configuration: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_aws_configuration.write_text("[profile team]\nregion = eu-west-1\n")
    monkeypatch.setenv("AWS_PROFILE", "team")
    assert configured_region() == "eu-west-1"
    assert aws_client("sagemaker", None).meta.region_name == "eu-west-1"


def test_a_profile_that_does_not_exist_is_said_with_the_fix(
    no_aws_configuration: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_PROFILE", "nowhere")
    assert configured_region() is None, "render goes on without a region"
    expected = r"cannot make an AWS sagemaker client: ProfileNotFound.*fix: check AWS_PROFILE"
    for region in ("us-west-2", None):  # without a region too: the profile, not the region, is the fix
        with pytest.raises(TunepodError, match=expected):
            aws_client("sagemaker", region)
