"""Building a launcher from the spec's ``launcher`` block."""

from __future__ import annotations

from pathlib import Path

from tunepod.launch.base import Launcher
from tunepod.spec.models import LauncherSpec, LocalLauncherSpec


def make_launcher(spec: LauncherSpec) -> Launcher:
    if isinstance(spec, LocalLauncherSpec):
        from tunepod.launch.local import LocalLauncher

        return LocalLauncher(Path(spec.root).resolve(), cancel_grace_s=spec.cancel_grace_s)
    raise ValueError(f"no launcher for kind {spec.kind!r}")  # unreachable: the spec union is closed
