"""Which deliveries the receiver accepted, and their events until Prefect has them: SQLite, so it
survives restarts.

Senders retry: GitHub redelivers, Standard Webhooks senders retry until they see a 2xx. Each delivery id
(per hook) maps to the id of the one event it produced, so a retry is answered with that event id and
publishes nothing. The delivery id is the dedupe key the receiver chose, one the signature covers:
``webhook-id`` for Standard Webhooks, the body's digest for GitHub (``signatures.github_dedupe_key``).
A claim also keeps its event (name, resource, payload) until it is published: the
receiver answers 202 once the claim is on disk and publishes from here (``unpublished``,
``mark_published``), so an event outlives a Prefect outage or a receiver restart. Published entries
older than ``ttl_s`` are forgotten (a sender does not retry for days); unpublished ones stay, and so
do those set aside as never sendable (``mark_refused``, ``refused``: kept with the reason, Prefect's
answer or what Prefect could not take).

Durability: the file is in WAL mode. A claim commits with ``synchronous=FULL``, so it is on disk (the
WAL fsynced) before ``claim`` returns, at the cost of one fsync per claim rather than the rollback
journal's several. The publisher's marks commit with ``synchronous=NORMAL`` (no fsync; they survive
a crash of the process, and a power loss can only undo the last ones): a mark undone means an event
published again under its same id, which Prefect keeps once, so a second fsync per delivery would buy
nothing; a set-aside mark undone means the event is met again and set aside again, for the same reason.
WAL needs the file on a local filesystem (not NFS), like any SQLite file shared by processes.

Thread and process safety: each thread keeps one connection of its own (opening one costs more than
the query) and every call runs one transaction, so one ``DeliveryLog`` may be shared by threads, and
two receivers may share the file (SQLite's lock serialises them; ``timeout_s`` is how long a call
waits for it).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TTL_S = 24 * 60 * 60

_SCHEMA = """
CREATE TABLE IF NOT EXISTS deliveries (
    hook TEXT NOT NULL,
    delivery_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    received_at REAL NOT NULL,
    PRIMARY KEY (hook, delivery_id)
);
CREATE INDEX IF NOT EXISTS deliveries_received_at ON deliveries (received_at);
"""
# Added after the first release: a file written before has every event published (it published before
# answering), hence the default of the first column for its rows. ``published``: 0 waiting, 1
# published, 2 set aside, never to be sent (``refusal`` says why; the event is kept).
_EVENT_COLUMNS = {"published": "INTEGER NOT NULL DEFAULT 1", "event": "TEXT", "refusal": "TEXT"}
_REFUSED = 2


@dataclass(frozen=True)
class PendingEvent:
    """An accepted delivery's event that Prefect does not have yet."""

    hook: str
    delivery_id: str
    event_id: str
    event: dict[str, Any]
    """``name``, ``resource`` and ``payload``, as the sink takes them."""


