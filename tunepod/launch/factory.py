"""Building a launcher from the spec's ``launcher`` block."""

from __future__ import annotations

from pathlib import Path

from tunepod.errors import TunepodError
from tunepod.launch.base import Launcher
from tunepod.spec.models import LauncherSpec, LocalLauncherSpec, SageMakerLauncherSpec, SlurmLauncherSpec


def make_launcher(spec: LauncherSpec) -> Launcher:
    if isinstance(spec, LocalLauncherSpec):
        from tunepod.launch.local import LocalLauncher

        return LocalLauncher(Path(spec.root).resolve(), cancel_grace_s=spec.cancel_grace_s)
    if isinstance(spec, SlurmLauncherSpec):
        from tunepod.launch.slurm import SlurmLauncher

        return SlurmLauncher(spec)
    if isinstance(spec, SageMakerLauncherSpec):
        from tunepod.launch.sagemaker import SageMakerLauncher

        return SageMakerLauncher(spec)
    # A kind the spec accepts (so its manifests can be rendered and validated) before it can submit.
    raise TunepodError(
        f"launcher kind {spec.kind!r} cannot submit jobs yet (its manifests render and validate, see "
        f"tunepod.launch); fix: use kind local, slurm or sagemaker"
    )
