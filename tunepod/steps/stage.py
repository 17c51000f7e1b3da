"""``uses: stage`` -- put a dataset on the shared filesystem, copying only what changed; or, for an
``fsx://<file-system-id>/<path>`` target, link an S3 prefix into FSx for Lustre (and preload it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import tunepod.staging.preload_job
from tunepod.launch.paths import SharedRoot
from tunepod.metrics import default_metrics
from tunepod.outputs import Dataset, FsxImport, StepOutput
from tunepod.spec.models import FsxStageSpec, StageSettings, fsx_target_id
from tunepod.spec.resources import Resources
from tunepod.staging import stage
from tunepod.staging.fsx_stage import FsxStageReport, FsxTarget, stage_fsx
from tunepod.steps.context import StepContext
from tunepod.steps.jobs import StepJob, job_key, prepared, run_job
from tunepod.tracking import tags
from tunepod.tracking.mirror import RunMirror

PRELOAD_ENTRYPOINT = Path(tunepod.staging.preload_job.__file__)


def run(run: StepContext, name: str, settings: StageSettings, inputs: Mapping[str, StepOutput]) -> Dataset:
    if fsx_target_id(settings.target) is not None:
        return _run_fsx(run, name, settings, settings.fsx or FsxStageSpec())
    target = staged_path(run.shared, settings)
    report = stage(
        settings.source, target, cache_dir=run.shared.root.resolve() / ".cache", verify=settings.verify
    )
    figures = ("num_files", "num_bytes", "copied_files", "copied_bytes", "seconds")
    run.tracker.log_values(
        run.run_id,
        {f"{name}.{key}": float(getattr(report, key)) for key in figures},
        tags={tags.step_tag(name, "path"): str(target)},
    )
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


def staged_path(shared: SharedRoot, settings: StageSettings) -> Path:
    """Where the step puts the dataset, as the jobs see it (pure: nothing is staged)."""
    if fsx_target_id(settings.target) is not None:
        fsx = settings.fsx or FsxStageSpec()
        return FsxTarget.parse(settings.target).local(
            Path(fsx.mount) if fsx.mount is not None else shared.root
        )
    return shared.resolve(settings.target)


def _run_fsx(run: StepContext, name: str, settings: StageSettings, fsx: FsxStageSpec) -> Dataset:
    target = FsxTarget.parse(settings.target)
    mount = Path(fsx.mount) if fsx.mount is not None else run.shared.root
    report = stage_fsx(settings.source, target, fsx, mount)
    num_preloaded = _preload(run, name, report, fsx) if fsx.preload else None
    imported = FsxImport(
        file_system_id=target.file_system_id,
        file_system_path=target.path,
        association_id=report.association.association_id,
        import_task_id=report.import_task.task_id,
        num_imported_files=report.import_task.num_succeeded,
        num_failed_files=report.import_task.num_failed,
        num_preloaded_files=num_preloaded,
    )
    _track_fsx(run, name, report, imported)
    # Bytes are not copied at import: FSx loads contents on first read, so 0 is what this step moved.
    default_metrics().observe_staging(run.spec.name, name, copied_bytes=0, seconds=report.seconds)
    return Dataset(
        source=settings.source,
        path=str(report.target),
        num_files=report.num_files,
        num_bytes=report.num_bytes,
        copied_files=report.import_task.num_succeeded,
        copied_bytes=0,
        fsx=imported,
    )


def _preload(run: StepContext, name: str, report: FsxStageReport, fsx: FsxStageSpec) -> int:
    """Run the preload job on the launcher; the number of files it restored. One job per import: a
    retried step re-attaches to it, a later stage run (a new import) preloads again."""
    params: dict[str, object] = {"num_files_per_batch": fsx.num_files_per_batch}
    entrypoint = str(PRELOAD_ENTRYPOINT)
    key = job_key(entrypoint, params=params, folder=str(report.target), task=report.import_task.task_id)
    job_dir = prepared(run, run.job_dir(name, f"preload-{key}"))
    result = run_job(
        run,
        StepJob(
            what=f"Preload of {report.target} (step {name})",
            name=f"{run.spec.name}-{name}-preload",
            entrypoint=entrypoint,
            job_dir=job_dir,
            params=params,
            data_dir=str(report.target),
            resources=Resources(num_nodes=1, procs_per_node=1),
        ),
        RunMirror(
            run.tracker, job_dir, run_id=run.run_id, tag_prefix=tags.step_tag(name, ""), mirror_reports=False
        ),
    )
    return int(result.metrics.get("num_files", 0))


def _track_fsx(run: StepContext, name: str, report: FsxStageReport, imported: FsxImport) -> None:
    """Tags, metrics and a JSON report on the pipeline run, as the folder stager logs its own."""
    metrics = {
        "num_files": report.num_files,
        "num_bytes": report.num_bytes,
        "imported_files": imported.num_imported_files,
        "import_failed_files": imported.num_failed_files,
        "seconds": report.seconds,
    }
    if imported.num_preloaded_files is not None:
        metrics["preloaded_files"] = imported.num_preloaded_files
    run.tracker.log_values(
        run.run_id,
        {f"{name}.{key}": float(value) for key, value in metrics.items()},
        tags={
            tags.step_tag(name, "path"): str(report.target),
            tags.step_tag(name, "fsx_association"): imported.association_id,
            tags.step_tag(name, "fsx_import_task"): imported.import_task_id,
        },
    )
    document = {"target": str(report.target), **imported.model_dump(), **metrics}
    run.tracker.log_text(run.run_id, json.dumps(document, indent=1) + "\n", f"staging/{name}.json")
