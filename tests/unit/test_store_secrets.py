"""A store URI's password never reaches a message, a log line or the console: tunepod shows every URI
through ``tunepod.stores.redacted``, and a driver's failure to open a store is re-raised without it.

The stores that cannot be reached are real: a ``postgresql://`` or ``http://`` URL on a loopback port
nothing listens on refuses the connection, as a database or tracking server that is down does.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import yaml
from ports import free_port
from typer.testing import CliRunner

from tunepod.cli import app
from tunepod.errors import StoreError
from tunepod.hpo.study import make_storage, open_study
from tunepod.spec import dump_spec, load_spec, spec_hash
from tunepod.spec.models import TuneStep
from tunepod.stores import browsable, redacted
from tunepod.tracking import MlflowTracker

VALID = "tests/fixtures/specs/valid.yaml"
SECRET = "s3cret-Pa55"

runner = CliRunner()


def refusing(scheme: str = "postgresql") -> tuple[str, str]:
    """A URL with a password on a loopback port nothing listens on, and how it must be shown."""
    port = free_port()
    return (
        f"{scheme}://tunepod:{SECRET}@127.0.0.1:{port}/optuna",
        f"{scheme}://tunepod:***@127.0.0.1:{port}/optuna",
    )


def full_text(exc: BaseException) -> str:
    """What a traceback of ``exc`` prints: its message and every exception chained to it."""
    return "".join(traceback.format_exception(exc))


@pytest.fixture(autouse=True)
def _from_repo_root(in_repo: Path) -> None:
    """Spec paths (and the entrypoints inside the fixtures) are relative to the repository root."""


# ---------------------------------------------------------------------------------------------- redacted


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://u:s3cret@db:5432/optuna", "postgresql://u:***@db:5432/optuna"),
        ("postgresql+psycopg://u:p@ss/w0rd@db/optuna", "postgresql+psycopg://u:***@db/optuna"),
        (
            "postgresql://u@db/optuna?password=s3cret&sslmode=require",
            "postgresql://u@db/optuna?password=***&sslmode=require",
        ),
        ("host=db password='s3 cret' dbname=optuna", "host=db password=*** dbname=optuna"),
        ("postgresql://u:s3cret@[::1/optuna", "postgresql://u:***@[::1/optuna"),
        (
            "failed: API request to http://u:s3cret@h:5000/api/2.0 (see x@y)",
            "failed: API request to http://u:***@h:5000/api/2.0 (see x@y)",
        ),
        ("postgresql://u@db/optuna", "postgresql://u@db/optuna"),
        ("sqlite:////data/a@b/mlflow.db", "sqlite:////data/a@b/mlflow.db"),
        ("journal://.tunepod/optuna.log", "journal://.tunepod/optuna.log"),
    ],
    ids=[
        "userinfo", "unencoded @ and /", "query", "libpq key=value", "unparseable", "in a message",
        "no password", "sqlite path with @", "journal",
    ],
)  # fmt: skip
def test_redacted_keeps_all_but_the_secrets(text: str, shown: str) -> None:
    assert redacted(text) == shown


def test_redacted_hides_a_stores_password_wherever_a_driver_quotes_it() -> None:
    store = "postgresql://u:p%40ss-w0rd@db/optuna"
    assert redacted("auth failed for p@ss-w0rd, tried p%40ss-w0rd", store) == "auth failed for ***, tried ***"


def test_a_link_to_a_tracking_server_carries_no_login() -> None:
    assert browsable(f"https://u:{SECRET}@mlflow.example.com/path?token=t0ken") == (
        "https://mlflow.example.com/path?token=***"
    )


# ---------------------------------------------------------------------------------------------- study storage


def test_a_study_storage_that_cannot_be_reached_is_named_without_its_password() -> None:
    url, shown = refusing()
    with pytest.raises(StoreError) as raised:
        make_storage(url)
    message = str(raised.value)
    assert f"cannot open the study storage {shown} (OperationalError: " in message
    assert "Connection refused" in message  # the driver's reason is kept
    assert "fix: check that the server study.storage names runs" in message
    assert SECRET not in full_text(raised.value)


def test_opening_the_specs_study_on_an_unreachable_storage_shows_no_password() -> None:
    url, shown = refusing()
    spec = load_spec(VALID, [f"steps.search.with.study.storage={url}"])
    step = spec.steps["search"]
    assert isinstance(step, TuneStep)
    with pytest.raises(StoreError) as raised:
        open_study(step.with_)
    assert shown in str(raised.value)
    assert SECRET not in full_text(raised.value)


def test_a_connection_string_the_driver_quotes_is_redacted() -> None:
    # psycopg quotes a URI it cannot parse whole in its message.
    url = f"postgresql://tunepod:{SECRET}@[::1/optuna"
    with pytest.raises(StoreError) as raised:
        make_storage(url)
    assert "postgresql://tunepod:***@[::1/optuna" in str(raised.value)
    assert SECRET not in full_text(raised.value)


# ---------------------------------------------------------------------------------------------- MLflow


def test_an_mlflow_database_that_cannot_be_reached_is_named_without_its_password() -> None:
    url, shown = refusing()
    with pytest.raises(StoreError) as raised:
        MlflowTracker(url, "secrets")
    assert f"cannot open the MLflow tracking store {shown} (OperationalError: " in str(raised.value)
    assert "fix: check that the server tracking.uri names runs" in str(raised.value)
    assert SECRET not in full_text(raised.value)


def test_an_mlflow_server_that_cannot_be_reached_is_named_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MLflow's own message quotes the URI it was given, password and all.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    url, shown = refusing("http")
    with pytest.raises(StoreError) as raised:
        MlflowTracker(url, "secrets")
    assert f"cannot open the MLflow tracking store {shown} (MlflowException: " in str(raised.value)
    assert SECRET not in full_text(raised.value)


def test_a_link_to_an_mlflow_server_with_a_login_carries_no_password() -> None:
    spec = load_spec(VALID, [f"tracking.uri=https://tunepod:{SECRET}@mlflow.example.com"])
    assert spec.tracking.browse_url == "https://mlflow.example.com"


# ---------------------------------------------------------------------------------------------- the spec


def test_the_dumped_spec_its_hash_and_its_repr_hold_no_password() -> None:
    url, shown = refusing()
    spec = load_spec(VALID, [f"steps.search.with.study.storage={url}", f"tracking.uri={url}"])
    dumped = yaml.safe_load(dump_spec(spec))
    assert dumped["tracking"]["uri"] == shown
    assert dumped["steps"]["search"]["with"]["study"]["storage"] == shown
    assert SECRET not in repr(spec) and SECRET not in str(spec)
    other = load_spec(VALID, [f"steps.search.with.study.storage={url.replace(SECRET, 'an0ther')}",
                              f"tracking.uri={url.replace(SECRET, 'an0ther')}"])  # fmt: skip
    assert spec_hash(other) == spec_hash(spec)  # a hash that does not change with the password tells none


def test_validate_shows_an_override_with_a_password_redacted() -> None:
    url, shown = refusing()
    override = f"steps.search.with.study={{name: digits, storage: '{url}', metric: m, direction: up}}"
    result = runner.invoke(app, ["validate", VALID, "--set", override])
    assert result.exit_code == 2
    assert f"storage: '{shown}'" in result.stderr  # the override, as the issue names it
    assert "steps.search.with.study.direction" in result.stderr
    assert SECRET not in result.output


def test_validate_shows_a_refused_url_redacted() -> None:
    result = runner.invoke(
        app, ["validate", VALID, "--set", f"tracking.ui_url=ftp://tunepod:{SECRET}@mlflow"]
    )
    assert result.exit_code == 2
    assert "got 'ftp://tunepod:***@mlflow'" in result.stderr
    assert SECRET not in result.output


def test_dashboard_on_an_unreachable_storage_says_so_without_the_password() -> None:
    url, shown = refusing()
    result = runner.invoke(app, ["dashboard", VALID, "--set", f"steps.search.with.study.storage={url}"])
    assert result.exit_code == 1, result.output
    assert f"cannot open the study storage {shown}" in result.stderr
    assert "Connection refused" in result.stderr
    assert SECRET not in result.output
