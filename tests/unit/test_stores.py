"""Database URLs as users write them, and the errors `tunepod up` and the spec give for unusable stores."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tunepod.errors import SpecError
from tunepod.spec.loader import dump_spec, load_spec, parse_spec, shown_override
from tunepod.stack.config import StackConfig
from tunepod.stack.manage import StackError, up
from tunepod.stack.services import mlflow_server, prefect_server
from tunepod.stores import (
    StoreUrlError,
    is_secret_name,
    prefect_database_url,
    redacted,
    secret_values,
    shown_env,
    sync_sqlalchemy_url,
)

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


@pytest.mark.parametrize(
    "name",
    ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "HF_TOKEN", "WANDB_API_KEY", "APIKEY", "DB_PASSWORD",
     "AWS_SESSION_TOKEN", "GITHUB_PAT", "MYSQL_PASSWD", "SENTRY_DSN", "NPM_AUTH", "hf_token", "GH-CREDS"],
)  # fmt: skip
def test_a_credentials_name_is_secret(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["TOKENIZERS_PARALLELISM", "PYTHONPATH", "MLFLOW_TRACKING_URI", "TUNEPOD_PARAMS", "KEYRING_BACKEND",
     "NCCL_DEBUG", "MASTER_PORT", "OMP_NUM_THREADS", "TUNEPOD_SUBMISSION_ID", "PWD"],
)  # fmt: skip
def test_an_ordinary_setting_is_no_secret(name: str) -> None:
    assert not is_secret_name(name)


def test_shown_env_hides_credentials_and_url_passwords_and_keeps_the_rest() -> None:
    env = {"HF_TOKEN": "hf_x1y2z3", "DATABASE_URL": "postgresql://u:pw1234@db/x", "NCCL_DEBUG": "INFO"}
    assert shown_env(env) == {
        "HF_TOKEN": "***",
        "DATABASE_URL": "postgresql://u:***@db/x",
        "NCCL_DEBUG": "INFO",
    }


def test_secret_values_reads_env_mappings_only() -> None:
    """A key named like a secret outside an ``env`` mapping is a setting (secret_env's ``key``)."""
    document = {
        "launcher": {
            "env": {"HF_TOKEN": "hf_x1y2z3", "NCCL_DEBUG": "INFO"},
            "secret_env": {"WANDB_API_KEY": {"secret": "wandb", "key": "api-key"}},
        },
        "steps": [{"env": {"DB_PASSWORD": "pw-98765"}}],
    }
    assert sorted(secret_values(document)) == ["hf_x1y2z3", "pw-98765"]


def test_redacted_hides_secret_values_as_written_and_as_json_escapes_them() -> None:
    value = 'p"w\\1234'
    text = f"raw {value} json {json.dumps(value)} short abc"
    assert redacted(text, values=[value, "abc"]) == 'raw *** json "***" short abc'


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        ("launcher.env.HF_TOKEN=hf_x1y2z3", "launcher.env.HF_TOKEN=***"),
        ("launcher.env={HF_TOKEN: hf_x1y2z3, DEBUG: '1'}", "launcher.env={HF_TOKEN: ***, DEBUG: '1'}"),
        ("launcher.env={HF_TOKEN: hf_x1y2z3, A: [}", "launcher.env={HF_TOKEN: ***, A: [}"),
        ("tracking.uri=postgresql://u:pw1234@db/x", "tracking.uri=postgresql://u:***@db/x"),
        ("steps.search.with.num_trials=20", "steps.search.with.num_trials=20"),
    ],
)
def test_an_override_shows_no_credential(override: str, shown: str) -> None:
    assert shown_override(override) == shown


def test_the_resolved_spec_logged_to_mlflow_shows_no_credential_of_launcher_env() -> None:
    spec = load_spec(
        REPO / "examples/digits/pipeline-slurm.yaml", ["launcher.env.HF_TOKEN=hf_dumpTokenValue"]
    )
    dumped = yaml.safe_load(dump_spec(spec))
    assert dumped["launcher"]["env"]["HF_TOKEN"] == "***"
    assert "hf_dumpTokenValue" not in dump_spec(spec)
