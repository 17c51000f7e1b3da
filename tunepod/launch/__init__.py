"""Launchers: run a training command on a backend and follow it (see ``base`` for the contract)."""

from tunepod.launch.base import JobHandle, JobSpec, JobState, Launcher, Resources, wait
from tunepod.launch.paths import JobPaths, SharedRoot

__all__ = ["JobHandle", "JobPaths", "JobSpec", "JobState", "Launcher", "Resources", "SharedRoot", "wait"]
