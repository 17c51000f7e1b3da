"""``uses: export`` -- send the checkpoints of a tune or train step from FSx for Lustre to S3.

The launcher's jobs folder is linked to ``s3_prefix`` by one data repository association, reused by
every run; each chosen trial's checkpoint folder is exported (and optionally released) and lands at
``<s3_prefix>/<its path under the jobs folder>/``. The S3 URIs are tagged on the pipeline run and on
each trial's run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tunepod.errors import JobError
from tunepod.outputs import Export, ExportedCheckpoint, StepOutput, TrialRecord, TrialSet
from tunepod.spec.models import ExportSettings
from tunepod.staging.fsx_stage import export_folders
from tunepod.staging.s3 import parse_s3_uri
from tunepod.steps.context import StepContext
from tunepod.steps.inputs import only_input
from tunepod.tracking import tags as tag_names


def run(run: StepContext, name: str, settings: ExportSettings, inputs: Mapping[str, StepOutput]) -> Export:
    trials = only_input(inputs, TrialSet, name)
    chosen = _chosen(name, settings, trials)
    jobs_root = run.shared.root.resolve() / "jobs"
    report = export_folders(
        [Path(trial.checkpoint_dir) for trial in chosen],
        file_system_id=settings.file_system_id,
        root=jobs_root,
        mount=Path(settings.mount) if settings.mount is not None else run.shared.root,
        s3_prefix=settings.s3_prefix,
        release=settings.release,
        region=settings.region,
        report_path=settings.report_path,
        poll_s=settings.poll_s,
        timeout_s=settings.timeout_s,
    )
    exported = [
        ExportedCheckpoint(
            trial=trial.number,
            run_id=trial.run_id,
            checkpoint_dir=trial.checkpoint_dir,
            s3_uri=report.s3_uris[Path(trial.checkpoint_dir)],
        )
        for trial in chosen
    ]
    output = Export(
        step=name,
        file_system_id=settings.file_system_id,
        association_id=report.association.association_id,
        s3_prefix=parse_s3_uri(settings.s3_prefix).uri,
        checkpoints=exported,
        export_task_ids=[task.task_id for task in report.export_tasks],
        num_exported_files=sum(task.num_succeeded for task in report.export_tasks),
        release_task_ids=[task.task_id for task in report.release_tasks],
        num_released_files=(
            sum(task.num_succeeded for task in report.release_tasks) if settings.release else None
        ),
    )
    _track(run, name, output)
    return output


def _chosen(name: str, settings: ExportSettings, trials: TrialSet) -> list[TrialRecord]:
    """The trials whose checkpoints to export; a ``JobError`` when one left no checkpoint folder."""
    chosen = trials.best(settings.top_k) if settings.trials == "best" else trials.completed()
    if not chosen:
        raise JobError(f"step {name}: {trials.step} has no completed trial, so no checkpoint to export")
    missing = [trial for trial in chosen if not Path(trial.checkpoint_dir).is_dir()]
    if missing:
        listed = ", ".join(f"trial {t.number} ({t.checkpoint_dir})" for t in missing)
        raise JobError(
            f"step {name}: no checkpoint folder for {listed}; "
            "fix: call ctx.save_checkpoint(...) in the training script"
        )
    return chosen


def _track(run: StepContext, name: str, output: Export) -> None:
    run_tags: dict[str, object] = {
        tag_names.step_tag(name, "fsx_association"): output.association_id,
        tag_names.step_tag(name, "export_tasks"): " ".join(output.export_task_ids),
    }
    for checkpoint in output.checkpoints:
        run_tags[tag_names.step_tag(name, f"trial-{checkpoint.trial}.checkpoint_s3")] = checkpoint.s3_uri
        if checkpoint.run_id is not None:
            run.tracker.set_tags(checkpoint.run_id, {tag_names.CHECKPOINT_S3: checkpoint.s3_uri})
    run.tracker.set_tags(run.run_id, run_tags)
    run.tracker.log_metric(run.run_id, f"{name}.exported_files", float(output.num_exported_files))
    if output.num_released_files is not None:
        run.tracker.log_metric(run.run_id, f"{name}.released_files", float(output.num_released_files))
