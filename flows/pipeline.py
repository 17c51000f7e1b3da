"""The one flow that runs any pipeline spec: each step a task, independent steps concurrently.

tunepod run examples/digits/pipeline.yaml            # through the CLI
python -m flows.pipeline examples/digits/pipeline.yaml
"""

from __future__ import annotations

import sys
from typing import Annotated

import httpx
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.events import emit_event
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run

from tasks.steps import run_step, step_retries
from tunepod.outputs import StepOutput
from tunepod.pipeline import PipelineRun, PipelineSummary
from tunepod.run_form import LauncherKind, RunForm


@flow(name="tunepod-pipeline", flow_run_name="{spec_path}", log_prints=True)
def pipeline(
    spec_path: str,
    overrides: list[str] | None = None,
    num_trials: Annotated[int | None, RunForm.model_fields["num_trials"]] = None,
    num_parallel: Annotated[int | None, RunForm.model_fields["num_parallel"]] = None,
    experiment: Annotated[str | None, RunForm.model_fields["experiment"]] = None,
    launcher: Annotated[LauncherKind | None, RunForm.model_fields["launcher"]] = None,
) -> PipelineSummary:
    """Run the pipeline declared in ``spec_path``. The typed fields are the common overrides (the
    deployment's run form shows them as fields, and Prefect checks them before the run starts);
    ``overrides`` are ``dotted.path=value`` settings for the rest, applied after them (second, so
    that ``pipeline(spec, overrides)`` keeps working).

    Args:
        spec_path: Pipeline spec (YAML), relative to the repository root.
        overrides: Any other setting, as dotted.path=value (value read as YAML), applied last.
        num_trials: Finished trials each tune step's study should hold (empty: the spec's).
        num_parallel: Trials in flight at once in each tune step (empty: the spec's).
        experiment: MLflow experiment of the pipeline run (empty: the spec's).
        launcher: Run the jobs on this launcher with its defaults, replacing the spec's launcher block.
    """
    form = RunForm(num_trials=num_trials, num_parallel=num_parallel, experiment=experiment, launcher=launcher)
    run = PipelineRun.start(
        spec_path,
        [*form.overrides(spec_path), *(overrides or [])],
        tags={"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_url": _ui_url()},
    )
    futures: dict[str, PrefectFuture[StepOutput]] = {}
    try:
        for name in run.dag.order:
            step = run.spec.steps[name]
            inputs = {need: futures[need] for need in step.needs}
            futures[name] = run_step.with_options(
                name=name, task_run_name=name, tags=[step.uses], retries=step_retries(step.uses)
            ).submit(run, name, inputs)  # type: ignore[arg-type]  # Prefect resolves the futures
        outputs = {name: future.result() for name, future in futures.items()}
    except BaseException:
        run.finish(ok=False)
        raise
    run.finish(ok=True)
    summary = run.summary(outputs)
    try:
        _publish(summary)
    except httpx.TransportError as exc:
        # The work is done and tracked in MLflow; a Prefect server still away after the client's
        # retries (see tunepod.stack.watch) costs the UI its trial table, not the run its result.
        get_run_logger().warning("trial table and MLflow link not published to Prefect: %s", exc)
    _announce(summary)
    return summary


def _publish(summary: PipelineSummary) -> None:
    """The trial table and a link to the MLflow run, as Prefect artifacts on the flow run."""
    objectives = summary.objectives
    rows = [t.table_row(objectives) for t in summary.trials]
    if rows:
        measured = ", ".join(objectives) or summary.metric
        create_table_artifact(rows, key="trials", description=f"Trials of {summary.pipeline} ({measured})")
    front = [row for row in rows if row.get("pareto_front")]
    if front:
        create_table_artifact(
            front, key="pareto-front", description=f"Pareto front of {summary.pipeline} ({measured})"
        )
    create_link_artifact(
        summary.run_url,
        link_text="MLflow pipeline run",
        key="mlflow-run",
        description=f"Serve the UI with: {summary.mlflow_ui_command}" if summary.mlflow_ui_command else None,
    )


def _announce(summary: PipelineSummary) -> None:
    """Emit ``tunepod.pipeline.completed`` (an automation can trigger on it). Emitting also makes
    Prefect's events client resend the task-run events it kept while the server was away, so a
    restarted server ends up with every trial's task run final, not Running forever."""
    emit_event(
        event="tunepod.pipeline.completed",
        resource={
            "prefect.resource.id": f"tunepod.pipeline.{summary.pipeline}",
            "prefect.resource.name": summary.pipeline,
        },
        payload={
            "completed": summary.num_completed,
            "pruned": summary.num_pruned,
            "failed": summary.num_failed,
            "mlflow_run_id": summary.run_id,
        },
    )


def _ui_url() -> str:
    url = flow_run.ui_url
    return str(url) if url else ""


if __name__ == "__main__":
    pipeline(sys.argv[1], sys.argv[2:])
