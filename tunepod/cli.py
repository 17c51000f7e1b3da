"""The ``tunepod`` command line: check a spec, draw its DAG, run it.

    tunepod validate examples/digits/pipeline.yaml --set steps.search.with.num_trials=40
    tunepod graph examples/digits/pipeline.yaml > pipeline.mmd
    tunepod render examples/digits/pipeline-slurm.yaml --step search   # what a trial would send
    tunepod schema > pipeline.schema.json
    tunepod dashboard examples/digits/pipeline.yaml --port 8080

Exit codes: 0 success, 2 an invalid spec or a spec file that cannot be read (usage errors are 2 too,
as in every click program), 1 a run that failed or a study storage that cannot be opened. Error reports
go to stderr, results to stdout; a store URI shows with its password hidden (``tunepod.stores.redacted``).

This module must import quickly (``tunepod --help`` should not wait seconds): heavy libraries (mlflow,
optuna, torch, prefect) are imported inside the commands that need them, never at the top.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tunepod.dag import Dag, build_dag
from tunepod.errors import SpecError, StoreError
from tunepod.spec.loader import load_spec
from tunepod.spec.models import PipelineSpec
from tunepod.stack.cli import HomeOption
from tunepod.stack.cli import register as register_stack_commands
from tunepod.stack.config import DEFAULT_HOME
from tunepod.stack.manage import running_prefect_api
from tunepod.stack.runner import exit_like, forward_run
from tunepod.stack.temporary import TemporaryServer, TemporaryServerError
from tunepod.stack.watch import ServerWatch, lost_server, rerun_advice, run_environment_defaults
from tunepod.stores import redacted
from tunepod.watch import watching
from tunepod.webhook.cli import webhook_app

if TYPE_CHECKING:
    from tunepod.console import RunView
    from tunepod.pipeline import PipelineSummary

EXIT_INVALID_SPEC = 2

app = typer.Typer(
    name="tunepod",
    help="Declarative training pipelines: stage, tune, evaluate, register.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

SpecArgument = Annotated[
    Path,
    typer.Argument(help="Pipeline spec (YAML). Paths inside it are relative to the current directory."),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a spec value before validation: dotted.path=value (value read as YAML). Repeatable.",
        show_default=False,
    ),
]


def _load(spec_path: Path, overrides: list[str] | None) -> tuple[PipelineSpec, Dag]:
    """The validated spec and its DAG, or exit 2 after printing every issue to stderr."""
    try:
        spec = load_spec(spec_path, overrides or ())
        return spec, build_dag(spec, source=str(spec_path))
    except SpecError as exc:
        _print_issues(exc)
        raise typer.Exit(EXIT_INVALID_SPEC) from None


def _print_issues(exc: SpecError) -> None:
    # soft_wrap keeps each "file:line: path: message" on one line whatever the terminal width, and
    # Text (not markup) keeps brackets such as needs[0] from being read as rich style tags.
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    count = f"{len(exc.issues)} error{'s' if len(exc.issues) != 1 else ''}"
    console.print(Text(f"invalid pipeline spec {exc.source} ({count}):", "bold red"))
    for issue in exc.issues:
        console.print(Text(issue.render(exc.source)))


@app.command()
def validate(spec: SpecArgument, set_: SetOption = None) -> None:
    """Check a spec without running anything: models, DAG, entrypoint files. Exit 2 if it is invalid."""
    pipeline, dag = _load(spec, set_)
    summary = f"OK {spec}: pipeline {pipeline.name}, {len(dag.order)} steps in order: {', '.join(dag.order)}"
    Console(soft_wrap=True, highlight=False).print(Text(summary, "green"))


@app.command()
def schema() -> None:
    """Print the JSON Schema of a pipeline spec (editors: # yaml-language-server: $schema=<file>)."""
    from tunepod.spec.schema import spec_json_schema_text

    typer.echo(spec_json_schema_text(), nl=False)


@app.command()
def graph(spec: SpecArgument, set_: SetOption = None) -> None:
    """Print the spec's DAG as Mermaid text (paste it into any Mermaid renderer, or a Markdown file)."""
    _, dag = _load(spec, set_)
    typer.echo(dag.to_mermaid(), nl=False)


@app.command()
def dashboard(
    spec: SpecArgument,
    set_: SetOption = None,
    step: Annotated[str | None, typer.Option(help="The tune step whose study to show.")] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
) -> None:
    """Serve optuna-dashboard on the storage of the spec's study (live while the pipeline runs)."""
    pipeline_spec, _ = _load(spec, set_)
    storage = _study_storage(pipeline_spec, step)
    import optuna_dashboard  # seconds of imports: for this command only

    from tunepod.hpo.study import make_storage

    try:
        opened = make_storage(storage)
    except StoreError as exc:  # its message is the runbook: the store (password hidden), why, the fix
        Console(stderr=True, soft_wrap=True, highlight=False).print(Text(str(exc), "red"))
        raise typer.Exit(1) from None
    typer.echo(f"optuna-dashboard on {redacted(storage)}: http://{host}:{port}/dashboard/ (Ctrl+C stops it)")
    optuna_dashboard.run_server(opened, host=host, port=port)


@app.command()
def render(
    spec: SpecArgument,
    set_: SetOption = None,
    step: Annotated[str | None, typer.Option(help="The tune step to render (default: every one).")] = None,
) -> None:
    """Print what the launcher would send for each tune step's first trial, sending nothing: the
    sbatch script, the HyperPod EKS manifest, the CreateTrainingJob request or the local command.
    Credentials in the job's environment and store passwords show as ***. Then every problem
    `tunepod run` would refuse the job for, on stderr. Exit 2 for an invalid spec, a job that cannot
    be rendered, or any such problem."""
    from tunepod.errors import TunepodError
    from tunepod.launch.factory import make_launcher
    from tunepod.preview import preview_trials

    pipeline, _ = _load(spec, set_)
    stores, values = pipeline.store_uris(), pipeline.secret_values()
    try:
        previews = preview_trials(pipeline, make_launcher(pipeline.launcher, connect=False), step=step)
    except TunepodError as exc:
        _exit_with(redacted(str(exc), *stores, values=values))
    typer.echo("\n".join(preview.text(*stores, values=values) for preview in previews), nl=False)
    problems = [f"step {preview.step}: {problem}" for preview in previews for problem in preview.problems]
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        listed = "".join(f"\n- {problem}" for problem in problems)
        _exit_with(redacted(f"tunepod run would refuse this ({count}):{listed}", *stores, values=values))


def _study_storage(spec: PipelineSpec, step: str | None) -> str:
    """The study storage of the tune step ``step``, or of the only tune step; exit 2 naming the choice."""
    tunes = {name: s.with_.study.storage for name, s in spec.steps.items() if s.uses == "tune"}
    if step is not None and step not in tunes:
        _exit_with(
            f"--step {step}: not a tune step of this spec; its tune steps: {', '.join(tunes) or 'none'}"
        )
    if step is None and len(set(tunes.values())) != 1:
        _exit_with(f"the spec has {len(tunes)} tune steps; fix: choose one with --step ({', '.join(tunes)})")
    return tunes[step] if step is not None else next(iter(tunes.values()))


def _exit_with(message: str) -> None:
    Console(stderr=True, soft_wrap=True, highlight=False).print(Text(message, "red"))
    raise typer.Exit(EXIT_INVALID_SPEC)


# ---------------------------------------------------------------------------------------------- run


@app.command()
def run(spec: SpecArgument, set_: SetOption = None, home: HomeOption = Path(DEFAULT_HOME)) -> None:
    """Run the pipeline as a Prefect flow and print a summary. Exit 2 for an invalid spec, 1 if it fails.

    The flow runs on the Prefect server PREFECT_API_URL names; else on the one `tunepod up` started
    (found under --home), so the run shows in its UI; else Prefect starts a temporary server for it.
    """
    pipeline_spec, _ = _load(spec, set_)  # every spec error before Prefect's start-up cost
    if not os.environ.get("PREFECT_API_URL"):  # the local stack's runner, if it runs, takes it from here
        args = ["run", str(spec), *(f"--set={item}" for item in set_ or []), f"--home={home}"]
        status = forward_run(home, args, _say)
        if status is not None:
            raise typer.Exit(exit_like(status))
    _use_running_stack(home)
    for name, value in run_environment_defaults().items():
        os.environ.setdefault(name, value)
    server = _temporary_server_unless_set()
    view = _run_view()
    with view, watching(view):
        from flows.pipeline import pipeline  # Prefect is imported here only: it costs seconds

        _prewarm(pipeline_spec)
        # Everything imported so far lives until the exit: taken out of the collector's sight, it is
        # not walked by each collection during the run, nor by the last one at exit (2-3 s on two cores).
        gc.freeze()
        if server is not None:
            _wait_until_ready(server)
        with _watching_prefect_server():
            state = pipeline(str(spec), list(set_ or []), return_state=True)
    if not state.is_completed():
        # Prefect's message quotes the exception, whose driver may have quoted a store URI.
        message = redacted(f"pipeline failed: {state.message}", *pipeline_spec.store_uris())
        Console(stderr=True, soft_wrap=True).print(Text(message, "bold red"))
        raise typer.Exit(1)
    print_summary(state.result())


def _run_view() -> RunView:
    """The run's view on stderr: a live table on a terminal, else a line per event (``tunepod.console``).

    Under the live table Prefect's console handler shows warnings and errors only (its INFO lines, one
    per task run, would scroll the table away; they still reach the Prefect UI), unless
    PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL says otherwise. Set before Prefect is imported, as the
    table is started: Prefect's handler then writes through the table, above it."""
    from tunepod.console import RunView

    console = Console(stderr=True)
    if console.is_terminal:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    return RunView(console, live=console.is_terminal)


def _temporary_server_unless_set() -> TemporaryServer | None:
    """With no Prefect server set, start a temporary one for this run now (``tunepod.stack.temporary``)
    and point Prefect at it (before Prefect is imported: it reads its settings once); None when a
    server is set. It stops at the interpreter's exit: after Prefect's own exit work, which sends the
    logs and events still queued to it (a server stopped before that leaves Prefect retrying)."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    server = TemporaryServer.start()
    atexit.register(server.stop)
    os.environ["PREFECT_API_URL"] = server.api_url
    os.environ.setdefault("PREFECT_UI_URL", "")  # no UI on it: no "View at" link that leads nowhere
    _say(f"Prefect: a temporary server for this run, {server.api_url} (`tunepod up` keeps one, with its UI)")
    return server


def _wait_until_ready(server: TemporaryServer) -> None:
    try:
        server.wait_until_ready(float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
    except TemporaryServerError as exc:
        Console(stderr=True, soft_wrap=True, highlight=False).print(Text(str(exc), "red"))
        raise typer.Exit(1) from None


def _prewarm(spec: PipelineSpec) -> None:
    """Import Optuna and MLflow now, and open a local MLflow store (seconds on a new SQLite file; MLflow
    keeps the store for the flow's own tracker), while the temporary server boots. A remote tracking
    server is left for the flow: one that is down must be waited for, and reported, once. Any failure
    here is left for the flow to meet and report the way it does."""
    import optuna  # noqa: F401
    from mlflow import MlflowClient  # noqa: F401

    if not spec.tracking.uri.startswith(("sqlite:", "file:")):
        return
    from tunepod.tracking import MlflowTracker

    try:
        MlflowTracker(spec.tracking.uri, spec.tracking.experiment)
    except Exception as exc:
        logging.getLogger(__name__).debug("MLflow store not opened ahead of the flow: %s", exc)


@contextlib.contextmanager
def _watching_prefect_server() -> Iterator[None]:
    """Say when the Prefect server stops answering mid-run, and when it is back; when the run stops
    because it stayed away, print what to do instead of Prefect's traceback, and exit 1."""
    api = os.environ.get("PREFECT_API_URL")
    if not api:  # Prefect's temporary server is a child of this process: it goes only with the run
        yield
        return
    try:
        with ServerWatch(api):
            yield
    except Exception as exc:
        lost = lost_server(exc)
        if lost is None:
            raise
        message = f"lost the Prefect server {api} ({type(lost).__name__}: {lost}). {rerun_advice(api)}"
        message = redacted(message, api)
        Console(stderr=True, soft_wrap=True, highlight=False).print(Text(message, "bold red"))
        raise typer.Exit(1) from None


def _use_running_stack(home: Path) -> None:
    """Point Prefect at the local stack's server when nothing else is chosen (before Prefect is imported:
    it reads its settings once)."""
    if os.environ.get("PREFECT_API_URL"):
        return
    api = running_prefect_api(home)
    if api is not None:
        os.environ["PREFECT_API_URL"] = api
        _say(f"using the Prefect server of the local stack: {api}")


def _say(message: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text(message))


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def print_summary(summary: PipelineSummary) -> None:
    console = Console(highlight=False)
    objectives = summary.objectives
    table = Table(title=f"{summary.pipeline}: trials ({', '.join(objectives) or summary.metric})")
    value_columns = [*objectives, "Pareto front"] if objectives else ["value"]
    for column in ("trial", "outcome", *value_columns, "params"):
        table.add_column(column)
    for row in summary.trials:
        if objectives:
            values = [_number(row.values.get(m)) for m in objectives] + ["yes" if row.pareto_front else ""]
        else:
            values = [_number(row.value)]
        params = ", ".join(f"{k}={_short(v)}" for k, v in row.params.items())
        table.add_row(str(row.number), row.outcome, *values, params)
    console.print(table)
    left_out = summary.trials_left_out()
    if left_out:
        console.print(left_out)
    console.print(
        f"completed {summary.num_completed}, pruned {summary.num_pruned}, failed {summary.num_failed}"
    )
    if objectives:
        front = [str(row.number) for row in summary.trials if row.pareto_front]
        console.print(f"Pareto front ({', '.join(objectives)}): trials {', '.join(front)}")
    if summary.best is not None:
        console.print(
            f"best: trial {summary.best.number} {summary.metric}={summary.best.value} {summary.best.params}"
        )
    for name, score in summary.evaluation.items():
        console.print(f"evaluated {name}: {score:.4f}")
    if summary.registration is not None:
        reg = summary.registration
        moved = "moved to it" if reg.alias_moved else f"stays on version {reg.previous_version}"
        console.print(
            f"registered {reg.model} version {reg.version} ({reg.metric}={reg.value:.4f}); "
            f"alias {reg.alias} {moved}"
        )
    console.print(f"MLflow store: {summary.tracking_uri} (pipeline run {summary.run_id})")
    serve = f"{summary.mlflow_ui_command}  then open " if summary.mlflow_ui_command else "open "
    console.print(f"Browse it:    {serve}{summary.run_url}")


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------- stack

register_stack_commands(app)
app.add_typer(webhook_app, name="webhook", help="The signed-webhook receiver: serve it, sign a test request.")


if __name__ == "__main__":
    app()
