"""Each launcher kind of the spec builds its launcher, or says clearly that it cannot submit yet."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunepod.errors import TunepodError
from tunepod.launch.factory import make_launcher
from tunepod.launch.hyperpod_eks import HyperPodEksLauncher
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


def test_hyperpod_eks_builds_a_kubernetes_launcher_from_its_kubeconfig(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    spec = HyperPodEksLauncherSpec(
        kind="hyperpod_eks", image="img", root="/fsx/tunepod", claim_name="fsx", kubeconfig=str(kubeconfig)
    )
    assert isinstance(make_launcher(spec), HyperPodEksLauncher)


def test_hyperpod_eks_without_its_kubeconfig_names_the_field(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-kubeconfig"
    spec = HyperPodEksLauncherSpec(
        kind="hyperpod_eks", image="img", root="/fsx/tunepod", claim_name="fsx", kubeconfig=str(missing)
    )
    with pytest.raises(TunepodError, match=r"launcher\.kubeconfig"):
        make_launcher(spec)
