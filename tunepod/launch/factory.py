"""Building a launcher from the spec's ``launcher`` block."""

from __future__ import annotations

from pathlib import Path

from tunepod.launch.base import Launcher
from tunepod.spec.models import LauncherSpec, LocalLauncherSpec, SlurmLauncherSpec


def make_launcher(spec: LauncherSpec) -> Launcher:
    if isinstance(spec, LocalLauncherSpec):
        from tunepod.launch.local import LocalLauncher

        return LocalLauncher(Path(spec.root).resolve(), cancel_grace_s=spec.cancel_grace_s)
    if isinstance(spec, SlurmLauncherSpec):
        from tunepod.launch.slurm import SlurmLauncher

        return SlurmLauncher(spec)
    raise ValueError(f"no launcher for kind {spec.kind!r}")  # unreachable: the spec union is closed