class DeliveryLog:
    """Delivery id -> event id, per hook, in the SQLite file at ``path`` (created with its folder)."""

    def __init__(
        self,
        path: Path,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._local = threading.local()
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._transaction() as conn:
            conn.executescript(_SCHEMA)
            present = {row[1] for row in conn.execute("PRAGMA table_info(deliveries)")}
            for column, declaration in _EVENT_COLUMNS.items():
                if column not in present:
                    conn.execute(f"ALTER TABLE deliveries ADD COLUMN {column} {declaration}")
            conn.execute(
                "CREATE INDEX IF NOT EXISTS deliveries_unpublished ON deliveries (published, received_at)"
            )

    @property
    def ttl_s(self) -> float:
        """How long a published delivery is remembered: a copy of it arriving later is new."""
        return self._ttl_s

    def event_for(self, hook: str, delivery_id: str) -> str | None:
        """The event id recorded for this delivery, or None if it is new (or expired)."""
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT event_id FROM deliveries WHERE hook = ? AND delivery_id = ? AND received_at >= ?",
                (hook, delivery_id, self._clock() - self._ttl_s),
            ).fetchone()
        return None if row is None else str(row[0])

    def claim(self, hook: str, delivery_id: str, event_id: str, event: Mapping[str, Any]) -> str | None:
        """Record ``event_id`` and its ``event`` (unpublished) for this delivery unless one is recorded.

        Returns None when the claim is new (its event is then on disk, waiting in ``unpublished``),
        else the event id recorded first. Atomic: of two concurrent claims of one delivery exactly
        one gets None.
        """
        now = self._clock()
        with self._transaction() as conn:
            conn.execute(
                "DELETE FROM deliveries WHERE received_at < ? AND published = 1", (now - self._ttl_s,)
            )
            inserted = conn.execute(
                "INSERT OR IGNORE INTO deliveries"
                " (hook, delivery_id, event_id, received_at, published, event) VALUES (?, ?, ?, ?, 0, ?)",
                (hook, delivery_id, event_id, now, json.dumps(event)),
            ).rowcount
            if inserted:
                return None
            row = conn.execute(
                "SELECT event_id FROM deliveries WHERE hook = ? AND delivery_id = ?", (hook, delivery_id)
            ).fetchone()
        return str(row[0])

    def unpublished(self, limit: int = 100) -> list[PendingEvent]:
        """The oldest ``limit`` events not yet published, oldest first."""
        with self._transaction() as conn:
            rows = conn.execute(
                "SELECT hook, delivery_id, event_id, event FROM deliveries WHERE published = 0"
                " ORDER BY received_at LIMIT ?",
                (limit,),
            ).fetchall()
        return [
            PendingEvent(hook, delivery, event_id, json.loads(event))
            for (hook, delivery, event_id, event) in rows
        ]

    def mark_published(self, published: Sequence[PendingEvent]) -> None:
        """Prefect has these events: drop their copies, keep the delivery ids for dedupe (one commit)."""
        with self._transaction(durable=False) as conn:
            conn.executemany(
                "UPDATE deliveries SET published = 1, event = NULL WHERE hook = ? AND delivery_id = ?"
                " AND event_id = ?",
                [(pending.hook, pending.delivery_id, pending.event_id) for pending in published],
            )

    def mark_refused(self, pending: PendingEvent, reason: str) -> None:
        """``pending``'s event can never be sent (Prefect refused it, or could never take it): keep it,
        with ``reason``, out of the queue, so the events after it go on."""
        with self._transaction(durable=False) as conn:
            conn.execute(
                "UPDATE deliveries SET published = ?, refusal = ? WHERE hook = ? AND delivery_id = ?"
                " AND event_id = ?",
                (_REFUSED, reason, pending.hook, pending.delivery_id, pending.event_id),
            )

    def refused(self) -> list[tuple[PendingEvent, str]]:
        """The events set aside by ``mark_refused``, oldest first, each with its reason."""
        with self._transaction() as conn:
            rows = conn.execute(
                "SELECT hook, delivery_id, event_id, event, refusal FROM deliveries WHERE published = ?"
                " ORDER BY received_at",
                (_REFUSED,),
            ).fetchall()
        return [
            (PendingEvent(hook, delivery, event_id, json.loads(event)), str(refusal))
            for (hook, delivery, event_id, event, refusal) in rows
        ]

    @contextmanager
    def _transaction(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction on this thread's connection; ``durable``: its commit fsyncs the WAL."""
        conn = self._connection(durable)
        with conn:
            yield conn

    def _connection(self, durable: bool) -> sqlite3.Connection:
        """This thread's connection, opened on first use (it closes when the thread ends)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self._timeout_s)
            conn.execute("PRAGMA journal_mode=WAL")  # kept in the file
            self._local.conn, self._local.durable = conn, None
        if self._local.durable is not durable:
            # Per connection, outside a transaction: FULL fsyncs the WAL at every commit (a committed
            # claim survives a power loss), NORMAL leaves it to the checkpoints.
            conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._local.durable = durable
        return conn
