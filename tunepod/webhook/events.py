"""Where an accepted delivery goes: a Prefect event, which a deployment trigger turns into a flow run.

The receiver posts ``tunepod.webhook.<hook>`` with the payload below; a trigger in
``deployments/prefect.yaml`` matching that event name starts ``flows/pipeline.py:pipeline`` with
``spec_path`` and ``overrides`` taken from ``event.payload``:

    {"hook": "s3-upload", "delivery_id": "msg_...", "spec_path": "examples/digits/pipeline.yaml",
     "overrides": ["steps.data.with.source=\\"s3://bucket/key\\""], "body": {...the sender's JSON...}}

This module talks to Prefect's REST API with httpx (``POST {api}/events``) so that ``tunepod`` itself
never imports Prefect. ``encode_event`` writes an event as it is posted, and refuses one Prefect could
never take (``sendable``): the receiver calls it before it accepts a delivery, the sink before it sends.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx
import pydantic_core

from tunepod.errors import TransientError, TunepodError
from tunepod.webhook.sendable import payload_problem, size_problem

EVENT_PREFIX = "tunepod.webhook."


def event_name(hook: str) -> str:
    return EVENT_PREFIX + hook


def hook_resource(hook: str) -> dict[str, str]:
    """The resource an event of ``hook`` is about (what Prefect's UI lists and triggers can match)."""
    return {"prefect.resource.id": event_name(hook), "prefect.resource.name": hook}


def prefect_auth(environ: Mapping[str, str] = os.environ) -> httpx.BasicAuth | None:
    """Basic auth for a self-hosted Prefect behind it: the setting Prefect's own client reads,
    ``PREFECT_API_AUTH_STRING`` (``user:password``); None without it."""
    auth_string = environ.get("PREFECT_API_AUTH_STRING", "")
    if not auth_string:
        return None
    user, _, password = auth_string.partition(":")
    return httpx.BasicAuth(user, password)


class EventSinkError(TransientError):
    """The event could not be published; the receiver's publisher keeps it and tries again."""


class EventRefused(TunepodError):
    """Prefect answered that the event itself is invalid (400, 413, 422): sending it again cannot
    change that, so the publisher sets it aside instead of holding back every event after it."""


class EventUnsendable(EventRefused):
    """The event is one Prefect could never take (see ``sendable``): it is not even sent, and the
    publisher sets it aside like one Prefect refused. ``problem`` says what is wrong, and where."""

    def __init__(self, event_id: str, problem: str) -> None:
        self.problem = problem
        super().__init__(f"event {event_id} cannot be sent to Prefect: {problem}")


# 401/403/404 are not among them: a wrong API key or URL is fixed by the operator, and then every
# event kept meanwhile must still go through.
REFUSED_STATUSES = frozenset({400, 413, 422})


@dataclass(frozen=True)
class OutgoingEvent:
    """An event to publish: its id (the one the sender was given), name, resource and payload."""

    event_id: str
    name: str
    resource: Mapping[str, str]
    payload: Mapping[str, Any]


class EventSink(Protocol):
    """Publishes events. Implementations must be safe to call from several threads at once."""

    def publish_all(self, events: Sequence[OutgoingEvent]) -> None:
        """Publish every event in ``events``, in one request where the backend takes several.

        Raises ``EventSinkError`` when they were not published, ``EventRefused`` when they never can
        be (one invalid event can refuse the whole request: publish one at a time to find it).
        """
        ...


class PrefectEventSink:
    """Posts events to a Prefect server's REST API (``api_url`` as in ``PREFECT_API_URL``).

    The httpx ``client`` is owned by the caller (it closes it); httpx clients are thread safe.
    """

    def __init__(self, api_url: str, client: httpx.Client, *, timeout_s: float = 10.0) -> None:
        self.api_url = api_url.rstrip("/")
        self._client = client
        self._timeout_s = timeout_s

    def publish(
        self,
        name: str,
        resource: Mapping[str, str],
        payload: Mapping[str, Any],
        event_id: str | None = None,
    ) -> str:
        """Publish one event (with ``event_id``, or a new uuid4) and return its id."""
        event_id = event_id or str(uuid.uuid4())
        self.publish_all([OutgoingEvent(event_id, name, resource, payload)])
        return event_id

    def publish_all(self, events: Sequence[OutgoingEvent]) -> None:
        occurred = datetime.now(UTC).isoformat()
        body = b"[" + b",".join(encode_event(event, occurred) for event in events) + b"]"
        names = ", ".join(sorted({event.name for event in events}))
        url = f"{self.api_url}/events"
        try:
            response = self._client.post(
                url, content=body, headers={"Content-Type": "application/json"}, timeout=self._timeout_s
            )
        except httpx.HTTPError as exc:
            raise EventSinkError(f"could not reach the Prefect API at {url}: {exc}") from exc
        if response.status_code in REFUSED_STATUSES:
            raise EventRefused(
                f"the Prefect API at {url} refused event {names} with {response.status_code}: "
                f"{response.text[:500]}"
            )
        if not response.is_success:
            raise EventSinkError(
                f"the Prefect API at {url} answered {response.status_code} to event {names}: "
                f"{response.text[:500]}"
            )


def encode_event(event: OutgoingEvent, occurred: str) -> bytes:
    """``event`` as JSON, the way it is posted to Prefect's API, ``occurred`` at that ISO 8601 time.

    Raises ``EventUnsendable`` for an event Prefect could never take: a payload ``sendable`` finds a
    problem in, or an event over ``sendable.MAX_EVENT_BYTES``. Written by pydantic, as Prefect's server
    writes it again, so that the size measured is the one Prefect measures.
    """
    problem = payload_problem(event.payload, "payload")
    if problem is not None:
        raise EventUnsendable(event.event_id, problem)
    wire = {
        "id": event.event_id,
        "occurred": occurred,
        "event": event.name,
        "resource": dict(event.resource),
        "related": [],
        "payload": dict(event.payload),
    }
    try:
        encoded = pydantic_core.to_json(wire)
    except ValueError as exc:  # PydanticSerializationError: what the check above did not foresee
        raise EventUnsendable(event.event_id, f"it cannot be written as JSON: {exc}") from None
    problem = size_problem(len(encoded))
    if problem is not None:
        raise EventUnsendable(event.event_id, problem)
    return encoded
