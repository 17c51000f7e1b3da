"""Building a launcher from the spec's ``launcher`` block."""

from __future__ import annotations

from pathlib import Path
from typing import assert_never

from tunepod.launch.base import Launcher
from tunepod.spec.models import (
    HyperPodEksLauncherSpec,
    LauncherSpec,
    LocalLauncherSpec,
    SageMakerLauncherSpec,
    SlurmLauncherSpec,
)


def make_launcher(spec: LauncherSpec, *, connect: bool = True) -> Launcher:
    """The launcher of ``spec``. ``connect=False``: one that reads no cluster configuration until it
    first needs the cluster (``render`` needs none), for ``tunepod render`` on a machine without it."""
    if isinstance(spec, LocalLauncherSpec):
        from tunepod.launch.local import LocalLauncher

        return LocalLauncher(
            Path(spec.root).resolve(),
            cancel_grace_s=spec.cancel_grace_s,
            direct_single_process=spec.direct_single_process,
        )
    if isinstance(spec, SlurmLauncherSpec):
        from tunepod.launch.slurm import SlurmLauncher

        return SlurmLauncher(spec)
    if isinstance(spec, SageMakerLauncherSpec):
        from tunepod.launch.sagemaker import SageMakerLauncher

        return SageMakerLauncher(spec, connect=connect)
    if isinstance(spec, HyperPodEksLauncherSpec):
        from tunepod.launch.hyperpod_eks import HyperPodEksLauncher

        return HyperPodEksLauncher(spec, connect=connect)
    assert_never(spec)
