"""The study journal's lock is an flock: a writer SIGKILLed while holding it blocks nobody after."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from holder import hold

from tunepod.hpo.study import FlockJournalLock


def test_a_sigkilled_holder_releases_the_journal_lock(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.log"
    holder = hold(
        f"""
        from tunepod.hpo.study import FlockJournalLock
        FlockJournalLock(Path({str(journal)!r})).acquire()
        """
    )
    waiter_done = threading.Event()

    def wait_for_lock() -> None:
        lock = FlockJournalLock(journal)
        lock.acquire()
        lock.release()
        waiter_done.set()

    threading.Thread(target=wait_for_lock, daemon=True).start()
    assert not waiter_done.wait(0.5), "the lock was not exclusive"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert waiter_done.wait(10), "the lock of a killed holder was never released"
