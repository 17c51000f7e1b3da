"""The webhook receiver as senders meet it: a real uvicorn server on a loopback port, a real httpx
client, events posted to the real Prefect API of the ``prefect_api`` fixture and read back from it.

Covers every answer of POST /hooks/{hook} (202, 200 duplicate, 401, 404, 413, 415, 422, 429),
dedupe across a restart, secrets kept out of logs and responses, startup checks of the configuration,
metrics, and the ``sign`` / ``serve`` commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI
from moto_server import MotoServer
from ports import free_port
from prometheus_client import CollectorRegistry
from tcp_forward import forwarding

from tunepod.launch.procfs import read_process_stat
from tunepod.spec.loader import load_spec
from tunepod.webhook.app import DEDUPE_FILE, MAX_BODY_BYTES, create_app
from tunepod.webhook.config import (
    PayloadError,
    WebhookConfig,
    WebhookConfigError,
    load_webhook_config,
    parse_webhook_config,
)
from tunepod.webhook.dedupe import DEFAULT_TTL_S as DEDUPE_TTL_S
from tunepod.webhook.dedupe import DeliveryLog
from tunepod.webhook.events import (
    EventRefused,
    EventSinkError,
    OutgoingEvent,
    PrefectEventSink,
    hook_resource,
)
from tunepod.webhook.publisher import EventPublisher, in_thread
from tunepod.webhook.signatures import (
    API_KEY_HEADER,
    MIN_API_KEY_CHARS,
    github_headers,
    new_standard_secret,
    standard_headers,
)

SECRET = new_standard_secret()
OLD_SECRET = "an-older-raw-secret"
GITHUB_SECRET = "github-hook-secret"
API_KEY = "eventbridge-connection-key-0123456789"
SECRETS = (SECRET, OLD_SECRET, GITHUB_SECRET)
SPEC = "examples/digits/pipeline.yaml"
ALLOWED_BUCKET = "training-data"  # the s3eb hook's allow list: this bucket, under digits/


# ---------------------------------------------------------------------------------------------- fixtures


def write_config(folder: Path) -> Path:
    (folder / "old-secret").write_text(f"\n{OLD_SECRET}\n")
    hooks = {
        "digits": {
            "spec": SPEC,
            "secrets": [{"env": "TEST_DIGITS_SECRET"}, {"file": str(folder / "old-secret")}],
            "overrides": ["steps.search.with.num_trials={payload.num_trials}"],
        },
        "gh": {
            "spec": SPEC,
            "scheme": "github",
            "secrets": [{"env": "TEST_GITHUB_SECRET"}],
            "overrides": ["tracking.experiment=digits-{payload.repository.name}"],
        },
        "slow": {"spec": SPEC, "secrets": [{"env": "TEST_DIGITS_SECRET"}], "rate_limit_per_min": 2},
        "s3eb": {
            "spec": SPEC,
            "scheme": "eventbridge",
            "secrets": [{"env": "TEST_EVENTBRIDGE_KEY"}],
            "overrides": [
                "steps.data.with.source=s3://{payload.detail.bucket.name}/{payload.detail.object.key|dirname}"
            ],
            "allow": [{"bucket": ALLOWED_BUCKET, "prefix": "digits/"}],
        },
    }
    path = folder / "webhooks.yaml"
    path.write_text(yaml.safe_dump({"hooks": hooks}))
    return path


ENVIRON = {"TEST_DIGITS_SECRET": SECRET, "TEST_GITHUB_SECRET": GITHUB_SECRET, "TEST_EVENTBRIDGE_KEY": API_KEY}


@pytest.fixture
def api_url(prefect_api: None) -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the prefect_api fixture sets PREFECT_API_URL"
    return str(url)


@pytest.fixture
def config(in_repo: Path, tmp_path: Path) -> WebhookConfig:
    return load_webhook_config(write_config(tmp_path), ENVIRON)


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread on a free loopback port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started or not thread.is_alive():
                break
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class Receiver:
    """A running receiver and a client; ``restart`` serves a new app on the same state dir."""

    def __init__(self, config: WebhookConfig, api_url: str, state_dir: Path) -> None:
        self.config, self.api_url, self.state_dir = config, api_url, state_dir
        self.http = httpx.Client(timeout=30)
        self.registry = CollectorRegistry()

    @contextmanager
    def running(self) -> Iterator[Receiver]:
        sink = PrefectEventSink(self.api_url, self.http)
        app = create_app(self.config, in_thread(sink), self.state_dir, registry=self.registry)
        try:
            with serving(app) as self.url:
                yield self
        finally:
            app.state.publisher.stop()  # uvicorn runs here without lifespan events

    def post(self, hook: str, body: bytes | Iterator[bytes], headers: dict[str, str]) -> httpx.Response:
        headers = {"Content-Type": "application/json", **headers}
        return self.http.post(f"{self.url}/hooks/{hook}", content=body, headers=headers)

    def send(self, hook: str, payload: Any, secret: str = SECRET) -> httpx.Response:
        body = json.dumps(payload).encode()
        return self.post(hook, body, standard_headers([secret], body))


@pytest.fixture
def receiver(config: WebhookConfig, api_url: str, tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(config, api_url, tmp_path / "state").running() as running:
        yield running
    running.http.close()


def prefect_events(api_url: str, **event_filter: Any) -> list[dict[str, Any]]:
    answer = httpx.post(f"{api_url}/events/filter", json={"filter": event_filter, "limit": 50}, timeout=30)
    answer.raise_for_status()
    events: list[dict[str, Any]] = answer.json()["events"]
    return events


def nested(levels: int) -> Any:
    """``levels`` lists, one inside the other, around the number 1."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def wait_for_event(api_url: str, event_id: str) -> dict[str, Any]:
    """The event once Prefect has stored it (the server persists events in batches, every few seconds)."""
    for _ in range(300):
        found = prefect_events(api_url, id={"id": [event_id]})
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"event {event_id} never reached Prefect's event store")


# ---------------------------------------------------------------------------------------------- accepting


def test_a_signed_delivery_becomes_a_prefect_event_with_its_payload(receiver: Receiver) -> None:
    payload = {"num_trials": 7, "note": "retrain"}
    answer = receiver.send("digits", payload)
    assert answer.status_code == 202, answer.text
    accepted = answer.json()
    assert accepted["hook"] == "digits"
    assert accepted["spec"] == SPEC
    assert accepted["overrides"] == ["steps.search.with.num_trials=7"]

    event = wait_for_event(receiver.api_url, accepted["event_id"])
    assert event["event"] == "tunepod.webhook.digits"
    assert event["resource"]["prefect.resource.id"] == "tunepod.webhook.digits"
    assert event["payload"]["spec_path"] == SPEC
    assert event["payload"]["overrides"] == ["steps.search.with.num_trials=7"]
    assert event["payload"]["body"] == payload


