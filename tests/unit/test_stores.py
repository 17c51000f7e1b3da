"""Database URLs as users write them, and the errors `tunepod up` and the spec give for unusable stores."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tunepod.errors import SpecError
from tunepod.spec.loader import parse_spec
from tunepod.stack.config import StackConfig
from tunepod.stack.manage import StackError, up
from tunepod.stack.services import mlflow_server, prefect_server
from tunepod.stores import StoreUrlError, prefect_database_url, redacted, sync_sqlalchemy_url

REPO = Path(__file__).resolve().parents[2]
PG = "postgresql://tunepod:s3cret@db.example.com:5432/mlflow"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (PG, "postgresql+psycopg://tunepod:s3cret@db.example.com:5432/mlflow"),
        ("postgres://u:p@h/d", "postgresql+psycopg://u:p@h/d"),
        ("postgresql+psycopg://u:p@h/d", "postgresql+psycopg://u:p@h/d"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ],
)
def test_mlflow_and_optuna_open_postgresql_through_psycopg3(url: str, expected: str) -> None:
    assert sync_sqlalchemy_url(url) == expected


def test_prefect_gets_asyncpg_or_aiosqlite_and_refuses_the_rest() -> None:
    assert prefect_database_url(PG) == "postgresql+asyncpg://tunepod:s3cret@db.example.com:5432/mlflow"
    assert prefect_database_url("sqlite:////tmp/p.db") == "sqlite+aiosqlite:////tmp/p.db"
    with pytest.raises(StoreUrlError, match=r"PostgreSQL or SQLite only; fix: give postgresql://") as raised:
        prefect_database_url("mysql://u:hidden@h/d")
    assert "hidden" not in str(raised.value)


def test_redacted_hides_only_the_password() -> None:
    assert redacted(PG) == "postgresql://tunepod:***@db.example.com:5432/mlflow"
    assert redacted("postgresql://u@h/d") == "postgresql://u@h/d"


def test_the_servers_get_their_stores_by_environment_never_in_argv(tmp_path: Path) -> None:
    config = StackConfig(
        home=tmp_path,
        repo=REPO,
        prefect_database=PG,
        mlflow_database=PG,
        mlflow_artifacts="s3://bucket/mlflow",
    )
    prefect, mlflow = prefect_server(config), mlflow_server(config)
    assert prefect.env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert mlflow.env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg://")
    assert mlflow.env["MLFLOW_ARTIFACTS_DESTINATION"] == "s3://bucket/mlflow"
    assert not any("s3cret" in arg for arg in prefect.argv + mlflow.argv)
    # Without settings: SQLite and a folder under the home, as before.
    local = mlflow_server(StackConfig(home=tmp_path, repo=REPO))
    assert local.env["MLFLOW_BACKEND_STORE_URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (
        "PREFECT_API_DATABASE_CONNECTION_URL" not in prefect_server(StackConfig(home=tmp_path, repo=REPO)).env
    )


def test_up_refuses_unusable_store_settings_before_starting_anything(tmp_path: Path) -> None:
    config = StackConfig(
        home=tmp_path / "home",
        repo=REPO,
        prefect_database="mysql://u:p@h/prefect",
        mlflow_database="mssql://u:p@h/mlflow",
    )
    with pytest.raises(StackError) as raised:
        up(config)
    message = str(raised.value)
    assert (
        "--prefect-database 'mysql://u:***@h/prefect': Prefect's server runs on PostgreSQL or SQLite"
        in message
    )
    assert "--mlflow-database 'mssql://u:***@h/mlflow': tunepod runs MLflow's server on PostgreSQL" in message
    assert not (tmp_path / "home" / "stack").exists()


def test_up_says_how_to_get_boto3_for_s3_artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in: boto3 is installed in the test environment, so its absence is simulated in-process.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "boto3" else real(name))
    config = replace(StackConfig(home=tmp_path / "home", repo=REPO), mlflow_artifacts="s3://b/mlflow")
    with pytest.raises(StackError, match=r"--mlflow-artifacts s3://b/mlflow: .*pip install 'tunepod\[aws\]'"):
        up(config)


def test_a_study_storage_of_another_database_names_the_forms_that_work() -> None:
    spec = {
        "name": "x",
        "tracking": {"experiment": "x"},
        "steps": {
            "search": {
                "uses": "tune",
                "with": {
                    "train": {"entrypoint": "train.py"},
                    "num_trials": 2,
                    "study": {"name": "s", "storage": "mysql://u:hidden@h/optuna", "metric": "m"},
                    "space": {"x": {"type": "float", "low": 0, "high": 1}},
                },
            }
        },
    }
    refusal = r"storage 'mysql://u:\*\*\*@h/optuna' is not supported\n.*fix: use journal://<file>, "
    with pytest.raises(SpecError, match=refusal + r"sqlite:///<file> or postgresql://") as raised:
        parse_spec(yaml.safe_dump(spec), "spec.yaml", check_files=False)
    assert "hidden" not in str(raised.value)
