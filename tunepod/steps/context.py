"""What a step kind needs from the pipeline run around it, as a protocol.

Steps are given a ``StepContext``; ``tunepod.pipeline.PipelineRun`` is one. So ``tunepod.pipeline``
imports the steps, and no step imports the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tunepod.launch.base import Launcher
from tunepod.launch.paths import SharedRoot
from tunepod.spec.models import PipelineSpec
from tunepod.tracking import MlflowTracker
from tunepod.tracking.outbox import TrackingOutbox


class StepContext(Protocol):
    """One pipeline run, as its steps see it. Shared read-only by steps running concurrently."""

    spec: PipelineSpec
    launcher: Launcher
    shared: SharedRoot
    tracker: MlflowTracker
    outbox: TrackingOutbox
    run_id: str
    """The pipeline's MLflow run."""

    def job_dir(self, step: str, key: str) -> Path:
        """The job dir of one job of ``step``: stable across reruns and retries for the same ``key``."""
        ...
