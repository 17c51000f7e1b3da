"""``uses: stage`` -- put a dataset on the shared filesystem, copying only what changed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from tunepod.metrics import default_metrics
from tunepod.outputs import Dataset, StepOutput
from tunepod.spec.models import StageSettings
from tunepod.staging import stage

if TYPE_CHECKING:
    from tunepod.pipeline import PipelineRun


def run(run: PipelineRun, name: str, settings: StageSettings, inputs: Mapping[str, StepOutput]) -> Dataset:
    target = run.shared.resolve(settings.target)
    report = stage(settings.source, target, cache_dir=run.shared.root.resolve() / ".cache")
    run.tracker.set_tags(run.run_id, {f"tunepod.{name}.path": str(target)})
    for key in ("num_files", "num_bytes", "copied_files", "copied_bytes", "seconds"):
        run.tracker.log_metric(run.run_id, f"{name}.{key}", float(getattr(report, key)))
    default_metrics().observe_staging(
        run.spec.name, name, copied_bytes=report.copied_bytes, seconds=report.seconds
    )
    return Dataset(
        source=settings.source,
        path=str(target),
        num_files=report.num_files,
        num_bytes=report.num_bytes,
        copied_files=report.copied_files,
        copied_bytes=report.copied_bytes,
    )
