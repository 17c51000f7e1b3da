"""Fuzz the receiver from its own OpenAPI schema: whatever a client sends, it never answers 5xx.

Schemathesis generates paths, headers (the declared signature headers included) and bodies. Each case
is sent twice: as generated (mostly unsigned, so it exercises the 401/404/415 paths), and signed with
the hook's real secret for the ``fuzz`` hook (so random payloads reach JSON parsing, the payload ->
override mapping, spec validation and, when one happens to be valid, the Prefect event). Bounded and
derandomized so that CI stays fast and a failure reproduces.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from prometheus_client import CollectorRegistry
from schemathesis.checks import not_a_server_error

from tunepod.webhook.app import create_app
from tunepod.webhook.config import load_webhook_config
from tunepod.webhook.events import PrefectEventSink
from tunepod.webhook.publisher import in_thread
from tunepod.webhook.signatures import new_standard_secret, standard_headers

if TYPE_CHECKING:
    from starlette.testclient import TestClient

SECRET = new_standard_secret()
REGISTRY = CollectorRegistry()


@pytest.fixture
def fuzzed_app(prefect_api: None, in_repo: Path, tmp_path: Path) -> Iterator[Any]:
    from prefect.settings import PREFECT_API_URL

    hooks = {
        "fuzz": {
            "spec": "examples/digits/pipeline.yaml",
            "secrets": [{"env": "FUZZ_SECRET"}],
            "rate_limit_per_min": 10_000,
            "overrides": [
                "steps.search.with.num_trials={payload.n}",
                "tracking.experiment=fuzz-{payload.tag}",
            ],
        }
    }
    config_file = tmp_path / "webhooks.yaml"
    config_file.write_text(yaml.safe_dump({"hooks": hooks}))
    config = load_webhook_config(config_file, {"FUZZ_SECRET": SECRET})
    with httpx.Client(timeout=30) as http:
        sink = PrefectEventSink(str(PREFECT_API_URL.value()), http)
        yield create_app(config, in_thread(sink), tmp_path / "state", registry=REGISTRY)


FUZZ_SETTINGS = settings(
    max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


def test_no_request_makes_the_receiver_fail(fuzzed_app: Any) -> None:
    with warnings.catch_warnings():
        # Schemathesis's ASGI transport is starlette's TestClient, which warns that it prefers httpx2.
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    # The schema is loaded inside the test (not with schemathesis.pytest.from_fixture, which fails
    # under pytest 9: it reads the private Function._nodeid).
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {operation.label for operation in operations}
    assert labels >= {"POST /hooks/{hook}", "GET /healthz", "GET /metrics"}
    with TestClient(fuzzed_app, raise_server_exceptions=False) as client:
        for operation in operations:
            _fuzz(operation, client)
    # The signed copies got past the signature check, so the fuzz reached the payload handling.
    outcomes = {
        sample.labels["outcome"]
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name == "tunepod_webhook_requests_total"
    }
    assert {"unknown_hook", "unauthorized", "invalid_overrides"} <= outcomes


def _fuzz(operation: Any, client: TestClient) -> None:
    check = _fuzz_hook if operation.path == "/hooks/{hook}" else _fuzz_as_generated

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy())
    def run(case: Any) -> None:
        check(case, client)

    run()


def _fuzz_as_generated(case: Any, client: TestClient) -> None:
    case.call_and_validate(checks=[not_a_server_error])


def _fuzz_hook(case: Any, client: TestClient) -> None:
    """The case as generated (random hook: 404), at the real hook (random headers: 401), then signed."""
    case.call_and_validate(checks=[not_a_server_error])
    case.path_parameters["hook"] = "fuzz"
    case.call_and_validate(checks=[not_a_server_error])
    body = json.dumps(case.body).encode()
    headers = {**standard_headers([SECRET], body), "Content-Type": "application/json"}
    answer = client.post("/hooks/fuzz", content=body, headers=headers)
    assert answer.status_code in (202, 415, 422), answer.text
