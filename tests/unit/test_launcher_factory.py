"""Each launcher kind of the spec builds its launcher, or says clearly that it cannot submit yet."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunepod.errors import TunepodError
from tunepod.launch.factory import make_launcher
from tunepod.launch.local import LocalLauncher
from tunepod.launch.sagemaker import SageMakerLauncher
from tunepod.launch.slurm import SlurmLauncher
from tunepod.spec.models import (
    HyperPodEksLauncherSpec,
    LocalLauncherSpec,
    SageMakerLauncherSpec,
    SlurmLauncherSpec,
)


def test_local_slurm_and_sagemaker_build_their_launchers(tmp_path: Path) -> None:
    assert isinstance(make_launcher(LocalLauncherSpec(root=str(tmp_path))), LocalLauncher)
    assert isinstance(make_launcher(SlurmLauncherSpec(kind="slurm", root=str(tmp_path))), SlurmLauncher)
    sagemaker = SageMakerLauncherSpec(
        kind="sagemaker",
        root=str(tmp_path),
        role_arn="arn:aws:iam::123456789012:role/tunepod",
        image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/pytorch:2.4",
        output_s3_uri="s3://bucket/output",
        checkpoint_s3_uri="s3://bucket/checkpoints",
        region="us-east-1",
    )
    assert isinstance(make_launcher(sagemaker), SageMakerLauncher)


def test_hyperpod_eks_says_it_cannot_submit_yet(tmp_path: Path) -> None:
    spec = HyperPodEksLauncherSpec(kind="hyperpod_eks", image="img", root="/fsx/tunepod", claim_name="fsx")
    with pytest.raises(TunepodError, match=r"'hyperpod_eks' cannot submit jobs yet.*fix: use kind local"):
        make_launcher(spec)
