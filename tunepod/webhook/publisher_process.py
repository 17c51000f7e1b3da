"""The publisher in a process of its own: what ``tunepod webhook serve`` runs.

In the receiver's process the publisher thread's HTTP client took the interpreter lock from the
threads answering senders: measured, holding it back took 4 ms off the receiver's p95 at one delivery
in flight. Here the receiver only writes one byte to a pipe per claim (``wake``); the child process
(``python -m tunepod.webhook.publisher_process LOG API_URL``) runs the same ``EventPublisher`` on its
own connection to the delivery log, which SQLite shares between processes.

Lifetime: the pipe is the child's stdin. Its end of file (the receiver stopped, or was killed) stops
the child after the request in flight; whatever is left stays in the log for the next receiver. A
child that dies (killed, out of memory) is started again after ``restart_delay_s`` by a thread that
waits on it, and publishes what waited meanwhile: accepted deliveries are never lost, only delayed.
Ctrl-C at a terminal and SIGTERM to the process group reach both processes; the child ignores them
and stops when the receiver does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tunepod.webhook.dedupe import DeliveryLog

logger = logging.getLogger("tunepod.webhook")

RESTART_DELAY_S = 1.0
"""How long after a child's unexpected exit the next one starts (a child dying at start-up again and
again then costs one start a second, not a busy loop)."""
_WAKE = b"\0"


class PublisherProcess:
    """Runs and supervises the child publishing ``log_path``'s events to the Prefect API ``api_url``.

    The child reads ``PREFECT_API_AUTH_STRING`` from the environment it inherits (never from its
    arguments, which ``ps`` shows).
    """

    def __init__(self, log_path: Path, api_url: str, *, restart_delay_s: float = RESTART_DELAY_S) -> None:
        self._argv = [sys.executable, "-m", __name__, str(log_path), api_url]
        self._restart_delay_s = restart_delay_s
        self._lock = threading.Lock()  # the child and its pipe change together, under it
        self._stopping = threading.Event()
        self._child: subprocess.Popen[bytes] | None = None
        self._supervisor = threading.Thread(
            target=self._supervise, name="tunepod-webhook-publisher-supervisor", daemon=True
        )

    def start(self) -> PublisherProcess:
        with self._lock:
            self._child = self._spawn()
        self._supervisor.start()
        return self

    def wake(self) -> None:
        """A claim was just recorded: tell the child to publish it now (never waits on the child)."""
        # Under the lock: a pipe closed by ``stop`` or a restart between reading its descriptor and
        # writing to it could otherwise be a new file by then.
        with self._lock:
            child = self._child
            if child is None or child.stdin is None or child.stdin.closed:
                return
            # Full: the child has wake-ups waiting already. Broken: it is gone, and the supervisor's
            # next child publishes everything unpublished when it starts.
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                os.write(child.stdin.fileno(), _WAKE)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the child's pipe, so it stops after the request in flight; kill it after ``timeout_s``."""
        self._stopping.set()
        with self._lock:
            child = self._child
            if child is not None and child.stdin is not None:
                child.stdin.close()
        if child is not None:
            try:
                child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("webhook: the publisher process did not stop in %.0fs; killing it", timeout_s)
                child.kill()
                child.wait()
        if self._supervisor.is_alive():
            self._supervisor.join(timeout_s)

    def _spawn(self) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(self._argv, stdin=subprocess.PIPE)
        assert child.stdin is not None
        os.set_blocking(child.stdin.fileno(), False)
        return child

    def _supervise(self) -> None:
        while True:
            child = self._child
            assert child is not None
            code = child.wait()
            if self._stopping.is_set():
                return
            logger.error(
                "webhook: the publisher process exited with %s; starting another in %.0fs (accepted "
                "deliveries wait in the delivery log meanwhile)",
                code,
                self._restart_delay_s,
            )
            if self._stopping.wait(self._restart_delay_s):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                if child.stdin is not None:
                    child.stdin.close()
                self._child = self._spawn()


def in_process(api_url: str) -> Callable[[DeliveryLog], PublisherProcess]:
    """For ``create_app``: publish to ``api_url`` from a process of its own."""
    return lambda deliveries: PublisherProcess(deliveries.path, api_url).start()


def main(argv: Sequence[str] | None = None) -> int:
    """The child: publish LOG's events to API_URL, woken by each byte on stdin, until its end."""
    import httpx

    from tunepod.webhook.events import PrefectEventSink, prefect_auth
    from tunepod.webhook.publisher import EventPublisher

    log_path, api_url = argv if argv is not None else sys.argv[1:]
    # The receiver decides when this stops (by closing the pipe): Ctrl-C at a terminal and `tunepod
    # down`'s SIGTERM to the process group reach both, and the receiver's graceful stop, not a child
    # dying beside it, ends the request in flight. SIGKILL still ends it at once.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    with httpx.Client(auth=prefect_auth()) as client:
        publisher = EventPublisher(DeliveryLog(Path(log_path)), PrefectEventSink(api_url, client)).start()
        try:
            while os.read(sys.stdin.fileno(), 4096):
                publisher.wake()
        finally:
            publisher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
