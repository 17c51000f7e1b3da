"""Launchers: run a training command on a backend and follow it.

``base`` holds the contract (``Launcher``, ``JobHandle``) and the template every backend fills in
(``LauncherBase``: the submission record written ahead of sending, find-by-name, refuse-if-running,
the cancel marker, warn-once, one batched status cache). ``drive`` is the one loop that drives a job
dir to its outcome, for the tuner and the steps alike; ``lease`` keeps it to one driver per job dir.
Backends: ``local``, ``slurm``, ``sagemaker``, ``hyperpod_eks`` (see ``factory.make_launcher``).
"""

from tunepod.launch.base import JobHandle, JobSpec, JobState, Launcher, LauncherBase, Resources, wait
from tunepod.launch.paths import JobPaths, SharedRoot

__all__ = [
    "JobHandle",
    "JobPaths",
    "JobSpec",
    "JobState",
    "Launcher",
    "LauncherBase",
    "Resources",
    "SharedRoot",
    "wait",
]
