"""Fixtures shared by the whole suite: a real Prefect API, and isolated stores per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from moto_server import MotoServer, moto_server
from slurm_cluster import apply_slurm_marker

REPO = Path(__file__).resolve().parents[1]

# Quiet, hermetic Prefect: no telemetry (it races the test server's SQLite), no colour codes in logs.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_COLORS", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """A real Prefect server (temporary database) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    """A moto server (real HTTP, real botocore) shared by the tests of one module."""
    with moto_server() as server:
        yield server


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the repository root, where spec paths such as examples/... resolve."""
    monkeypatch.chdir(REPO)
    return REPO


@pytest.fixture
def isolated_overrides(tmp_path: Path) -> list[str]:
    """--set overrides that keep a spec's stores and shared root inside the test's temp folder."""
    return [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"launcher.root={tmp_path}/shared",
    ]


def pytest_runtest_setup(item: pytest.Item) -> None:
    apply_slurm_marker(item)
