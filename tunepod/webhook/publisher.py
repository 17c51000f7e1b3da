"""Sends accepted deliveries' events to Prefect from the delivery log, on a thread of its own.

The receiver answers 202 as soon as a delivery's claim (with its event) is on disk; this thread
publishes what the log holds unpublished, oldest first, every event waiting in one request (under
load, events accumulate while a request is out), and marks them published in one commit. When Prefect
does not take an event, it waits (0.5 s, doubling to ``max_backoff_s``) and tries again, never dropping
one: a Prefect outage delays runs, it loses no delivery, and a receiver restarted after a crash
publishes what the last one had not. Each event keeps the id the sender was given, so one published
twice (a crash between Prefect's answer and the mark) is one event id at Prefect.

Set aside, never retried: an event that cannot be sent for good (``EventRefused``). Either Prefect
refused it as invalid (400, 413, 422), or the sink found before sending that Prefect could never take
it (``EventUnsendable``: a number beyond a float, a lone surrogate, NUL, nesting or size past Prefect's
limits; the receiver refuses such deliveries, but a log written by an earlier version may hold them).
It is marked in the log with the reason (``DeliveryLog.refused`` lists them) and logged as an error,
and the events after it go on. Everything else (no answer, a timeout, 5xx, 401/403/404, which an
operator fixes) is retried, the event staying first in line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tunepod.webhook.dedupe import DeliveryLog, PendingEvent
from tunepod.webhook.events import EventRefused, EventSink, EventSinkError, OutgoingEvent

logger = logging.getLogger("tunepod.webhook")

IDLE_CHECK_S = 5.0
"""How often an idle publisher looks at the log anyway (another receiver may share the file)."""
BATCH_EVENTS = 100
"""The most events one request to Prefect carries."""
LINGER_S = 0.05
"""How long a woken publisher lets deliveries gather before it sends them in one request: under load,
one POST per 50 ms instead of one per delivery (its HTTP client's CPU competed with the receiver's
answers for the interpreter lock); a pipeline run starts 50 ms later, out of seconds."""


class Publisher(Protocol):
    """What the receiver needs of a publisher, in this process or another (``publisher_process``)."""

    def wake(self) -> None: ...

    def stop(self, timeout_s: float = ...) -> None: ...


class EventPublisher:
    """One thread publishing ``deliveries``' unpublished events to ``sink``; ``wake`` after a claim."""

    def __init__(
        self,
        deliveries: DeliveryLog,
        sink: EventSink,
        *,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        linger_s: float = LINGER_S,
    ) -> None:
        self._deliveries = deliveries
        self._sink = sink
        self._linger_s = linger_s
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._down_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="tunepod-webhook-publisher", daemon=True)

    def start(self) -> EventPublisher:
        self._thread.start()
        return self

    def wake(self) -> None:
        """A claim was just recorded: publish it now rather than at the next idle check."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the event being sent (what is left stays in the log for the next start)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff_s = self._first_backoff_s
        while not self._stop.is_set():
            self._wake.clear()
            self._stop.wait(self._linger_s)
            try:
                published_all = self._publish_pending()
            except Exception:  # the thread must outlive anything; the log keeps the events
                logger.exception("webhook publisher: unexpected error; retrying")
                published_all = False
            if published_all:
                backoff_s = self._first_backoff_s
                self._wake.wait(IDLE_CHECK_S)
            else:
                self._stop.wait(backoff_s)
                backoff_s = min(self._max_backoff_s, backoff_s * 2)

    def _publish_pending(self) -> bool:
        """Publish the log's unpublished events, oldest first, as many per request as are waiting (a
        backlog of more than one request's worth, one request after the other); False when Prefect
        did not take them. Events claimed meanwhile woke the thread: they go after the next linger."""
        while not self._stop.is_set():
            batch = self._deliveries.unpublished(BATCH_EVENTS)
            if not batch:
                return True
            try:
                self._sink.publish_all([_outgoing(pending) for pending in batch])
            except EventSinkError as exc:
                self._note_down(batch[0], exc)
                return False
            except EventRefused:
                # One invalid event refuses the whole request: one at a time, it is set aside alone.
                if not all(self._publish_alone(pending) for pending in batch):
                    return False
                continue
            self._published(batch)
            if len(batch) < BATCH_EVENTS:
                return True
        return True

    def _publish_alone(self, pending: PendingEvent) -> bool:
        try:
            self._sink.publish_all([_outgoing(pending)])
        except EventSinkError as exc:
            self._note_down(pending, exc)
            return False
        except EventRefused as exc:
            self._deliveries.mark_refused(pending, str(exc))
            logger.error(
                # %r: the delivery id is the sender's, and Prefect's reason may quote the body.
                "webhook %s: set aside event %s of delivery %r, never to be sent (%r); it is kept in %s "
                "with this reason (published = 2) and the events after it go on",
                pending.hook,
                pending.event_id,
                pending.delivery_id,
                str(exc),
                self._deliveries.path,
            )
            return True
        self._published([pending])
        return True

    def _note_down(self, pending: PendingEvent, exc: EventSinkError) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "webhook: Prefect did not take event %s of hook %s (%s); accepted deliveries are kept "
                "in %s and published when it answers",
                pending.event_id,
                pending.hook,
                exc,
                self._deliveries.path,
            )

    def _published(self, batch: list[PendingEvent]) -> None:
        self._deliveries.mark_published(batch)
        if self._down_since is not None:
            logger.warning(
                "webhook: Prefect answers again after %.0fs; publishing the events kept meanwhile",
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        logger.info("webhook: published %s", ", ".join(f"event {p.event_id} of {p.hook}" for p in batch))


def in_thread(sink: EventSink) -> Callable[[DeliveryLog], EventPublisher]:
    """For ``create_app``: publish to ``sink`` from a thread of the receiver's process (tests, embedding)."""
    return lambda deliveries: EventPublisher(deliveries, sink).start()


def _outgoing(pending: PendingEvent) -> OutgoingEvent:
    event = pending.event
    return OutgoingEvent(pending.event_id, event["name"], event["resource"], event["payload"])
