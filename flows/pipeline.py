"""The one flow that runs any pipeline spec: each step a task, independent steps concurrently.

tunepod run examples/digits/pipeline.yaml            # through the CLI
python -m flows.pipeline examples/digits/pipeline.yaml
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
from tunepod.spec.models import NumParallel


@flow(name="tunepod-pipeline", flow_run_name="{spec_path}", log_prints=True)
def pipeline(
    spec_path: str,
    overrides: list[str] | None = None,
    num_trials: Annotated[int | None, RunForm.model_fields["num_trials"]] = None,
    num_parallel: Annotated[NumParallel | None, RunForm.model_fields["num_parallel"]] = None,
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
        num_parallel: Trials in flight at once in each tune step's study, or auto: as many as the
            cluster runs at once (empty: the spec's).
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
    # The artifacts go to Prefect while MLflow ends its run: the end of a run is these few requests,
    # each waiting on its server, and none waits on another.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="tunepod-artifacts") as pool:
        try:
            summary = run.summary(outputs)
            # Each in a copy of this context, which holds the flow run the artifacts belong to.
            pending = [pool.submit(contextvars.copy_context().run, create) for create in _artifacts(summary)]
        finally:
            run.finish(ok=True)
        _wait_published(pending)
    _announce(summary)
    return summary


def _artifacts(summary: PipelineSummary) -> list[Callable[[], object]]:
    """The trial table (and a multi-objective study's Pareto front) and a link to the MLflow run:
    the Prefect artifacts of the flow run, each to create."""
    objectives = summary.objectives
    rows = [t.table_row(objectives) for t in summary.trials]
    measured = ", ".join(objectives) or summary.metric
    front = [row for row in rows if row.get("pareto_front")]
    left_out = summary.trials_left_out()
    described = f"Trials of {summary.pipeline} ({measured})" + (f": {left_out}" if left_out else "")
    tables = [
        (rows, "trials", described),
        (front, "pareto-front", f"Pareto front of {summary.pipeline} ({measured})"),
    ]
    creates: list[Callable[[], object]] = [
        functools.partial(create_table_artifact, table, key=key, description=description)
        for table, key, description in tables
        if table
    ]
    ui_hint = f"Serve the UI with: {summary.mlflow_ui_command}" if summary.mlflow_ui_command else None
    link = functools.partial(
        create_link_artifact,
        summary.run_url,
        link_text="MLflow pipeline run",
        key="mlflow-run",
        description=ui_hint,
    )
    return [*creates, link]


def _wait_published(pending: list[Future[object]]) -> None:
    unpublished = []
    for future in pending:
        try:
            future.result()
        except httpx.TransportError as exc:
            unpublished.append(exc)
    if unpublished:
        # The work is done and tracked in MLflow; a Prefect server still away after the client's
        # retries (see tunepod.stack.watch) costs the UI its trial table, not the run its result.
        get_run_logger().warning("trial table and MLflow link not published to Prefect: %s", unpublished[0])


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
