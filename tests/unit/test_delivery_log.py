"""The receiver's delivery log on a real SQLite file: claims keep their event until published, a file
written by an earlier receiver (which published before answering) opens with nothing to publish."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tunepod.webhook.dedupe import DeliveryLog

EVENT = {"name": "tunepod.webhook.digits", "resource": {"prefect.resource.id": "x"}, "payload": {"n": 1}}


def test_a_claim_waits_unpublished_in_order_until_marked(tmp_path: Path) -> None:
    clock = iter(range(100))
    log = DeliveryLog(tmp_path / "d.sqlite3", clock=lambda: float(next(clock)))
    assert log.claim("digits", "msg-1", "event-1", EVENT) is None
    assert log.claim("digits", "msg-2", "event-2", {**EVENT, "payload": {"n": 2}}) is None
    assert log.claim("digits", "msg-1", "event-9", EVENT) == "event-1"  # a copy: the first's event
    pending = log.unpublished()
    assert [(p.delivery_id, p.event_id, p.event["payload"]) for p in pending] == [
        ("msg-1", "event-1", {"n": 1}),
        ("msg-2", "event-2", {"n": 2}),
    ]
    log.mark_published(pending[:1])
    assert [p.event_id for p in DeliveryLog(tmp_path / "d.sqlite3").unpublished()] == ["event-2"]
    assert log.event_for("digits", "msg-1") == "event-1"  # still a duplicate once published


def test_an_unpublished_event_outlives_the_dedupe_window(tmp_path: Path) -> None:
    now = [0.0]
    log = DeliveryLog(tmp_path / "d.sqlite3", ttl_s=10, clock=lambda: now[0])
    log.claim("digits", "old", "event-old", EVENT)
    now[0] = 100.0
    log.claim("digits", "new", "event-new", EVENT)  # a claim clears expired published entries only
    assert [p.event_id for p in log.unpublished()] == ["event-old", "event-new"]


def test_a_log_from_a_receiver_that_published_before_answering_has_nothing_to_publish(tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite3"
    with sqlite3.connect(path) as old:
        old.execute(
            "CREATE TABLE deliveries (hook TEXT NOT NULL, delivery_id TEXT NOT NULL, event_id TEXT NOT NULL,"
            " received_at REAL NOT NULL, PRIMARY KEY (hook, delivery_id))"
        )
        old.execute("INSERT INTO deliveries VALUES ('digits', 'msg-1', 'event-1', 1e12)")
    log = DeliveryLog(path)
    assert log.unpublished() == []
    assert log.event_for("digits", "msg-1") == "event-1"
    assert log.claim("digits", "msg-2", "event-2", EVENT) is None
    assert [p.event_id for p in log.unpublished()] == ["event-2"]


def test_a_refused_event_leaves_the_queue_and_is_kept_with_the_answer_past_the_window(tmp_path: Path) -> None:
    now = [0.0]
    log = DeliveryLog(tmp_path / "d.sqlite3", ttl_s=10, clock=lambda: now[0])
    log.claim("digits", "msg-1", "event-1", EVENT)
    log.claim("digits", "msg-2", "event-2", EVENT)
    first, _ = log.unpublished()
    log.mark_refused(first, "422: resource has no id")
    assert [p.event_id for p in log.unpublished()] == ["event-2"]
    now[0] = 100.0
    log.claim("digits", "msg-3", "event-3", EVENT)  # expired published entries are cleared, not refused ones
    [(refused, answer)] = DeliveryLog(tmp_path / "d.sqlite3").refused()
    assert (refused.event_id, refused.event, answer) == ("event-1", EVENT, "422: resource has no id")
    assert log.claim("digits", "msg-1", "event-9", EVENT) == "event-1"  # still a duplicate