def test_a_github_delivery_and_a_rotated_secret_are_accepted(receiver: Receiver) -> None:
    body = json.dumps({"repository": {"name": "digits-trainer"}}).encode()
    answer = receiver.post("gh", body, github_headers(GITHUB_SECRET, body))
    assert answer.status_code == 202, answer.text
    assert answer.json()["overrides"] == ['tracking.experiment="digits-digits-trainer"']
    # The second secret of the digits hook comes from a file: deliveries signed with it still pass.
    assert receiver.send("digits", {"num_trials": 3}, secret=OLD_SECRET).status_code == 202


def test_a_redelivery_after_a_restart_is_a_duplicate_of_the_first_event(
    config: WebhookConfig, api_url: str, tmp_path: Path
) -> None:
    body = json.dumps({"num_trials": 5}).encode()
    headers = standard_headers([SECRET], body)
    deployment = Receiver(config, api_url, tmp_path / "state")
    with deployment.running():
        first = deployment.post("digits", body, headers)
        assert first.status_code == 202, first.text
        assert deployment.post("digits", body, headers).json()["duplicate"] is True
    event_id = first.json()["event_id"]
    with deployment.running():  # a new app and server, the same state dir
        again = deployment.post("digits", body, headers)
    assert again.status_code == 200
    assert again.json() == {"duplicate": True, "event_id": event_id}
    wait_for_event(api_url, event_id)
    delivered = prefect_events(api_url, event={"name": ["tunepod.webhook.digits"]})
    assert [e["id"] for e in delivered if e["payload"]["delivery_id"] == headers["webhook-id"]] == [event_id]


def test_twenty_concurrent_copies_of_one_delivery_publish_one_event(receiver: Receiver) -> None:
    body = json.dumps({"num_trials": 4}).encode()
    headers = {"Content-Type": "application/json", **standard_headers([SECRET], body)}

    async def send_copies() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=20)) as client:
            url = f"{receiver.url}/hooks/digits"
            return await asyncio.gather(*(client.post(url, content=body, headers=headers) for _ in range(20)))

    answers = asyncio.run(send_copies())
    assert sorted(answer.status_code for answer in answers) == [200] * 19 + [202], [a.text for a in answers]
    assert len({answer.json()["event_id"] for answer in answers}) == 1
    event_id = answers[0].json()["event_id"]
    # Prefect stores events in the order they arrive: once a later delivery's event is stored, any event
    # the copies published is stored too.
    later = receiver.send("digits", {"num_trials": 1})
    wait_for_event(receiver.api_url, later.json()["event_id"])
    delivered = prefect_events(receiver.api_url, event={"name": ["tunepod.webhook.digits"]})
    assert [e["id"] for e in delivered if e["payload"]["delivery_id"] == headers["webhook-id"]] == [event_id]


def test_a_github_delivery_replayed_under_a_new_delivery_id_is_a_duplicate(receiver: Receiver) -> None:
    """Defect: GitHub does not sign X-GitHub-Delivery, yet it was the dedupe key, so a captured
    delivery sent again under a new id started a second run. The key is now the digest of the body,
    which the signature covers: the replay is answered as a duplicate of the first event, and Prefect
    gets one event."""
    marker = uuid.uuid4().hex
    push = {"after": marker, "repository": {"name": "digits-trainer", "pushed_at": int(time.time())}}
    body = json.dumps(push).encode()
    captured = github_headers(GITHUB_SECRET, body)
    first = receiver.post("gh", body, captured)
    assert first.status_code == 202, first.text
    event_id = first.json()["event_id"]
    replayed = receiver.post("gh", body, {**captured, "X-GitHub-Delivery": str(uuid.uuid4())})
    assert replayed.status_code == 200, replayed.text
    assert replayed.json() == {"duplicate": True, "event_id": event_id}
    # Prefect stores events in the order they arrive: once a later delivery's event is stored, an event
    # the replay made would be stored too.
    later_body = json.dumps({"after": uuid.uuid4().hex, "repository": {"name": "digits-trainer"}}).encode()
    later = receiver.post("gh", later_body, github_headers(GITHUB_SECRET, later_body))
    assert later.status_code == 202, later.text
    wait_for_event(receiver.api_url, later.json()["event_id"])
    delivered = prefect_events(receiver.api_url, event={"name": ["tunepod.webhook.gh"]})
    assert [e["id"] for e in delivered if e["payload"]["body"].get("after") == marker] == [event_id]


# ---------------------------------------------------------------------------------------------- rejecting


def test_an_unknown_hook_is_404(receiver: Receiver) -> None:
    answer = receiver.send("nope", {"num_trials": 1})
    assert answer.status_code == 404
    assert "nope" in answer.json()["detail"]


def test_missing_bad_and_stale_signatures_are_401(receiver: Receiver) -> None:
    body = b'{"num_trials": 4}'
    signed = standard_headers([SECRET], body)
    assert receiver.post("digits", body, {}).status_code == 401
    assert receiver.post("digits", body, standard_headers(["not-the-secret"], body)).status_code == 401
    assert receiver.post("digits", body + b" ", signed).status_code == 401
    for skew_s in (-301, 301):
        stale = standard_headers([SECRET], body, timestamp=int(time.time()) + skew_s)
        answer = receiver.post("digits", body, stale)
        assert answer.status_code == 401
        assert "clock" in answer.json()["detail"]
    # A GitHub hook wants GitHub's header; a Standard Webhooks signature does not open it.
    assert receiver.post("gh", body, standard_headers([GITHUB_SECRET], body)).status_code == 401


def test_a_github_push_older_than_the_dedupe_window_or_from_the_future_is_401(receiver: Receiver) -> None:
    """A GitHub push carries when GitHub took it (repository.pushed_at, signed with the body). One older
    than the dedupe window could be a replay the receiver no longer recognizes, so it is refused."""
    now = int(time.time())
    for pushed_at, expected in [
        (now - 2 * 86_400, "refused as a possible replay"),
        (now + 3_600, "ahead of the receiver's clock"),
    ]:
        body = json.dumps({"repository": {"name": "digits-trainer", "pushed_at": pushed_at}}).encode()
        answer = receiver.post("gh", body, github_headers(GITHUB_SECRET, body))
        assert answer.status_code == 401, answer.text
        assert expected in answer.json()["detail"]


def test_a_body_over_one_mib_is_413_whether_announced_or_streamed(receiver: Receiver) -> None:
    body = b'{"pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
    assert receiver.post("digits", body, standard_headers([SECRET], body)).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the receiver must count as it reads
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    answer = receiver.post("digits", chunks(), standard_headers([SECRET], body))
    assert answer.status_code == 413


def test_a_body_that_is_not_json_is_415(receiver: Receiver) -> None:
    body = b'{"num_trials": 4}'
    as_text = receiver.post("digits", body, {**standard_headers([SECRET], body), "Content-Type": "text/csv"})
    assert as_text.status_code == 415
    for broken in (b"{not json", b'{"x": NaN}', b"\xff\xfe"):
        answer = receiver.post("digits", broken, standard_headers([SECRET], broken))
        assert answer.status_code == 415, broken


