"""The one flow that runs any pipeline spec: each step a task, independent steps concurrently.

tunepod run examples/digits/pipeline.yaml            # through the CLI
python -m flows.pipeline examples/digits/pipeline.yaml
"""

from __future__ import annotations

import sys

import httpx
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.events import emit_event
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run

from tasks.steps import run_step, step_retries
from tunepod.outputs import StepOutput
from tunepod.pipeline import PipelineRun, PipelineSummary, TrialRow


@flow(name="tunepod-pipeline", flow_run_name="{spec_path}", log_prints=True)
def pipeline(spec_path: str, overrides: list[str] | None = None) -> PipelineSummary:
    """Run the pipeline declared in ``spec_path``; ``overrides`` are ``dotted.path=value`` settings."""
    run = PipelineRun.start(
        spec_path,
        overrides,
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
    rows = [_trial_row(t, objectives) for t in summary.trials]
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
        description=f"Open it with: {summary.mlflow_ui_command}",
    )


def _trial_row(trial: TrialRow, objectives: list[str]) -> dict[str, object]:
    """One row of the trial table: every objective's value and the front's mark in a multi-objective
    study, the objective's value otherwise, then the parameters."""
    values: dict[str, object] = {"value": trial.value}
    if objectives:
        values = {m: trial.values.get(m) for m in objectives}
        values["pareto_front"] = trial.pareto_front
    params = {k: str(v) for k, v in trial.params.items()}
    return {"trial": trial.number, "outcome": trial.outcome, **values, **params}


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
