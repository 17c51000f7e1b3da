"""Where the receiver's events go: a real Prefect server, and counting the events it stored.

By default a temporary one, started with Prefect's test harness (``prefect_test_harness``: a
``uvicorn`` subprocess of Prefect's server on a SQLite file, with its event persister); or a server
already running (``--prefect-api``). Prefect stores events in batches (every 20 events, or every
``flush_interval``), in the order they arrived: once an event sent last is stored, every event sent
before it is stored too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tunepod.webhook.events import event_name

#: The temporary server flushes a partial batch of events after this many seconds (Prefect's default
#: is 5); during the load every flush is of a full batch, so this only shortens the waits between rounds.
FLUSH_INTERVAL_S = "1"
FLUSH_SETTING = "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL"


@contextmanager
def prefect_api(url: str | None, startup_timeout_s: int = 120) -> Iterator[str]:
    """The API URL of the server at ``url``, or of a temporary one for the duration."""
    if url:
        yield url.rstrip("/")
        return
    # The server subprocess inherits these; no telemetry (it races the server's SQLite, as in tests).
    os.environ.setdefault(FLUSH_SETTING, FLUSH_INTERVAL_S)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=startup_timeout_s):
        yield str(PREFECT_API_URL.value()).rstrip("/")


def stored_events(client: httpx.Client, api_url: str, hook: str, limit: int = 50) -> tuple[int, list[Any]]:
    """How many events of ``hook`` Prefect has stored, and the newest ``limit`` of them."""
    query = {"filter": {"event": {"name": [event_name(hook)]}, "order": "DESC"}, "limit": limit}
    answer = client.post(f"{api_url}/events/filter", json=query, timeout=30)
    answer.raise_for_status()
    page = answer.json()
    return int(page["total"]), list(page["events"])


def wait_for_event(client: httpx.Client, api_url: str, hook: str, event_id: str, timeout_s: float) -> None:
    """Return once Prefect has stored event ``event_id`` of ``hook``; ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while event_id not in {event["id"] for event in stored_events(client, api_url, hook)[1]}:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Prefect did not store event {event_id} of {hook} in {timeout_s:.0f} s")
        time.sleep(0.1)


def wait_until_stored(client: httpx.Client, api_url: str, hook: str, count: int, timeout_s: float) -> float:
    """Seconds until Prefect has stored ``count`` events of ``hook``; raises ``TimeoutError`` after
    ``timeout_s``."""
    started = time.monotonic()
    while True:
        total, _ = stored_events(client, api_url, hook, limit=1)
        if total >= count:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"Prefect stored {total} of {count} events of {hook} in {timeout_s:.0f} s")
        time.sleep(0.1)