def test_overrides_the_spec_rejects_are_422_with_the_spec_error(receiver: Receiver) -> None:
    answer = receiver.send("digits", {"num_trials": "ten"})
    assert answer.status_code == 422
    detail = answer.json()["detail"]
    assert "steps.search.with.num_trials" in detail
    assert "expected an integer, got 'ten'" in detail
    missing = receiver.send("digits", {"trials": 3})
    assert missing.status_code == 422
    assert "the payload has no payload.num_trials" in missing.json()["detail"]
    # A rejected delivery is not recorded: once fixed upstream, its retry is not a duplicate.
    assert receiver.send("digits", [1]).status_code == 422


# JSON Python reads that Prefect could never take: (body, where the 422 says the problem is, its fix).
UNSENDABLE_BODIES = {
    "a number beyond a float": (
        b'{"num_trials": 2, "loss": 1e400}',
        "payload.loss is a number beyond a 64-bit float",
        "send it as a string",
    ),
    "a negative one": (
        b'{"num_trials": 2, "history": [0.5, -1e400]}',
        "payload.history[1] is a number beyond a 64-bit float",
        "send it as a string",
    ),
    "a lone surrogate": (
        b'{"num_trials": 2, "note": "ab\\ud800"}',
        "payload.note holds a lone UTF-16 surrogate (\\ud800), which is not Unicode text",
        "as a surrogate pair",
    ),
    "a lone surrogate in a key": (
        b'{"num_trials": 2, "tags": {"x\\udc00": 1}}',
        'the key "x\\udc00" in payload.tags holds a lone UTF-16 surrogate',
        "as a surrogate pair",
    ),
    "NUL": (
        b'{"num_trials": 2, "note": "a\\u0000b"}',
        "payload.note holds U+0000 (NUL), which Prefect cannot store on PostgreSQL",
        "remove it",
    ),
    "nesting past 128 levels": (
        json.dumps({"num_trials": 2, "deep": nested(128)}).encode(),
        "payload.deep[0][0]",
        "nests lists and objects more than 128 deep",
    ),
    "numbers that grow past the size Prefect keeps": (
        b'{"num_trials": 2, "x": [' + b",".join([b"1e15"] * 100_000) + b"]}",
        "the event is 1,9",
        "bytes as Prefect writes it, over the 1,400,000 it keeps",
    ),
}


def test_a_body_prefect_could_never_take_is_422_and_recorded_nowhere(receiver: Receiver) -> None:
    """Defect: such bodies were accepted (202); the publisher then failed to send their events and
    retried them forever, ahead of every later event. Each is refused with what is wrong and where, and
    nothing is recorded: a fixed retry under the same id is a new delivery, whose event reaches Prefect."""
    delivery_ids = []
    for name, (body, where, fix) in UNSENDABLE_BODIES.items():
        headers = standard_headers([SECRET], body)
        answer = receiver.post("digits", body, headers)
        assert answer.status_code == 422, (name, answer.text)
        assert where in answer.json()["detail"] and fix in answer.json()["detail"], (name, answer.text)
        delivery_ids.append(headers["webhook-id"])
    deliveries = DeliveryLog(receiver.state_dir / DEDUPE_FILE)
    assert [d for d in delivery_ids if deliveries.event_for("digits", d) is not None] == []
    assert deliveries.unpublished() == [] and deliveries.refused() == []
    fixed = b'{"num_trials": 2, "note": "ab"}'
    retried = receiver.post("digits", fixed, standard_headers([SECRET], fixed, msg_id=delivery_ids[0]))
    assert retried.status_code == 202, retried.text
    assert wait_for_event(receiver.api_url, retried.json()["event_id"])["payload"]["body"]["note"] == "ab"


def test_a_body_at_the_limits_prefect_reads_reaches_it_whole(receiver: Receiver) -> None:
    """The limits hold against the real server: a body nested 128 deep whose event is just under the
    size limit once its numbers are written out in full is accepted, and Prefect stores it as sent."""
    numbers = b",".join([b"1e15"] * 70_000)  # 350 kB here, 1.3 MB written in full
    deep = json.dumps(nested(127)).encode()
    body = b'{"num_trials": 2, "deep": ' + deep + b', "numbers": [' + numbers + b"]}"
    answer = receiver.post("digits", body, standard_headers([SECRET], body))
    assert answer.status_code == 202, answer.text
    assert wait_for_event(receiver.api_url, answer.json()["event_id"])["payload"]["body"] == json.loads(body)


def test_the_rate_limit_is_429_with_retry_after(receiver: Receiver) -> None:
    assert [receiver.send("slow", {}).status_code for _ in range(2)] == [202, 202]
    limited = receiver.send("slow", {})
    assert limited.status_code == 429
    assert int(limited.headers["Retry-After"]) >= 1
    # Other hooks have their own buckets.
    assert receiver.send("digits", {"num_trials": 2}).status_code == 202


def test_a_delivery_while_prefect_is_down_is_accepted_and_published_by_the_next_receiver(
    config: WebhookConfig, api_url: str, tmp_path: Path
) -> None:
    """Fault: Prefect's API refuses connections (nothing listens on its port) when a delivery comes, and
    the receiver stops before Prefect is back. The delivery is still accepted (202: it is on disk), a
    retry of it is a duplicate, and the next receiver on the same state dir publishes its event."""
    body = b'{"num_trials": 6}'
    headers = standard_headers([SECRET], body)
    with socket.socket() as closed:  # a port nothing listens on: Prefect "down"
        closed.bind(("127.0.0.1", 0))
        down = Receiver(config, f"http://127.0.0.1:{closed.getsockname()[1]}/api", tmp_path / "state")
    with down.running():
        accepted = down.post("digits", body, headers)
        assert accepted.status_code == 202, accepted.text
        assert down.post("digits", body, headers).json()["duplicate"] is True
    event_id = accepted.json()["event_id"]
    assert not prefect_events(api_url, id={"id": [event_id]})
    with Receiver(config, api_url, tmp_path / "state").running() as up:
        event = wait_for_event(api_url, event_id)
        assert up.post("digits", body, headers).json() == {"duplicate": True, "event_id": event_id}
    assert event["payload"]["overrides"] == ["steps.search.with.num_trials=6"]


