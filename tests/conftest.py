"""Fixtures shared by the whole suite: a real Prefect API, and isolated stores per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_stack import Stack, running_stack
from moto_server import MotoServer, moto_server
from prefect_server import drain_prefect_clients, shared_server, stop_shared_server
from slurm_cluster import apply_slurm_marker

REPO = Path(__file__).resolve().parents[1]

# Quiet, hermetic Prefect: no telemetry (it races the test server's SQLite), no colour codes in logs.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_COLORS", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


@pytest.fixture(scope="session")
def prefect_api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A real Prefect server (a new database) for the whole session, one for all workers
    (tests/prefect_server.py); this process's Prefect client points at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    base = tmp_path_factory.getbasetemp()
    api_url = shared_server(base.parent if hasattr(request.config, "workerinput") else base)
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        yield
        drain_prefect_clients()


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`tunepod up` on PostgreSQL and S3 (tests/local_stack.py), for every test that needs a stack."""
    with running_stack(tmp_path_factory.mktemp("stack")) as stack:
        yield stack


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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``pytest -n N --dist loadgroup`` (what `make test` runs): a module's tests stay on one
    worker, so a module-scoped server (moto) starts once; the tests that use the session's local
    stack share a worker, so it starts once; every Slurm test of this host's node shares one group, so
    tests never queue behind each other on that node, nor see its sshd stopped by the
    head-node-unreachable test; the tests of the namespaced nodes share another, since some of them
    kill a node that another's job could be running on. Under xdist the groups are then ordered
    longest first (see ``_longest_groups_first``)."""
    groups = {item.nodeid: _group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    if config.getoption("dist", "no") != "no" or hasattr(config, "workerinput"):
        items[:] = _longest_groups_first(items, groups)


def _group(item: pytest.Item) -> str:
    if item.get_closest_marker("slurm_nodes"):
        return "slurm-nodes"
    if item.get_closest_marker("slurm"):
        return "slurm"
    if "local_stack" in getattr(item, "fixturenames", ()):
        return "local-stack"
    return item.nodeid.split("::")[0]


# Rough seconds a test takes here, by where it lives: what orders the groups, not a limit.
_EXPECTED_S = {"tests/e2e/": 45.0, "tests/integration/": 6.0}
_UNIT_S = 0.3


def _longest_groups_first(items: list[pytest.Item], groups: dict[str, str]) -> list[pytest.Item]:
    """The items with their groups in order of expected length, longest first (tests keep their order
    within a group). xdist hands groups out in the order they first appear (with
    --no-loadscope-reorder; by default it puts the groups of many tests first, so the slowest groups of
    few tests - the chaos soak, the fault tests - would start last and run alone at the end). With
    three workers on two cores, longest first lets the short unit tests fill the gaps at the end."""
    expected: dict[str, float] = {}
    for item in items:
        seconds = next((s for prefix, s in _EXPECTED_S.items() if item.nodeid.startswith(prefix)), _UNIT_S)
        if item.get_closest_marker("slow"):
            seconds = max(seconds, _EXPECTED_S["tests/e2e/"])
        expected[groups[item.nodeid]] = expected.get(groups[item.nodeid], 0.0) + seconds
    return sorted(items, key=lambda item: -expected[groups[item.nodeid]])  # stable: order within kept


def pytest_configure(config: pytest.Config) -> None:
    # pytest 9.2 keeps node ids where pytest-xdist 3.8 cannot add the group to them: loadgroup would
    # silently scatter a module's tests (and the Slurm tests) over both workers.
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple[:2] >= (9, 2):
        raise pytest.UsageError(
            f"--dist loadgroup does not group tests with pytest {pytest.__version__}: install the "
            "pytest pyproject.toml names (`make test` does), or run the tests without -n"
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    # The process that is not an xdist worker (or the only one) outlives every test: it stops the
    # session's Prefect server, which the first worker that needed it started.
    if not hasattr(session.config, "workerinput"):
        stop_shared_server(session.config._tmp_path_factory.getbasetemp())  # as xdist reads it
