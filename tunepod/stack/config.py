"""Where the local stack keeps its state and which ports it listens on."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOME = ".tunepod"
WORK_POOL = "tunepod-local"
DEFAULT_WEBHOOK_CONFIG = Path("deployments/webhooks.yaml")
DEFAULT_PREFECT_FILE = Path("deployments/prefect.yaml")


def default_mlflow_workers() -> int:
    """MLflow's own default (4), but no more than this machine's cores: each worker is a process that
    imports MLflow (about 17 s of CPU on 2 loaded cores) and serves in Python, so workers beyond the
    cores cost start-up time and memory and add no throughput."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class StackConfig:
    """One local stack: its state folder, the repository it serves, its ports.

    Everything the stack writes lives under ``home``: ``stack/`` (one record per running service),
    ``logs/``, ``prefect/`` (``PREFECT_HOME``, with Prefect's SQLite database), ``mlflow.db`` and
    ``mlartifacts/`` (the MLflow server's stores, unless ``mlflow_database``/``mlflow_artifacts`` put them
    elsewhere), ``webhook/`` (the receiver's delivery ids),
    ``secrets/`` (hook secrets generated for variables the user did not export).
    """

    home: Path
    """State folder (made absolute on construction, as is ``repo``)."""
    repo: Path
    """Repository root: the services' working directory, where ``deployments/`` and ``flows/`` are."""
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    webhook_port: int = 8787
    work_pool: str = WORK_POOL
    python: str = sys.executable
    """Interpreter that runs every service: the one tunepod is installed in."""
    startup_timeout_s: float = 180.0
    """How long ``up`` waits for one service's health check (Prefect's server takes ~24 s on 2 cores)."""
    webhook_config: Path = DEFAULT_WEBHOOK_CONFIG
    """The receiver's hooks (``tunepod webhook serve --config``); relative paths are from ``repo``."""
    prefect_file: Path = DEFAULT_PREFECT_FILE
    """What ``deploy`` registers (``prefect deploy --prefect-file``); relative paths are from ``repo``."""
    prefect_database: str | None = None
    """The Prefect server's database (``postgresql://...``); default: SQLite under ``prefect_home``."""
    mlflow_database: str | None = None
    """The MLflow server's backend store (``postgresql://...``); default: ``<home>/mlflow.db``."""
    mlflow_artifacts: str | None = None
    """Where the MLflow server keeps artifacts (``s3://bucket/prefix``); default: ``<home>/mlartifacts``."""
    mlflow_workers: int = field(default_factory=default_mlflow_workers)
    """The MLflow server's worker processes (``mlflow server --workers``)."""

    def __post_init__(self) -> None:
        # Absolute paths: the services run with cwd=repo and later commands may run from elsewhere.
        object.__setattr__(self, "home", Path(self.home).expanduser().resolve())
        object.__setattr__(self, "repo", Path(self.repo).expanduser().resolve())
        for name in ("webhook_config", "prefect_file"):
            object.__setattr__(self, name, self.repo / Path(getattr(self, name)).expanduser())

    @property
    def records_dir(self) -> Path:
        return self.home / "stack"

    @property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def prefect_home(self) -> Path:
        return self.home / "prefect"

    @property
    def prefect_url(self) -> str:
        """The Prefect UI; the API is ``prefect_api_url``."""
        return f"http://{self.host}:{self.prefect_port}"

    @property
    def prefect_api_url(self) -> str:
        return f"{self.prefect_url}/api"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def webhook_url(self) -> str:
        return f"http://{self.host}:{self.webhook_port}"