def test_the_receiver_keeps_publishing_until_prefect_answers_again(
    config: WebhookConfig, api_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault: Prefect unreachable for a while (connections refused), then back on the same address.
    Deliveries made meanwhile are accepted at once, and their events reach Prefect when it answers,
    without any retry from the sender; the log says so both times."""
    caplog.set_level(logging.INFO, logger="tunepod.webhook")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    prefect = httpx.URL(api_url)
    with Receiver(config, f"http://127.0.0.1:{port}/api", tmp_path / "state").running() as receiver:
        accepted = [receiver.send("digits", {"num_trials": n}) for n in (2, 3)]
        assert [a.status_code for a in accepted] == [202, 202], [a.text for a in accepted]
        time.sleep(1.0)  # the publisher has tried and failed by now
        assert "Prefect did not take event" in caplog.text
        with forwarding(port, prefect.host, prefect.port or 80):
            events = [wait_for_event(api_url, a.json()["event_id"]) for a in accepted]
    assert [e["payload"]["overrides"] for e in events] == [
        ["steps.search.with.num_trials=2"],
        ["steps.search.with.num_trials=3"],
    ]
    assert "Prefect answers again" in caplog.text


def test_an_event_prefect_refuses_is_set_aside_and_the_events_after_it_go_on(
    api_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An event the real Prefect server refuses (422: its resource has no id) at the head of the log.
    No delivery the receiver accepts makes such an event (its events are built by the receiver, under
    Prefect's size limit), so the claim is written into the log directly, standing in for a change of
    Prefect's API; the refusal itself is Prefect's."""
    caplog.set_level(logging.INFO, logger="tunepod.webhook")
    clock = iter(float(n) for n in range(1000, 2000))
    deliveries = DeliveryLog(tmp_path / "deliveries.sqlite", clock=lambda: next(clock))
    bad, good = f"refused-{time.time_ns()}", f"kept-{time.time_ns()}"
    bad_event = {"name": "tunepod.webhook.digits", "resource": {"prefect.resource.name": "x"}, "payload": {}}
    good_event = {"name": "tunepod.webhook.digits", "resource": hook_resource("digits"), "payload": {"n": 1}}
    bad_id, good_id = str(uuid.uuid4()), str(uuid.uuid4())
    assert deliveries.claim("digits", bad, bad_id, bad_event) is None
    assert deliveries.claim("digits", good, good_id, good_event) is None
    with httpx.Client(timeout=30) as http:
        publisher = EventPublisher(deliveries, PrefectEventSink(api_url, http), first_backoff_s=0.05).start()
        try:
            published = wait_for_event(api_url, good_id)
        finally:
            publisher.stop()
    assert published["payload"] == {"n": 1}
    [(refused, answer)] = deliveries.refused()
    assert (refused.delivery_id, refused.event_id, refused.event) == (bad, bad_id, bad_event)
    assert "422" in answer
    assert deliveries.unpublished() == []
    assert f"set aside event {bad_id}" in caplog.text
    assert prefect_events(api_url, id={"id": [bad_id]}) == []


def test_events_an_older_receiver_accepted_but_nobody_can_send_are_set_aside(
    api_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: an event whose body held 1e400 or a lone surrogate, accepted by an older receiver, failed
    to encode at every try, and the publisher retried it forever ahead of every later event (one nested
    300 deep got a 500 from Prefect, retried the same way). Such claims are written into a real log on
    disk as that receiver wrote them, a good event behind them; the publisher sets each aside with its
    reason, and publishes the good one to the real Prefect server."""
    caplog.set_level(logging.INFO, logger="tunepod.webhook")
    clock = iter(float(n) for n in range(1000, 2000))
    deliveries = DeliveryLog(tmp_path / "deliveries.sqlite3", clock=lambda: next(clock))
    bodies = {
        "payload.body.loss is a number beyond a 64-bit float": {"loss": float("inf")},
        "payload.body.note holds a lone UTF-16 surrogate": {"note": "\ud800"},
        "nests lists and objects more than 129 deep": {"deep": nested(300)},
    }
    reasons = {}
    for reason, body in bodies.items():
        event_id = str(uuid.uuid4())
        event = {
            "name": "tunepod.webhook.digits",
            "resource": hook_resource("digits"),
            "payload": {"body": body},
        }
        assert deliveries.claim("digits", f"old-{event_id}", event_id, event) is None
        reasons[event_id] = reason
    good_id = str(uuid.uuid4())
    good_event = {"name": "tunepod.webhook.digits", "resource": hook_resource("digits"), "payload": {"n": 1}}
    assert deliveries.claim("digits", f"good-{good_id}", good_id, good_event) is None
    with httpx.Client(timeout=30) as http:
        publisher = EventPublisher(deliveries, PrefectEventSink(api_url, http), first_backoff_s=0.05).start()
        try:
            published = wait_for_event(api_url, good_id)
        finally:
            publisher.stop()
    assert published["payload"] == {"n": 1}
    set_aside = {pending.event_id: answer for pending, answer in DeliveryLog(deliveries.path).refused()}
    assert set(set_aside) == set(reasons)
    assert [event_id for event_id, reason in reasons.items() if reason not in set_aside[event_id]] == []
    assert deliveries.unpublished() == []
    assert [event_id for event_id in reasons if f"set aside event {event_id}" not in caplog.text] == []
    assert prefect_events(api_url, id={"id": list(reasons)}) == []


class CountingSink(PrefectEventSink):
    """The real Prefect sink, counting its requests and the events in each."""

    def __init__(self, api_url: str, http: httpx.Client) -> None:
        super().__init__(api_url, http)
        self.requests: list[int] = []

    def publish_all(self, events: Sequence[OutgoingEvent]) -> None:
        super().publish_all(events)
        self.requests.append(len(events))


@pytest.mark.parametrize(("per_request", "requests"), [(100, [5]), (2, [2, 2, 1])])
def test_events_waiting_together_go_to_prefect_in_one_request(
    api_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_request: int, requests: list[int]
) -> None:
    """Deliveries accepted while the publisher was busy (here: before it starts) are published in one
    POST to Prefect (a backlog larger than a request's worth: in several, one after the other) and
    marked published in one commit each; every event keeps its own id."""
    monkeypatch.setattr("tunepod.webhook.publisher.BATCH_EVENTS", per_request)
    deliveries = DeliveryLog(tmp_path / "deliveries.sqlite")
    ids = {f"batch-{n}-{time.time_ns()}": str(uuid.uuid4()) for n in range(5)}
    for delivery, event_id in ids.items():
        event = {
            "name": "tunepod.webhook.digits",
            "resource": hook_resource("digits"),
            "payload": {"d": delivery},
        }
        assert deliveries.claim("digits", delivery, event_id, event) is None
    with httpx.Client(timeout=30) as http:
        sink = CountingSink(api_url, http)
        publisher = EventPublisher(deliveries, sink).start()
        try:
            stored = {event_id: wait_for_event(api_url, event_id) for event_id in ids.values()}
        finally:
            publisher.stop()
    assert sink.requests == requests
    assert {delivery: stored[event_id]["payload"]["d"] for delivery, event_id in ids.items()} == {
        delivery: delivery for delivery in ids
    }
    assert deliveries.unpublished() == []
    reopened = DeliveryLog(tmp_path / "deliveries.sqlite")
    assert reopened.unpublished() == [] and all(reopened.event_for("digits", d) == e for d, e in ids.items())


def test_a_wrong_api_url_is_kept_for_a_retry_and_an_invalid_event_is_refused(api_url: str) -> None:
    """What the real Prefect server answers: a 404 (a wrong URL, fixed by the operator) leaves the event
    to be sent again; a 422 (the event itself) is final."""
    with httpx.Client(timeout=30) as http:
        with pytest.raises(EventSinkError, match="404"):
            PrefectEventSink(f"{api_url}/missing", http).publish("tunepod.webhook.x", hook_resource("x"), {})
        with pytest.raises(EventRefused, match="422"):
            PrefectEventSink(api_url, http).publish("tunepod.webhook.x", {"prefect.resource.name": "x"}, {})


def test_an_edited_spec_is_checked_again_at_the_next_delivery(
    api_url: str, in_repo: Path, tmp_path: Path
) -> None:
    # The receiver reuses a verdict on the same overrides, but never past a change of the spec file.
    spec = tmp_path / "pipeline.yaml"
    spec.write_text((in_repo / SPEC).read_text())
    hook = {
        "spec": str(spec),
        "secrets": [{"env": "TEST_DIGITS_SECRET"}],
        "overrides": ["name={payload.name}"],
    }
    config_file = tmp_path / "hooks.yaml"
    config_file.write_text(yaml.safe_dump({"hooks": {"edited": hook}}))
    config = load_webhook_config(config_file, ENVIRON)
    with Receiver(config, api_url, tmp_path / "state").running() as running:
        assert running.send("edited", {"name": "digits-a"}).status_code == 202
        spec.write_text(spec.read_text() + "colour: red\n")
        rejected = running.send("edited", {"name": "digits-a"})
        assert rejected.status_code == 422, rejected.text
        assert "colour" in rejected.json()["detail"]
        spec.write_text((in_repo / SPEC).read_text())
        assert running.send("edited", {"name": "digits-a"}).status_code == 202
    running.http.close()


# ---------------------------------------------------------------------------------------------- secrets


def test_secrets_never_reach_logs_responses_or_reprs(
    receiver: Receiver, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    body = b'{"num_trials": 2}'
    answers = [
        receiver.send("digits", {"num_trials": 2}),
        receiver.post("digits", body, standard_headers(["wrong"], body)),
        receiver.post("gh", body, github_headers("wrong", body)),
        receiver.send("digits", {"num_trials": "ten"}),
        receiver.http.get(f"{receiver.url}/openapi.json"),
        receiver.http.get(f"{receiver.url}/metrics"),
    ]
    assert answers[0].status_code == 202
    assert "webhook digits accepted" in caplog.text  # the log is captured, so its silence means something
    shown = [caplog.text, repr(receiver.config), *(answer.text for answer in answers)]
    for secret in (*SECRETS, SECRET.removeprefix("whsec_")):
        assert not [text for text in shown if secret in text]
    config_file = write_config(tmp_path)
    with pytest.raises(WebhookConfigError) as raised:
        load_webhook_config(config_file, {"TEST_DIGITS_SECRET": "whsec_!!" + SECRET})
    assert SECRET not in str(raised.value)


# ---------------------------------------------------------------------------------------------- startup


def test_startup_names_the_hook_and_field_of_every_problem(in_repo: Path, tmp_path: Path) -> None:
    hooks = {
        "ok": {"spec": SPEC, "secrets": [{"env": "UNSET_SECRET_VAR"}], "colour": "red"},
        "bad": {
            "spec": "examples/nope.yaml",
            "secrets": [{"env": "TEST_DIGITS_SECRET"}, {"file": str(tmp_path / "missing")}],
            "overrides": ["steps.{payload.step}.with.x=1", "a.b={payload}", "a.b={oops.x}", "a.b={payload.x"],
        },
    }
    path = tmp_path / "hooks.yaml"
    path.write_text(yaml.safe_dump({"hooks": hooks}))
    with pytest.raises(WebhookConfigError) as raised:
        load_webhook_config(path, ENVIRON)
    assert raised.value.problems == [
        "hooks.ok.colour: unknown key; valid keys: spec, scheme, secrets, rate_limit_per_min, overrides, "
        "allow"
    ]
    del hooks["ok"]["colour"]
    path.write_text(yaml.safe_dump({"hooks": hooks}))
    with pytest.raises(WebhookConfigError) as raised:
        load_webhook_config(path, ENVIRON)
    problems = "\n".join(raised.value.problems)
    assert "hooks.ok.secrets[0].env: environment variable UNSET_SECRET_VAR is not set" in problems
    assert "hooks.bad.spec: spec file 'examples/nope.yaml' does not exist" in problems
    assert "hooks.bad.secrets[1].file: cannot read secret file" in problems
    assert "hooks.bad.overrides[0]: placeholders may only stand in the value" in problems
    assert "hooks.bad.overrides[1]: placeholder {payload} needs a path" in problems
    assert "hooks.bad.overrides[2]: placeholder {oops.x} must start with 'payload'" in problems
    assert "hooks.bad.overrides[3]: unmatched '{'" in problems
    assert len(raised.value.problems) == 7


def test_the_example_config_loads_with_its_secrets_set(in_repo: Path) -> None:
    config = load_webhook_config(in_repo / "deployments/webhooks.yaml", EXAMPLE_SECRETS)
    assert set(config.hooks) == {"s3-upload", "s3-eventbridge", "github-push", "digits"}


EXAMPLE_SECRETS = {
    name: SECRET
    for name in (
        "TUNEPOD_HOOK_S3_SECRET",
        "TUNEPOD_HOOK_S3_EVENTBRIDGE_KEY",
        "TUNEPOD_HOOK_GITHUB_SECRET",
        "TUNEPOD_HOOK_DIGITS_SECRET",
    )
}


def test_the_s3_upload_hook_stages_the_folder_of_the_object_an_s3_event_names(
    in_repo: Path, moto: MotoServer
) -> None:
    """A real S3 event notification: moto's S3 sends it to an SQS queue when an object is put (its
    key URL-encoded, as S3 does). The example hook turns it into the folder that holds the object,
    which is a prefix the stage step can copy, and the digits spec accepts the override."""
    s3, sqs = moto.client("s3"), moto.client("sqs")
    s3.create_bucket(Bucket="my-data")  # the bucket the example hook allows
    queue = sqs.create_queue(QueueName="uploads")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    s3.put_bucket_notification_configuration(
        Bucket="my-data",
        NotificationConfiguration={
            "QueueConfigurations": [{"QueueArn": arn, "Events": ["s3:ObjectCreated:*"]}]
        },
    )
    s3.put_object(Bucket="my-data", Key="digits/v 2/train.npz", Body=b"x")
    messages = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=5)["Messages"]
    events = [json.loads(m["Body"]) for m in messages]
    [event] = [
        e for e in events if e.get("Records", [{}])[0].get("eventName", "").startswith("ObjectCreated")
    ]
    sent = event["Records"][0]["s3"]["object"]["key"]
    assert "+" in sent and " " not in sent  # URL form encoded, as S3 sends it (moto encodes '/' too)

    config = load_webhook_config(in_repo / "deployments/webhooks.yaml", EXAMPLE_SECRETS)
    hook = config.hooks["s3-upload"]
    [override] = hook.render_overrides(event)
    assert override == 'steps.data.with.source="s3://my-data/digits/v 2/"'
    # Its allow list takes the key decoded, as S3 stores it, and the folder the override names.
    assert (hook.forbidden_body(event), hook.forbidden_overrides([override])) == (None, None)
    listed = s3.list_objects_v2(Bucket="my-data", Prefix="digits/v 2/")["Contents"]
    assert [item["Key"] for item in listed] == ["digits/v 2/train.npz"]
    load_spec(in_repo / SPEC, overrides=[override])


def test_placeholder_filters_refuse_unknown_names_and_values_that_are_not_text(tmp_path: Path) -> None:
    hooks = {
        "f": {
            "spec": SPEC,
            "secrets": [{"env": "TEST_DIGITS_SECRET"}],
            "overrides": ["a.b={payload.k|basename}"],
        }
    }
    with pytest.raises(WebhookConfigError, match=r"unknown filter 'basename'; known: urldecode, dirname"):
        parse_webhook_config({"hooks": hooks}, "hooks.yaml", ENVIRON)
    hooks["f"]["overrides"] = ["a.b={payload.k|dirname}"]
    hook = parse_webhook_config({"hooks": hooks}, "hooks.yaml", ENVIRON).hooks["f"]
    assert hook.render_overrides({"k": "a/b/c"}) == ['a.b="a/b/"']
    assert hook.render_overrides({"k": "c"}) == ['a.b=""']
    with pytest.raises(PayloadError, match=r"payload\.k is 3, not text: filter .dirname. takes text"):
        hook.render_overrides({"k": 3})


# ---------------------------------------------------------------------------------------------- service


def test_health_openapi_and_metrics(receiver: Receiver) -> None:
    assert receiver.http.get(f"{receiver.url}/healthz").json() == {"status": "ok"}
    schema = receiver.http.get(f"{receiver.url}/openapi.json").json()
    assert "/hooks/{hook}" in schema["paths"]
    receiver.send("digits", {"num_trials": 2})
    receiver.send("digits", {"num_trials": 2}, secret="wrong")
    receiver.send("unknown-hook-name", {})
    metrics = receiver.http.get(f"{receiver.url}/metrics").text
    assert 'tunepod_webhook_requests_total{hook="digits",outcome="accepted"} 1.0' in metrics
    assert 'tunepod_webhook_requests_total{hook="digits",outcome="unauthorized"} 1.0' in metrics
    assert 'tunepod_webhook_requests_total{hook="<unknown>",outcome="unknown_hook"} 1.0' in metrics


def run_cli(*args: str, env: dict[str, str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "tunepod.webhook", *args],
        input=stdin,
        env=env,
        capture_output=True,
        timeout=60,
    )


def test_sign_prints_headers_the_receiver_accepts(receiver: Receiver) -> None:
    body = b'{"num_trials": 9}'
    env = {**os.environ, "HOOK_SECRET": SECRET}
    signed = run_cli("sign", "--secret-env", "HOOK_SECRET", "--body", "-", env=env, stdin=body)
    assert signed.returncode == 0, signed.stderr
    headers = dict(line.split(": ", 1) for line in signed.stdout.decode().splitlines())
    assert headers["Content-Type"] == "application/json"
    assert receiver.post("digits", body, headers).status_code == 202

    github = run_cli("sign", "--secret", GITHUB_SECRET, "--github", "--body", "-", env=env, stdin=body)
    github_headers_ = dict(line.split(": ", 1) for line in github.stdout.decode().splitlines())
    assert set(github_headers_) == {"X-GitHub-Delivery", "X-Hub-Signature-256", "Content-Type"}


def test_serve_refuses_to_start_without_prefect_api_url_or_with_a_bad_config(in_repo: Path) -> None:
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    unset = run_cli("serve", "--config", "deployments/webhooks.yaml", env=env)
    assert unset.returncode == 2
    assert b"PREFECT_API_URL is not set" in unset.stderr
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
    env.pop("TUNEPOD_HOOK_S3_SECRET", None)
    bad = run_cli("serve", "--config", "deployments/webhooks.yaml", env=env)
    assert bad.returncode == 2
    assert b"hooks.s3-upload.secrets[0].env: environment variable TUNEPOD_HOOK_S3_SECRET" in bad.stderr


def test_serve_publishes_from_its_own_process_which_survives_a_kill_and_ends_with_the_receiver(
    api_url: str, in_repo: Path, tmp_path: Path
) -> None:
    """``tunepod webhook serve`` as a user runs it publishes from a child process. Faults, both real:
    SIGKILL of that child (as the OOM killer would): a delivery made meanwhile is accepted, and the child
    started in its place publishes it; SIGKILL of the receiver: the child sees its pipe end and exits."""
    port = free_port()
    argv = [sys.executable, "-m", "tunepod.webhook", "serve", "--config", str(write_config(tmp_path))]
    argv += ["--port", str(port), "--state-dir", str(tmp_path / "state")]
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        served = subprocess.Popen(
            argv, env={**os.environ, **ENVIRON, "PREFECT_API_URL": api_url}, stdout=output, stderr=output
        )
    try:
        url = f"http://127.0.0.1:{port}/hooks/digits"
        wait_until_healthy(f"http://127.0.0.1:{port}/healthz", served, log)
        first_child = only_child(served.pid)
        assert "tunepod.webhook.publisher_process" in cmdline(first_child)
        assert wait_for_event(api_url, deliver(url, {"num_trials": 2}))["payload"]["overrides"] == [
            "steps.search.with.num_trials=2"
        ]

        os.kill(first_child, signal.SIGKILL)
        while_down = deliver(url, {"num_trials": 3})  # the next child starts a second later
        assert wait_for_event(api_url, while_down)["payload"]["overrides"] == [
            "steps.search.with.num_trials=3"
        ]
        second_child = only_child(served.pid)
        assert second_child != first_child
        assert "the publisher process exited with -9" in log.read_text()

        served.kill()
        served.wait(10)
        assert wait_until_gone(second_child), (
            f"the publisher process outlived its receiver:\n{log.read_text()}"
        )
    finally:
        served.kill()
        served.wait(10)


def wait_until_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    for _ in range(600):
        assert process.poll() is None, f"the receiver exited {process.returncode}:\n{log.read_text()}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"the receiver never answered {url}:\n{log.read_text()}")


def deliver(url: str, payload: Any) -> str:
    """Send ``payload`` signed; the event id of the 202."""
    body = json.dumps(payload).encode()
    answer = httpx.post(
        url, content=body, headers={"Content-Type": "application/json", **standard_headers([SECRET], body)}
    )
    assert answer.status_code == 202, answer.text
    event_id: str = answer.json()["event_id"]
    return event_id


def only_child(pid: int) -> int:
    """The one running child process of ``pid`` (waiting up to 10 s for it to start)."""
    for _ in range(100):
        found = [int(c) for task in Path(f"/proc/{pid}/task").glob("*") for c in children_of(task)]
        if len(found) == 1:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"process {pid} has children {found}, not one")


def children_of(task: Path) -> list[str]:
    try:
        return (task / "children").read_text().split()
    except OSError:  # the thread ended meanwhile
        return []


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def wait_until_gone(pid: int, timeout_s: float = 15.0) -> bool:
    """True once ``pid`` has exited (gone, or a zombie nobody has reaped yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stat = read_process_stat(pid)
        if stat is None or stat.is_dead:
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------------------- benchmark


def test_the_intake_benchmark_gets_only_expected_answers(api_url: str, in_repo: Path, tmp_path: Path) -> None:
    """``python -m benchmarks.webhook`` on a handful of requests (``make bench`` runs the real one): both
    servers start as a user starts them, every request of every side gets its expected answer (202;
    204 from Prefect for the sink alone), the tables print. Never a speed check. Without its race: the
    test above runs the same race against the receiver."""
    figures_file = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "benchmarks.webhook", "--requests", "4", "--warmup", "2", "--rounds", "1"]
    argv += ["--concurrency", "2", "--race-copies", "0", "--no-settle", "--prefect-api", api_url]
    argv += ["--dir", str(tmp_path / "bench"), "--json", str(figures_file)]
    done = subprocess.run(
        argv, cwd=in_repo, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    figures = json.loads(figures_file.read_text())
    assert figures["failures"] == []
    answers = {name: row["statuses"] for name, row in figures["levels"]["2"]["rows"].items()}
    assert answers == {
        "baseline": {"202": 4},
        "tunepod": {"202": 4},
        "tunepod-new": {"202": 4},
        "sink alone": {"204": 4},
    }
    assert "goal: tunepod adds at most 5 ms at p95, 2 in flight" in done.stdout, output


# ---------------------------------------------------------------------------------------------- EventBridge


def eventbridge_event_of_an_upload(moto: MotoServer, bucket: str, key: str) -> dict[str, Any]:
    """The event EventBridge makes of an S3 upload: moto's S3 sends "Object Created" to its EventBridge
    (the bucket's EventBridge notifications on), whose rule sends it to an SQS queue. moto's API
    destinations post no body, so the last hop, the API destination's POST, is the test's
    (``post_as_api_destination``)."""
    s3, events, sqs = moto.client("s3"), moto.client("events"), moto.client("sqs")
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_notification_configuration(
        Bucket=bucket, NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    queue = sqs.create_queue(QueueName=f"{bucket}-events")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    pattern = {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {"bucket": {"name": [bucket]}},
    }
    events.put_rule(Name=f"{bucket}-uploads", EventPattern=json.dumps(pattern))
    events.put_targets(Rule=f"{bucket}-uploads", Targets=[{"Id": "receiver", "Arn": arn}])
    s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    messages = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=5)["Messages"]
    [event] = [json.loads(message["Body"]) for message in messages]
    return cast(dict[str, Any], event)


def post_as_api_destination(receiver: Receiver, event: dict[str, Any], key: str = API_KEY) -> httpx.Response:
    """What an EventBridge API destination sends: the event as the body, the connection's API key."""
    return receiver.post("s3eb", json.dumps(event).encode(), {API_KEY_HEADER: key})


def test_an_s3_upload_reaches_the_receiver_through_eventbridge_and_starts_a_run(
    receiver: Receiver, moto: MotoServer, api_url: str
) -> None:
    """S3 -> EventBridge -> API destination: the event is accepted with the connection's key, its
    override stages the folder the object was put in, Prefect gets the event that triggers the run,
    and EventBridge's retry of the same event is a duplicate."""
    bucket = ALLOWED_BUCKET
    event = eventbridge_event_of_an_upload(moto, bucket, "digits/v2/train.npz")
    assert (event["source"], event["detail-type"]) == ("aws.s3", "Object Created")

    accepted = post_as_api_destination(receiver, event)
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["overrides"] == [f'steps.data.with.source="s3://{bucket}/digits/v2/"']
    published = wait_for_event(api_url, accepted.json()["event_id"])
    assert published["event"] == "tunepod.webhook.s3eb"
    retried = post_as_api_destination(receiver, event)
    assert retried.status_code == 200, retried.text
    assert retried.json() == {"duplicate": True, "event_id": accepted.json()["event_id"]}


def test_an_eventbridge_delivery_with_a_wrong_key_or_an_old_time_is_refused(receiver: Receiver) -> None:
    fresh = {
        "version": "0", "id": str(uuid.uuid4()), "detail-type": "Object Created", "source": "aws.s3",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "detail": {"bucket": {"name": ALLOWED_BUCKET}, "object": {"key": "digits/v3/train.npz"}},
    }  # fmt: skip
    wrong = post_as_api_destination(receiver, fresh, key=API_KEY + "0")
    assert wrong.status_code == 401 and "X-Tunepod-Key matches none of the hook's keys" in wrong.text
    unkeyed = receiver.post("s3eb", json.dumps(fresh).encode(), standard_headers([SECRET], b"{}"))
    assert unkeyed.status_code == 401 and "missing header X-Tunepod-Key" in unkeyed.text
    old = {**fresh, "id": str(uuid.uuid4()), "time": "2021-11-12T00:00:00Z"}
    replayed = post_as_api_destination(receiver, old)
    assert replayed.status_code == 401 and "refused as a possible replay" in replayed.text
    anonymous = {key: value for key, value in fresh.items() if key != "id"}
    assert post_as_api_destination(receiver, anonymous).status_code == 401
    assert post_as_api_destination(receiver, fresh).status_code == 202


def test_an_eventbridge_hook_refuses_a_short_key() -> None:
    allow = [{"bucket": ALLOWED_BUCKET}]
    hooks = {
        "s3eb": {"spec": SPEC, "scheme": "eventbridge", "secrets": [{"env": "SHORT_KEY"}], "allow": allow}
    }
    with pytest.raises(WebhookConfigError) as raised:
        parse_webhook_config({"hooks": hooks}, "hooks.yaml", {"SHORT_KEY": "short-key"})
    assert raised.value.problems == [
        "hooks.s3eb.secrets: key #1 has fewer than 24 characters; an API key travels whole in a header, so "
        "make it long and random (openssl rand -hex 24)"
    ]
    assert "short-key" not in str(raised.value)


def object_created(bucket: str, key: str, *, event_id: str | None = None) -> dict[str, Any]:
    """A fresh S3 "Object Created" event as anyone holding the hook's key can write one."""
    return {
        "version": "0", "id": event_id or str(uuid.uuid4()), "detail-type": "Object Created",
        "source": "aws.s3", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "detail": {"bucket": {"name": bucket}, "object": {"key": key}},
    }  # fmt: skip


def test_a_forged_event_naming_a_bucket_outside_the_allow_list_is_403_and_starts_no_run(
    receiver: Receiver, api_url: str, tmp_path: Path
) -> None:
    """Whoever has seen one request holds the key, and writes a fresh id and time: an event naming the
    attacker's data is refused (403), recorded nowhere (its id is free afterwards) and never reaches
    Prefect, so no trigger starts a run; the same id naming the allowed bucket then starts one."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
    forged = object_created("attacker-bucket", "poison/train.npz")
    refused = post_as_api_destination(receiver, forged)
    assert refused.status_code == 403, refused.text
    assert refused.json()["detail"] == (
        "payload.detail names 's3://attacker-bucket/poison/train.npz', outside hook s3eb's allow list; "
        "if that data should start runs, add its bucket and prefix to hooks.s3eb.allow in the receiver's "
        "config"
    )
    for key in ("digits/../poison/train.npz", "digits%2F..%2Fpoison/train.npz", "digits-old/train.npz"):
        sneaked = post_as_api_destination(receiver, object_created(ALLOWED_BUCKET, key))
        assert sneaked.status_code == 403, (key, sneaked.text)
    forbidden = {"hook": "s3eb", "outcome": "forbidden"}
    assert receiver.registry.get_sample_value("tunepod_webhook_requests_total", forbidden) == 4
    with contextlib.closing(sqlite3.connect(tmp_path / "state" / DEDUPE_FILE)) as log:
        assert log.execute("SELECT count(*) FROM deliveries").fetchone() == (0,)

    allowed = {**object_created(ALLOWED_BUCKET, "digits/v4/train.npz"), "id": forged["id"]}
    accepted = post_as_api_destination(receiver, allowed)
    assert accepted.status_code == 202, accepted.text
    wait_for_event(api_url, accepted.json()["event_id"])
    # The publisher sends in the order of the log: the forged event would be in Prefect by now.
    published = prefect_events(api_url, event={"name": ["tunepod.webhook.s3eb"]}, occurred={"since": since})
    named = {event["payload"]["body"]["detail"]["bucket"]["name"] for event in published}
    assert accepted.json()["event_id"] in {event["id"] for event in published}
    assert named == {ALLOWED_BUCKET}


def test_an_eventbridge_key_is_checked_before_the_body(receiver: Receiver) -> None:
    """Without the key, the answer is 401 whatever the body: not JSON, the wrong type, over the size
    limit, an event naming a bucket outside the allow list. Nothing about the body is looked at."""
    wrong = {API_KEY_HEADER: API_KEY + "0"}
    cases = {
        "not json": receiver.post("s3eb", b"{not json", wrong),
        "text/plain": receiver.post("s3eb", b"{}", {**wrong, "Content-Type": "text/plain"}),
        "over 1 MiB": receiver.post("s3eb", b"x" * (MAX_BODY_BYTES + 1), {}),
        "forbidden": post_as_api_destination(receiver, object_created("attacker-bucket", "x"), API_KEY + "0"),
    }
    assert {case: answer.status_code for case, answer in cases.items()} == dict.fromkeys(cases, 401)


def test_a_request_without_the_key_never_has_its_body_read(
    config: WebhookConfig, api_url: str, tmp_path: Path
) -> None:
    """The app itself, called as a server calls it: asked for its answer to a keyless request, it
    never asks the server for the body."""
    reads: list[int] = []

    async def receive() -> dict[str, Any]:
        reads.append(1)
        return {"type": "http.request", "body": b"{not json", "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/hooks/s3eb", "raw_path": b"/hooks/s3eb", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    with httpx.Client(timeout=30) as http:
        app = create_app(
            config, in_thread(PrefectEventSink(api_url, http)), tmp_path, registry=CollectorRegistry()
        )
        try:
            asyncio.run(app(scope, receive, send))
        finally:
            app.state.publisher.stop()
    assert sent[0]["status"] == 401 and b"missing header X-Tunepod-Key" in sent[1]["body"]
    assert reads == []


def test_a_newline_in_a_body_field_cannot_forge_a_log_line(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    """The receiver's log quotes the event's id (accepted, duplicate) and the reasons it refuses one,
    which quote its fields: each is escaped, so what a sender writes stays inside its own line."""
    caplog.set_level(logging.INFO, logger="tunepod.webhook")
    forged_line = "\r\nINFO:     tunepod.webhook: webhook s3eb accepted delivery 'x' as event forged"
    event = object_created(ALLOWED_BUCKET, "digits/v5/train.npz", event_id="real" + forged_line)
    assert post_as_api_destination(receiver, event).status_code == 202
    assert post_as_api_destination(receiver, event).status_code == 200
    poisoned = object_created("attacker-bucket", "poison/" + forged_line)
    assert post_as_api_destination(receiver, poisoned).status_code == 403
    stale = {**object_created(ALLOWED_BUCKET, "digits/x"), "time": "2021" + forged_line}
    assert post_as_api_destination(receiver, stale).status_code == 401

    lines = [record.getMessage() for record in caplog.records if record.name == "tunepod.webhook"]
    assert [line for line in lines if "\n" in line or "\r" in line] == []
    quoted = repr("real" + forged_line)
    assert any(f"accepted delivery {quoted} as event" in line for line in lines), lines
    assert any(f"delivery {quoted} is a duplicate" in line for line in lines), lines
    assert any("rejected 403 forbidden" in line and "poison/\\\\r\\\\nINFO" in line for line in lines), lines
    assert any("rejected 401 unauthorized" in line and "2021\\\\r\\\\nINFO" in line for line in lines), lines


class _CloudFormationLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short tags (!Ref, !GetAtt, ...), each read as {tag: value}."""


_CloudFormationLoader.add_multi_constructor(
    "!",
    lambda loader, tag, node: {
        tag: loader.construct_sequence(node)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)
    },
)


def test_the_eventbridge_deploy_file_sends_what_the_hook_checks(in_repo: Path) -> None:
    """deployments/aws/s3-eventbridge.yaml: its connection sends the header the receiver reads, its
    URL pattern takes the example hook's URL, and EventBridge stops retrying an event before the
    receiver's dedupe window ends (a later copy would be refused as a replay, never run twice)."""
    template = yaml.load((in_repo / "deployments/aws/s3-eventbridge.yaml").read_text(), _CloudFormationLoader)
    resources = template["Resources"]
    auth = resources["Connection"]["Properties"]["AuthParameters"]["ApiKeyAuthParameters"]
    assert auth["ApiKeyName"] == API_KEY_HEADER
    url = template["Parameters"]["ReceiverUrl"]["AllowedPattern"]
    assert re.fullmatch(url, "https://tunepod.example.com/hooks/s3-eventbridge")
    assert template["Parameters"]["ApiKey"]["MinLength"] == MIN_API_KEY_CHARS
    [target] = resources["ObjectCreatedRule"]["Properties"]["Targets"]
    assert target["RetryPolicy"]["MaximumEventAgeInSeconds"] <= DEDUPE_TTL_S
    pattern = resources["ObjectCreatedRule"]["Properties"]["EventPattern"]
    assert (pattern["source"], pattern["detail-type"]) == (["aws.s3"], ["Object Created"])


def test_every_example_hook_triggers_a_deployment(in_repo: Path) -> None:
    """A hook whose event no deployment expects is accepted and published, and starts nothing."""
    config = load_webhook_config(in_repo / "deployments/webhooks.yaml", EXAMPLE_SECRETS)
    document = yaml.safe_load((in_repo / "deployments/prefect.yaml").read_text())
    expected = {
        event
        for deployment in document["deployments"]
        for trigger in deployment.get("triggers") or []
        for event in trigger.get("expect") or []
    }
    assert {f"tunepod.webhook.{name}" for name in config.hooks} <= expected
