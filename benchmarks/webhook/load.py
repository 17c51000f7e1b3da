"""The load generator: httpx (async) on 127.0.0.1, a fixed number of signed deliveries, at most
``concurrency`` in flight, each with a delivery id of its own; and the race of copies of one delivery.

A delivery is signed with the project's own ``standard_headers`` (what ``tunepod webhook sign``
prints) before its clock starts: the latency is the HTTP round trip only, from sending the request to
having read the whole response.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tunepod.webhook.events import EventSinkError, PrefectEventSink, event_name, hook_resource
from tunepod.webhook.signatures import standard_headers

#: What each delivery carries: the hook fills ``num_trials`` into its spec's overrides and validates it.
PAYLOAD = {"num_trials": 3, "note": "benchmark delivery", "source": "s3://bench/digits/v2"}
TIMEOUT_S = 30.0
#: The hook the sink-alone events are named after, and the status they count as (Prefect answers 204).
SINK_HOOK = "sink-alone"
PUBLISHED = 204
_DISTINCT = itertools.count(1)

Payloads = Callable[[], bytes]


@dataclass
class Load:
    """What one batch of deliveries to one server gave."""

    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    server_cpu_s: float = 0.0  # CPU time the server (and its publisher process) spent meanwhile

    def add(self, other: Load) -> None:
        self.latencies_ms += other.latencies_ms
        self.statuses += other.statuses
        self.errors += other.errors
        self.wall_s += other.wall_s
        self.server_cpu_s += other.server_cpu_s

    @property
    def requests(self) -> int:
        return len(self.latencies_ms) + len(self.errors)

    @property
    def throughput(self) -> float:
        return len(self.latencies_ms) / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def cpu_ms_per_delivery(self) -> float:
        return self.server_cpu_s * 1000 / self.requests if self.requests else math.nan


def body() -> bytes:
    """The same payload every time: the hook renders the same overrides for each delivery."""
    return json.dumps(PAYLOAD).encode()


def distinct_body() -> bytes:
    """A payload with a ``num_trials`` no other delivery of the run has: overrides seen only once."""
    return json.dumps({**PAYLOAD, "num_trials": next(_DISTINCT)}).encode()


def signed(secret: str, content: bytes, delivery_id: str | None = None) -> dict[str, str]:
    return {**standard_headers([secret], content, msg_id=delivery_id), "Content-Type": "application/json"}


async def deliver(url: str, secret: str, count: int, concurrency: int, payloads: Payloads = body) -> Load:
    """POST ``count`` signed deliveries of ``payloads()`` to ``url``, ``concurrency`` at a time, over
    kept-alive connections."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=TIMEOUT_S) as client:

        def next_delivery() -> Awaitable[int]:
            content = payloads()
            return _status(client.post(url, content=content, headers=signed(secret, content)))

        return await _drive(count, concurrency, next_delivery)


async def publish_events(api_url: str, count: int, concurrency: int) -> Load:
    """Publish ``count`` events the way the receiver does (``PrefectEventSink.publish`` in a worker
    thread, a shared httpx client), ``concurrency`` at a time: the sink's share of a delivery."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(limits=limits) as client:
        sink = PrefectEventSink(api_url, client, timeout_s=TIMEOUT_S)
        payload = {"hook": SINK_HOOK, "delivery_id": "", "spec_path": "", "overrides": [], "body": PAYLOAD}

        publish = functools.partial(sink.publish, event_name(SINK_HOOK), hook_resource(SINK_HOOK))

        def next_event() -> Awaitable[int]:
            return _published(asyncio.to_thread(publish, {**payload, "delivery_id": uuid.uuid4().hex}))

        return await _drive(count, concurrency, next_event)


async def _drive(count: int, concurrency: int, next_request: Callable[[], Awaitable[int]]) -> Load:
    """Await ``count`` requests from ``next_request``, ``concurrency`` at a time; each is prepared
    (built, signed) before its clock starts, and awaiting it sends it and gives its status."""
    load = Load()
    left = iter(range(count))  # shared by the workers: together they send exactly ``count``

    async def worker() -> None:
        for _ in left:
            request = next_request()
            started = time.perf_counter()
            try:
                status = await request
            except (httpx.HTTPError, EventSinkError) as exc:
                load.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            load.latencies_ms.append((time.perf_counter() - started) * 1000)
            load.statuses[status] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    load.wall_s = time.perf_counter() - started
    return load


async def _status(response: Awaitable[httpx.Response]) -> int:
    return (await response).status_code


async def _published(publishing: Awaitable[str]) -> int:
    await publishing
    return PUBLISHED


@dataclass(frozen=True)
class Race:
    """The answers to ``copies`` concurrent copies of one delivery."""

    delivery_id: str
    statuses: Counter[int]
    event_ids: frozenset[str]
    errors: tuple[str, ...]


async def race(url: str, secret: str, copies: int, delivery_id: str) -> Race:
    """Send ``copies`` byte-identical copies of one signed delivery at once, one connection each."""
    content = body()
    headers = signed(secret, content, delivery_id)
    limits = httpx.Limits(max_connections=copies)
    async with httpx.AsyncClient(limits=limits, timeout=TIMEOUT_S) as client:
        answers = await asyncio.gather(
            *(client.post(url, content=content, headers=headers) for _ in range(copies)),
            return_exceptions=True,
        )
    responses = [answer for answer in answers if isinstance(answer, httpx.Response)]
    errors = tuple(f"{type(a).__name__}: {a}" for a in answers if not isinstance(a, httpx.Response))
    return Race(
        delivery_id,
        Counter(response.status_code for response in responses),
        frozenset(_event_id(response) for response in responses),
        errors,
    )


def _event_id(response: httpx.Response) -> str:
    try:
        answer: Any = response.json()
    except ValueError:
        return f"<no JSON: {response.status_code}>"
    return str(answer.get("event_id")) if isinstance(answer, dict) else f"<{response.status_code}>"


def percentile(values: Sequence[float], q: int) -> float:
    """The ``q``-th percentile (1..99), interpolated between the two nearest samples."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
