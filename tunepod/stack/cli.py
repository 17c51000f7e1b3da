"""``tunepod up``, ``down``, ``status`` and ``deploy``: the local stack from the command line.

    tunepod up                      # Prefect server + worker, MLflow server, webhook receiver, runner
    tunepod deploy                  # register deployments/prefect.yaml with that Prefect server
    tunepod status                  # what runs where, healthy or not
    tunepod down                    # stop it all

The four functions are plain typer commands: the main CLI mounts them with ``register(app)``; ``app``
here runs them alone (``python -m tunepod.stack up``). Exit codes: 0 success, 1 a service that would not
start (the message has its log tail), or, for ``status``, a recorded service that is not healthy.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tunepod.stack import manage
from tunepod.stack.config import DEFAULT_HOME, DEFAULT_PREFECT_FILE, DEFAULT_WEBHOOK_CONFIG, StackConfig
from tunepod.stack.manage import ServiceStatus, StackError

HomeOption = Annotated[
    Path,
    typer.Option("--home", envvar="TUNEPOD_HOME", help="State folder: records, logs, databases."),
]
RepoOption = Annotated[
    Path,
    typer.Option("--repo", envvar="TUNEPOD_REPO_ROOT", help="Repository root (deployments/, flows/)."),
]
PrefectPort = Annotated[int, typer.Option(envvar="TUNEPOD_PREFECT_PORT", help="Prefect server (UI and API).")]
MlflowPort = Annotated[int, typer.Option(envvar="TUNEPOD_MLFLOW_PORT", help="MLflow server (UI and API).")]
WebhookPort = Annotated[int, typer.Option(envvar="TUNEPOD_WEBHOOK_PORT", help="Webhook receiver.")]
WebhookConfigOption = Annotated[
    Path,
    typer.Option(
        "--webhook-config",
        envvar="TUNEPOD_WEBHOOK_CONFIG",
        help="The receiver's hooks; relative to --repo.",
    ),
]
PrefectFileOption = Annotated[
    Path,
    typer.Option(
        "--prefect-file",
        envvar="TUNEPOD_PREFECT_FILE",
        help="The deployments to register; relative to --repo.",
    ),
]
PrefectDatabaseOption = Annotated[
    str | None,
    typer.Option(
        "--prefect-database",
        envvar="TUNEPOD_PREFECT_DATABASE",
        help="The Prefect server's database, postgresql://user:password@host:5432/db "
        "(default: SQLite under --home).",
        show_default=False,
    ),
]
MlflowDatabaseOption = Annotated[
    str | None,
    typer.Option(
        "--mlflow-database",
        envvar="TUNEPOD_MLFLOW_DATABASE",
        help="The MLflow server's backend store, postgresql://user:password@host:5432/db "
        "(default: SQLite under --home). Not the Prefect database: each keeps its own schema.",
        show_default=False,
    ),
]
MlflowArtifactsOption = Annotated[
    str | None,
    typer.Option(
        "--mlflow-artifacts",
        envvar="TUNEPOD_MLFLOW_ARTIFACTS",
        help="Where the MLflow server keeps artifacts, e.g. s3://bucket/mlflow (AWS credentials and "
        "MLFLOW_S3_ENDPOINT_URL from the environment; default: a folder under --home).",
        show_default=False,
    ),
]
MlflowWorkersOption = Annotated[
    int | None,
    typer.Option(
        "--mlflow-workers",
        envvar="TUNEPOD_MLFLOW_WORKERS",
        min=1,
        help="The MLflow server's worker processes (default: 4, or fewer on a machine with fewer cores).",
        show_default=False,
    ),
]
TimeoutOption = Annotated[
    float, typer.Option("--timeout-s", help="How long to wait for each service to become healthy.")
]


def _config(
    home: Path,
    repo: Path,
    prefect_port: int,
    mlflow_port: int,
    webhook_port: int,
    timeout_s: float = 180.0,
    webhook_config: Path = DEFAULT_WEBHOOK_CONFIG,
    prefect_file: Path = DEFAULT_PREFECT_FILE,
) -> StackConfig:
    return StackConfig(
        home=home,
        repo=repo,
        prefect_port=prefect_port,
        mlflow_port=mlflow_port,
        webhook_port=webhook_port,
        startup_timeout_s=timeout_s,
        webhook_config=webhook_config,
        prefect_file=prefect_file,
    )


def up(
    home: HomeOption = Path(DEFAULT_HOME),
    repo: RepoOption = Path("."),
    prefect_port: PrefectPort = 4200,
    mlflow_port: MlflowPort = 5000,
    webhook_port: WebhookPort = 8787,
    timeout_s: TimeoutOption = 180.0,
    webhook_config: WebhookConfigOption = DEFAULT_WEBHOOK_CONFIG,
    prefect_database: PrefectDatabaseOption = None,
    mlflow_database: MlflowDatabaseOption = None,
    mlflow_artifacts: MlflowArtifactsOption = None,
    mlflow_workers: MlflowWorkersOption = None,
) -> None:
    """Start the local stack (what already runs is left alone) and print where each service listens."""
    config = replace(
        _config(home, repo, prefect_port, mlflow_port, webhook_port, timeout_s, webhook_config),
        prefect_database=prefect_database,
        mlflow_database=mlflow_database,
        mlflow_artifacts=mlflow_artifacts,
    )
    if mlflow_workers is not None:
        config = replace(config, mlflow_workers=mlflow_workers)
    try:
        report = manage.up(config)
    except StackError as exc:
        Console(stderr=True, soft_wrap=True, highlight=False).print(Text(str(exc), "red"))
        raise typer.Exit(1) from None
    _print(report, f"stack in {config.home} (logs in {config.logs_dir})")


def down(
    home: HomeOption = Path(DEFAULT_HOME),
    repo: RepoOption = Path("."),
    prefect_port: PrefectPort = 4200,
    mlflow_port: MlflowPort = 5000,
    webhook_port: WebhookPort = 8787,
) -> None:
    """Stop every service `tunepod up` started (SIGTERM, then SIGKILL, to each process group)."""
    config = _config(home, repo, prefect_port, mlflow_port, webhook_port)
    report = manage.down(config)
    if not report:
        typer.echo(f"nothing recorded as running in {config.records_dir}")
        return
    _print(report, f"stack in {config.home}")


def status(
    home: HomeOption = Path(DEFAULT_HOME),
    repo: RepoOption = Path("."),
    prefect_port: PrefectPort = 4200,
    mlflow_port: MlflowPort = 5000,
    webhook_port: WebhookPort = 8787,
) -> None:
    """Print what runs where (pid, URL, healthy or not). Exit 1 if a recorded service is not healthy."""
    config = _config(home, repo, prefect_port, mlflow_port, webhook_port)
    report = manage.status(config)
    if not report:
        typer.echo(f"not running: no service recorded in {config.records_dir} (start it: tunepod up)")
        return
    _print(report, f"stack in {config.home}")
    if not all(line.healthy for line in report):
        raise typer.Exit(1)


def deploy(
    home: HomeOption = Path(DEFAULT_HOME),
    repo: RepoOption = Path("."),
    prefect_port: PrefectPort = 4200,
    mlflow_port: MlflowPort = 5000,
    webhook_port: WebhookPort = 8787,
    prefect_file: PrefectFileOption = DEFAULT_PREFECT_FILE,
) -> None:
    """Register deployments/prefect.yaml (schedules, triggers) with the stack's Prefect server."""
    config = _config(home, repo, prefect_port, mlflow_port, webhook_port, prefect_file=prefect_file)
    try:
        output = manage.deploy(config)
    except StackError as exc:
        Console(stderr=True, soft_wrap=True, highlight=False).print(Text(str(exc), "red"))
        raise typer.Exit(1) from None
    typer.echo(output)
    typer.echo(f"deployments of {config.prefect_file} registered; see {config.prefect_url}/deployments")


def register(app: typer.Typer) -> None:
    """Mount ``up``, ``down``, ``status`` and ``deploy`` as top-level commands of ``app``."""
    for command in (up, down, status, deploy):
        app.command()(command)


#: A note longer than this goes below the table, whole, where a terminal cannot wrap it mid-path.
_NOTE_IN_TABLE = 60


def _print(report: list[ServiceStatus], title: str) -> None:
    table = Table(title=title)
    for column in ("service", "state", "pid", "url", "healthy", "note"):
        table.add_column(column)
    for line in report:
        pid = "" if line.pid is None else str(line.pid)
        note = line.detail if len(line.detail) <= _NOTE_IN_TABLE else "see below"
        table.add_row(line.name, line.state, pid, line.url, "yes" if line.healthy else "no", note)
    console = Console(highlight=False, width=200, soft_wrap=True)
    console.print(table)
    for line in report:
        if len(line.detail) > _NOTE_IN_TABLE:
            console.print(Text(f"{line.name}: {line.detail}"))


app = typer.Typer(name="tunepod-stack", no_args_is_help=True, add_completion=False)
register(app)

if __name__ == "__main__":
    app()
