"""``tunepod webhook``: run the receiver, or sign a body the way a sender would.

    tunepod webhook serve --config deployments/webhooks.yaml --port 8787
    tunepod webhook sign --secret-env TUNEPOD_HOOK_S3_SECRET --body payload.json > headers.txt
    curl http://127.0.0.1:8787/hooks/s3-upload -H @headers.txt --data-binary @payload.json

Exit codes: 0 success, 2 a configuration that cannot serve (missing PREFECT_API_URL, an invalid
config file, no secret). Imports stay light at the top: uvicorn, FastAPI and httpx load only in
``serve``, so ``tunepod --help`` stays quick.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from tunepod.webhook.signatures import github_headers, standard_headers

if TYPE_CHECKING:
    from tunepod.webhook.config import WebhookConfig

EXIT_CONFIG = 2
DEFAULT_CONFIG = Path("deployments/webhooks.yaml")

webhook_app = typer.Typer(
    name="webhook",
    help="The signed-webhook receiver: serve it, or sign a test delivery.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@webhook_app.command()
def serve(
    config: Annotated[Path, typer.Option(help="Hook configuration (YAML).")] = DEFAULT_CONFIG,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8787,
    state_dir: Annotated[
        Path, typer.Option(help="Where the dedupe log lives; keep it across restarts.")
    ] = Path(".tunepod/webhook"),
) -> None:
    """Serve POST /hooks/{hook}; each verified delivery becomes a Prefect event (needs PREFECT_API_URL)."""
    from tunepod.webhook.config import WebhookConfigError, load_webhook_config

    api_url = os.environ.get("PREFECT_API_URL", "").strip()
    if not api_url:
        _fail(
            "PREFECT_API_URL is not set: the receiver posts its events to the Prefect API.\n"
            "    fix: export PREFECT_API_URL=http://127.0.0.1:4200/api (the server `tunepod up` starts)"
        )
    try:
        hooks = load_webhook_config(config)
    except WebhookConfigError as exc:
        _fail(str(exc))
    _run_server(hooks, api_url, host, port, state_dir)


def _run_server(hooks: WebhookConfig, api_url: str, host: str, port: int, state_dir: Path) -> None:
    import uvicorn

    from tunepod.webhook.app import create_app
    from tunepod.webhook.publisher_process import in_process

    # The receiver's own lines (accepted, rejected and why) beside uvicorn's access log.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    app = create_app(hooks, in_process(api_url), state_dir)
    uvicorn.run(app, host=host, port=port, log_level="info")


@webhook_app.command()
def sign(
    body: Annotated[str, typer.Option(help="File with the exact body to send, or - for stdin.")],
    secret_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the secret.", show_default=False)
    ] = None,
    secret: Annotated[
        str | None,
        typer.Option(help="The secret itself (history keeps it; prefer --secret-env).", show_default=False),
    ] = None,
    github: Annotated[bool, typer.Option(help="Sign as GitHub does (X-Hub-Signature-256).")] = False,
) -> None:
    """Print the headers of a signed delivery of BODY, one 'Name: value' per line (for curl -H @FILE).

    Send the body byte for byte (curl --data-binary @FILE): the signature covers the exact bytes.
    """
    key = _secret_from(secret_env, secret)
    data = sys.stdin.buffer.read() if body == "-" else _read_body(Path(body))
    headers = github_headers(key, data) if github else standard_headers([key], data)
    headers["Content-Type"] = "application/json"
    for name, value in headers.items():
        typer.echo(f"{name}: {value}")


def _secret_from(secret_env: str | None, secret: str | None) -> str:
    if (secret_env is None) == (secret is None):
        _fail("give exactly one of --secret-env NAME or --secret VALUE")
    if secret is not None:
        return secret
    assert secret_env is not None
    value = os.environ.get(secret_env, "").strip()
    if not value:
        _fail(f"environment variable {secret_env} is not set or empty")
    return value


def _read_body(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        _fail(f"cannot read the body file {path}: {exc.strerror}")


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_CONFIG)
