"""The receiver: verify a signed delivery, turn it into a Prefect event, answer the sender.

    POST /hooks/{hook}   202 accepted | 200 duplicate | 400 401 403 404 413 415 422 429
    GET  /healthz        200 {"status": "ok"}
    GET  /metrics        Prometheus text: tunepod_webhook_requests_total{hook, outcome}
    GET  /openapi.json   the schema (FastAPI)

The checks run cheapest and least trusting first: hook known (404), content type (415), size (413,
reading at most ``MAX_BODY_BYTES`` and stopping there), signature and timestamp (401), JSON (415), a
GitHub push's age (401), a body Prefect could never take (422: ``sendable``), an S3 object outside
the hook's allow list (403: ``allowlist``), already seen (200 duplicate), rate limit (429), overrides
naming an ``s3://`` URL outside the allow list (403), overrides valid against the spec (422), the
event within what Prefect keeps (422). An API key (scheme ``eventbridge``) is a header: it is checked
before anything else, so a caller without it never has a byte of its body read, let alone parsed. The
rate limit counts only authenticated, allowed, new deliveries: unsigned floods cannot spend a real
sender's budget, and a sender's retries of a delivery already accepted do not either.

"Already seen" asks the delivery log about a key the signature covers: ``webhook-id`` for Standard
Webhooks (signed with the body and the timestamp), the body's SHA-256 for GitHub, whose
``X-GitHub-Delivery`` is not signed (a captured body sent again under a new id is a duplicate; see
``signatures``). A 202 is given only to an event the publisher can send (``events.encode_event``
passes it), so a delivery accepted is never one that holds back the events after it.

202 means the delivery is on disk: its claim in the delivery log holds the event, which a publisher
(``publisher.py``; in a process of its own under ``tunepod webhook serve``, ``publisher_process.py``)
sends to Prefect at once, or as soon as Prefect answers again (a restarted receiver sends what the
last one had not). A sender never waits for Prefect, nor retries because of it.
Claims are atomic, so concurrent copies of one delivery produce one event; every copy after the first
is answered as a duplicate naming the first one's event.

Never logged nor echoed: secrets, signature headers. Logged: hook, delivery id, outcome, reason; the
delivery id and the reason (which may quote the body) are written with ``repr``, so a newline or other
control character a sender put in them cannot forge a log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, generate_latest

from tunepod.webhook.config import Hook, PayloadError, WebhookConfig
from tunepod.webhook.dedupe import DeliveryLog
from tunepod.webhook.events import EventUnsendable, OutgoingEvent, encode_event, event_name, hook_resource
from tunepod.webhook.publisher import Publisher
from tunepod.webhook.sendable import MAX_BODY_DEPTH, payload_problem
from tunepod.webhook.signatures import (
    API_KEY_HEADER,
    GITHUB_DELIVERY,
    GITHUB_SIGNATURE,
    TOLERANCE_S,
    WEBHOOK_ID,
    WEBHOOK_SIGNATURE,
    WEBHOOK_TIMESTAMP,
    SignatureError,
    check_event_time,
    check_github_push_age,
    eventbridge_dedupe_key,
    github_dedupe_key,
    verify_api_key,
    verify_github,
    verify_standard,
)
from tunepod.webhook.specs import SpecChecker

MAX_BODY_BYTES = 1024 * 1024
MAX_DELIVERY_ID_CHARS = 256
DEDUPE_FILE = "deliveries.sqlite3"
UNKNOWN_HOOK_LABEL = "<unknown>"  # one label for every unknown name: callers must not grow the metric

logger = logging.getLogger("tunepod.webhook")


@dataclass
class _Rejection(Exception):
    status: int
    outcome: str
    detail: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Delivery:
    """A verified delivery: ``key`` is what it is deduplicated by, covered by its signature;
    ``sender_id`` is the id its sender gave it (logs, the event's payload), which for GitHub is not."""

    key: str
    sender_id: str


class TokenBucket:
    """``per_min`` tokens a minute, bursts up to ``per_min``. Thread safe."""

    def __init__(self, per_min: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._capacity = float(per_min)
        self._per_s = per_min / 60.0
        self._tokens = float(per_min)
        self._clock = clock
        self._updated = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one will be."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._capacity, self._tokens + (now - self._updated) * self._per_s)
            self._updated = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self._per_s


def create_app(
    config: WebhookConfig,
    start_publisher: Callable[[DeliveryLog], Publisher],
    state_dir: Path,
    *,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The receiver app for ``config``'s hooks, its dedupe log under ``state_dir``.

    ``start_publisher`` starts what publishes the log's events: ``publisher.in_thread(sink)`` or
    ``publisher_process.in_process(api_url)``. ``registry`` receives the request counter (default:
    prometheus-client's global registry; apps created on one registry share its counter).
    """
    deliveries = DeliveryLog(state_dir / DEDUPE_FILE)
    publisher = start_publisher(deliveries)  # first, what an earlier receiver left
    receiver = _Receiver(
        config=config,
        deliveries=deliveries,
        publisher=publisher,
        buckets={name: TokenBucket(hook.rate_limit_per_min) for name, hook in config.hooks.items()},
        requests_total=requests_counter(REGISTRY if registry is None else registry),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        publisher.stop()

    app = FastAPI(
        title="tunepod webhook receiver",
        description="Verifies signed webhooks and turns them into Prefect events that start pipeline runs.",
        version="1",
        lifespan=lifespan,
    )
    app.state.publisher = publisher  # servers run without lifespan events stop it themselves
    _add_routes(app, receiver, REGISTRY if registry is None else registry)
    return app


def _add_routes(app: FastAPI, receiver: _Receiver, registry: CollectorRegistry) -> None:
    @app.post(
        "/hooks/{hook}",
        status_code=202,
        summary="Receive a signed delivery and start the hook's pipeline",
        responses=_RESPONSES,
        openapi_extra={"parameters": _SIGNATURE_HEADERS, "requestBody": _REQUEST_BODY},
    )
    async def receive(hook: str, request: Request) -> JSONResponse:
        return await receiver.handle(hook, request)

    @app.get("/healthz", summary="Liveness")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@dataclass
class _Receiver:
    config: WebhookConfig
    deliveries: DeliveryLog
    publisher: Publisher
    buckets: Mapping[str, TokenBucket]
    requests_total: Counter
    specs: SpecChecker = field(default_factory=SpecChecker)

    async def handle(self, name: str, request: Request) -> JSONResponse:
        hook = self.config.hooks.get(name)
        label = name if hook is not None else UNKNOWN_HOOK_LABEL
        try:
            if hook is None:
                raise _Rejection(404, "unknown_hook", f"no hook named {name[:64]!r}")
            status, outcome, content = await self._accept(hook, request)
        except _Rejection as rejection:
            self.requests_total.labels(hook=label, outcome=rejection.outcome).inc()
            logger.info(
                "webhook %s rejected %d %s: %r", label, rejection.status, rejection.outcome, rejection.detail
            )
            return JSONResponse({"detail": rejection.detail}, rejection.status, headers=rejection.headers)
        self.requests_total.labels(hook=label, outcome=outcome).inc()
        return JSONResponse(content, status)

    async def _accept(self, hook: Hook, request: Request) -> tuple[int, str, dict[str, Any]]:
        if hook.scheme == "eventbridge":
            delivery, payload = await self._keyed(hook, request)
        else:
            delivery, payload = await self._signed(hook, request)
        # Everything after the signature blocks (a walk over the body, SQLite and its fsync, spec
        # validation): one trip to a worker thread for all of it keeps the event loop free.
        return await run_in_threadpool(self._admit, hook, delivery, payload)

    async def _keyed(self, hook: Hook, request: Request) -> tuple[_Delivery, Any]:
        """An API key travels in a header and covers no byte of the body: checked first, so a caller
        without it is answered 401 whatever it sent, and its body is never read nor parsed."""
        try:
            verify_api_key(hook.secret_values(), request.headers)
        except SignatureError as exc:
            raise _Rejection(401, "unauthorized", str(exc)) from None
        _check_content_type(request.headers.get("content-type", ""))
        payload = _parse_json(await _read_limited(request, MAX_BODY_BYTES))
        return self._eventbridge_delivery(payload), payload

    async def _signed(self, hook: Hook, request: Request) -> tuple[_Delivery, Any]:
        """A signature covers the body, so the body is read (at most ``MAX_BODY_BYTES``) to check it,
        and parsed only once it passes."""
        _check_content_type(request.headers.get("content-type", ""))
        body = await _read_limited(request, MAX_BODY_BYTES)
        delivery = _verify(hook, request.headers, body)
        payload = _parse_json(body)
        if hook.scheme == "github":
            self._check_push_age(payload)
        return delivery, payload

    def _check_push_age(self, payload: Any) -> None:
        """401 for a GitHub push older than the dedupe window: a copy of it would no longer be
        recognized, so it may be a replay (GitHub signs no time; ``signatures``)."""
        try:
            check_github_push_age(payload, self.deliveries.ttl_s - TOLERANCE_S)
        except SignatureError as exc:
            raise _Rejection(401, "unauthorized", str(exc)) from None

    def _eventbridge_delivery(self, payload: Any) -> _Delivery:
        """The event's own id, once its time is within the dedupe window (401 otherwise: a copy of an
        older event would not be recognized, so it may be a replay)."""
        try:
            check_event_time(payload, self.deliveries.ttl_s - TOLERANCE_S)
            key = eventbridge_dedupe_key(payload)
        except SignatureError as exc:
            raise _Rejection(401, "unauthorized", str(exc)) from None
        sender_id = key.removeprefix("eventbridge:")
        if len(sender_id) > MAX_DELIVERY_ID_CHARS:
            raise _Rejection(
                400, "bad_delivery_id", f"the event id exceeds {MAX_DELIVERY_ID_CHARS} characters"
            )
        return _Delivery(key, sender_id)

    def _admit(self, hook: Hook, delivery: _Delivery, payload: Any) -> tuple[int, str, dict[str, Any]]:
        """Sendable, allowed, dedupe, rate limit, validate, claim: the checks after the signature."""
        _check_sendable(payload)  # first: a spec error quoting a lone surrogate could not even be answered
        # Before the delivery log is read: a forged body is refused whatever id it borrows, and it
        # spends no rate-limit token of the real sender.
        _check_allowed(hook.forbidden_body(payload))
        original = self.deliveries.event_for(hook.name, delivery.key)
        if original is not None:
            return self._duplicate(hook, delivery.sender_id, original)
        wait_s = self.buckets[hook.name].take()
        if wait_s > 0:
            detail = f"hook {hook.name} accepts {hook.rate_limit_per_min} deliveries a minute; retry later"
            raise _Rejection(429, "rate_limited", detail, {"Retry-After": str(max(1, math.ceil(wait_s)))})
        overrides = self._checked_overrides(hook, payload)
        event_id = str(uuid.uuid4())
        event = _event(hook, delivery.sender_id, overrides, payload)
        _check_encodes(event_id, event)
        original = self.deliveries.claim(hook.name, delivery.key, event_id, event)
        if original is not None:
            return self._duplicate(hook, delivery.sender_id, original)
        self.publisher.wake()
        logger.info("webhook %s accepted delivery %r as event %s", hook.name, delivery.sender_id, event_id)
        content = {"event_id": event_id, "hook": hook.name, "spec": hook.spec, "overrides": overrides}
        return 202, "accepted", content

    def _checked_overrides(self, hook: Hook, payload: Any) -> list[str]:
        """The hook's overrides filled from ``payload``, validated against its spec; 422 when they fail."""
        try:
            overrides = hook.render_overrides(payload)
        except PayloadError as exc:
            raise _Rejection(422, "invalid_overrides", str(exc)) from None
        _check_allowed(hook.forbidden_overrides(overrides))
        problem = self.specs.problem(hook.spec, overrides)
        if problem is not None:
            raise _Rejection(422, "invalid_overrides", problem)
        return overrides

    def _duplicate(self, hook: Hook, delivery_id: str, event_id: str) -> tuple[int, str, dict[str, Any]]:
        logger.info("webhook %s delivery %r is a duplicate of event %s", hook.name, delivery_id, event_id)
        return 200, "duplicate", {"duplicate": True, "event_id": event_id}


def _event(hook: Hook, delivery_id: str, overrides: list[str], payload: Any) -> dict[str, Any]:
    """The Prefect event a delivery becomes (what the deployment trigger reads), as the sink takes it."""
    return {
        "name": event_name(hook.name),
        "resource": hook_resource(hook.name),
        "payload": {
            "hook": hook.name,
            "delivery_id": delivery_id,
            "spec_path": hook.spec,
            "overrides": overrides,
            "body": payload,
        },
    }


def _check_allowed(problem: str | None) -> None:
    """403 for a delivery naming S3 data outside its hook's allow list (``allowlist``)."""
    if problem is not None:
        raise _Rejection(403, "forbidden", problem)


def _check_sendable(payload: Any) -> None:
    """422 for a body Prefect could never take (``sendable``), naming the value and the fix."""
    problem = payload_problem(payload, "payload", MAX_BODY_DEPTH)
    if problem is not None:
        raise _Rejection(422, "unsendable", f"the body cannot become a Prefect event: {problem}")


def _check_encodes(event_id: str, event: dict[str, Any]) -> None:
    """422 unless the publisher can send ``event``: the same check it makes (``encode_event``), so what
    is accepted is sent. Past ``_check_sendable`` only its size can fail it (numbers written in full),
    or an override a filter made (``urldecode`` of ``%00``)."""
    outgoing = OutgoingEvent(event_id, event["name"], event["resource"], event["payload"])
    try:
        encode_event(outgoing, datetime.now(UTC).isoformat())
    except EventUnsendable as exc:
        detail = f"the event this delivery becomes cannot be sent to Prefect: {exc.problem}"
        raise _Rejection(422, "unsendable", detail) from None


def _check_content_type(content_type: str) -> None:
    media_type = content_type.partition(";")[0].strip().lower()
    json_suffixed = media_type.startswith("application/") and media_type.endswith("+json")
    if media_type == "application/json" or json_suffixed:
        return
    shown = media_type[:80] or "none"
    raise _Rejection(415, "unsupported_media_type", f"expected Content-Type application/json, got {shown}")


async def _read_limited(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed ``limit`` (never reading more than that)."""
    declared = request.headers.get("content-length", "")
    too_large = _Rejection(413, "too_large", f"the body exceeds {limit} bytes")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _verify(hook: Hook, headers: Mapping[str, str], body: bytes) -> _Delivery:
    """The delivery, if signed with one of the hook's secrets; 401 otherwise (schemes standard, github)."""
    try:
        if hook.scheme == "github":
            sender_id = verify_github(hook.secret_values(), headers, body)
            key = github_dedupe_key(body)  # X-GitHub-Delivery is not signed: a replay may pick any
        else:
            sender_id = key = verify_standard(hook.secret_values(), headers, body)
    except SignatureError as exc:
        raise _Rejection(401, "unauthorized", str(exc)) from None
    if len(sender_id) > MAX_DELIVERY_ID_CHARS:
        detail = f"the delivery id exceeds {MAX_DELIVERY_ID_CHARS} characters"
        raise _Rejection(400, "bad_delivery_id", detail)
    return _Delivery(key, sender_id)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        reason = f": {exc}" if isinstance(exc, ValueError) else " (nested too deep)"
        detail = "the body is not JSON" + reason
        raise _Rejection(415, "unsupported_media_type", detail) from None


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; Python accepts them, Prefect's API would not.
    raise ValueError(f"{name} is not a JSON value")


# One counter per registry: creating a second app on the same registry (a restart inside one process,
# tests) must reuse it, because prometheus-client refuses to register a name twice.
_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()
_COUNTERS_LOCK = threading.Lock()


def requests_counter(registry: CollectorRegistry) -> Counter:
    with _COUNTERS_LOCK:
        if registry not in _COUNTERS:
            _COUNTERS[registry] = Counter(
                "tunepod_webhook_requests",
                "Webhook deliveries received, by hook and outcome.",
                ["hook", "outcome"],
                registry=registry,
            )
        return _COUNTERS[registry]


def _detail(description: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_DUPLICATE_SCHEMA = {
    "type": "object",
    "properties": {"duplicate": {"type": "boolean"}, "event_id": {"type": "string"}},
    "required": ["duplicate", "event_id"],
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Duplicate delivery: no new event; the id of the event its first copy produced.",
        "content": {"application/json": {"schema": _DUPLICATE_SCHEMA}},
    },
    202: {
        "description": "Accepted and on disk: the event that starts the pipeline run is published to "
        "Prefect at once, or as soon as Prefect answers."
    },
    400: _detail("Delivery id too long."),
    401: _detail(
        "Missing, invalid or stale signature or API key; a GitHub push or an EventBridge event older "
        "than the dedupe window."
    ),
    403: _detail(
        "The body names an S3 object (or its overrides an s3:// URL) outside the hook's allow list: "
        "refused, recorded nowhere, no run."
    ),
    404: _detail("No such hook."),
    413: _detail("Body over 1 MiB."),
    415: _detail("Not JSON (Content-Type or body)."),
    422: _detail(
        "The overrides this payload fills in fail spec validation, or the body holds what Prefect could "
        "never take (a number beyond a float, a lone surrogate, NUL, nesting past 128 levels, an event "
        "over its size limit)."
    ),
    429: _detail("Rate limit reached; see Retry-After."),
}
# The signature headers are documented in the schema only: the receiver reads the raw headers itself (a
# signature is checked over exact bytes, not over what a model parsed), so FastAPI need not parse them.
_SIGNATURE_HEADERS = [
    {"name": name, "in": "header", "required": False, "schema": {"type": "string"}}
    for name in (
        WEBHOOK_ID,
        WEBHOOK_TIMESTAMP,
        WEBHOOK_SIGNATURE,
        GITHUB_SIGNATURE,
        GITHUB_DELIVERY,
        API_KEY_HEADER,
    )
]
_REQUEST_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {"description": "The sender's JSON, signed as raw bytes."}}},
}
