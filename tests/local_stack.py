"""One local stack for the whole session, on production stores, shared by tests/e2e/test_ui.py and
tests/integration/test_stack.py (the ``local_stack`` fixture of tests/conftest.py).

`python -m tunepod.stack up` on free ports, state under tmp, with the Prefect server and the MLflow
server on databases of their own in the real PostgreSQL of `scripts/postgres-up`, and MLflow's
artifacts in a bucket of a real moto S3 server: the production layout (RDS, S3) on one machine.
Starting a stack costs a minute or more on 2 cores, so every test that needs one shares this one; tests
that use it run on one pytest worker (conftest groups them), the UI tests first (collection order), the
stack tests' `down` last.

The receiver serves deployments/webhooks.yaml's hooks (their secrets exported) plus the hook ``ui``
(its secret not exported: `up` generates it), whose overrides give the digits spec a tiny budget, track
in the stack's MLflow server and keep the Optuna study in PostgreSQL too.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from moto_server import REGION, MotoServer, moto_server
from ports import free_port
from postgres import fresh_database

from tunepod.stack.processes import ServiceRecord, group_members, is_alive

REPO = Path(__file__).resolve().parents[1]
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"tunepod-stack-test-secret-24").decode()
UI_HOOK = "ui"
UI_SECRET_ENV = "TUNEPOD_HOOK_UI_SECRET"
ARTIFACT_BUCKET = "tunepod-mlflow"


@dataclass(frozen=True)
class Stack:
    home: Path
    env: dict[str, str]
    prefect_url: str
    mlflow_url: str
    webhook_url: str
    first_up: str
    """What the first `up` printed (stdout and stderr)."""
    databases: dict[str, str]
    """``prefect``, ``mlflow``, ``optuna``: the PostgreSQL URL of each store."""
    s3: MotoServer

    @property
    def api(self) -> str:
        return f"{self.prefect_url}/api"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tunepod.stack", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    def records(self) -> dict[str, ServiceRecord]:
        found = {p.stem: ServiceRecord.read(p) for p in sorted((self.home / "stack").glob("*.json"))}
        return {name: record for name, record in found.items() if record is not None}

    def artifact_keys(self) -> list[str]:
        """Every object key in the MLflow server's artifact bucket."""
        pages = self.s3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=ARTIFACT_BUCKET)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]


def example_secret_variables() -> list[str]:
    """The variables deployments/webhooks.yaml reads its hooks' secrets from (all exported here)."""
    config = yaml.safe_load((REPO / "deployments" / "webhooks.yaml").read_text())
    hooks = config["hooks"].values()
    return [source["env"] for hook in hooks for source in hook["secrets"] if "env" in source]


def write_webhook_config(path: Path, tmp: Path, mlflow_url: str, optuna_db: str) -> None:
    """deployments/webhooks.yaml's hooks, and the hook ``ui`` (the digits spec on a tiny budget)."""
    config = yaml.safe_load((REPO / "deployments" / "webhooks.yaml").read_text())
    overrides = [
        "steps.search.with.num_trials={payload.num_trials}",
        "steps.search.with.train.args.epochs=2",
        # One process a trial (started without torchrun): the UI tests are about the UIs.
        "steps.search.with.train.resources.procs_per_node=1",
        "steps.check.with.top_k=1",
        f"tracking.uri={mlflow_url}",
        f"launcher.root={tmp}/shared",
        f"steps.search.with.study.storage={optuna_db}",
    ]
    config["hooks"][UI_HOOK] = {
        "spec": "examples/digits/pipeline.yaml",
        "secrets": [{"env": UI_SECRET_ENV}],
        "overrides": overrides,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@contextlib.contextmanager
def running_stack(tmp: Path) -> Iterator[Stack]:
    """Start the stack (databases, bucket, `up`); on exit `down` it and check no process is left."""
    with contextlib.ExitStack() as resources:
        databases = {
            name: resources.enter_context(fresh_database(f"stack_{name}"))
            for name in ("prefect", "mlflow", "optuna")
        }
        s3 = resources.enter_context(moto_server())
        s3.client("s3").create_bucket(Bucket=ARTIFACT_BUCKET)
        yield resources.enter_context(_started(tmp, databases, s3))


@contextlib.contextmanager
def _started(tmp: Path, databases: dict[str, str], s3: MotoServer) -> Iterator[Stack]:
    home = tmp / "tunepod"
    ports = {name: free_port() for name in ("PREFECT", "MLFLOW", "WEBHOOK")}
    host = "http://127.0.0.1"
    mlflow_url = f"{host}:{ports['MLFLOW']}"
    webhook_config = tmp / "webhooks.yaml"
    write_webhook_config(webhook_config, tmp, mlflow_url, databases["optuna"])
    env = {
        **{name: value for name, value in os.environ.items() if name != UI_SECRET_ENV},
        "TUNEPOD_HOME": str(home),
        # One MLflow worker, as an operator sets it (`up --mlflow-workers`): each costs a full start.
        "TUNEPOD_MLFLOW_WORKERS": "1",
        "COLUMNS": "250",
        **{f"TUNEPOD_{name}_PORT": str(port) for name, port in ports.items()},
        # In the environment, as an operator would keep them: a later `up` (after a fault) reuses them.
        "TUNEPOD_PREFECT_DATABASE": databases["prefect"],
        "TUNEPOD_MLFLOW_DATABASE": databases["mlflow"],
        "TUNEPOD_MLFLOW_ARTIFACTS": f"s3://{ARTIFACT_BUCKET}/mlflow",
        "TUNEPOD_WEBHOOK_CONFIG": str(webhook_config),
        "MLFLOW_S3_ENDPOINT_URL": s3.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        **{name: WEBHOOK_SECRET for name in example_secret_variables()},
    }
    probe = Stack(
        home, env, f"{host}:{ports['PREFECT']}", mlflow_url, f"{host}:{ports['WEBHOOK']}", "", databases, s3
    )
    first = probe.cli("up")
    stack = Stack(**{**probe.__dict__, "first_up": first.stdout + first.stderr})
    try:
        assert first.returncode == 0, stack.first_up
        yield stack
    finally:
        records = stack.records()
        stopped = stack.cli("down")  # nothing, when the stack tests' `down` ran
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        left = {name: group_members(r.pid) for name, r in records.items() if group_members(r.pid)}
        left |= {name: [r.pid] for name, r in records.items() if is_alive(r)}
        assert not left, f"processes left after down: {left}"
