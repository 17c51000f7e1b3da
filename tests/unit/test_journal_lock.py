"""The study journal's lock is an flock: a writer SIGKILLed while holding it blocks nobody after."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from tunepod.hpo.study import FlockJournalLock

REPO = Path(__file__).resolve().parents[2]


def test_a_sigkilled_holder_releases_the_journal_lock(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.log"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                sys.path.insert(0, {str(REPO)!r})
                from pathlib import Path
                from tunepod.hpo.study import FlockJournalLock
                FlockJournalLock(Path({str(journal)!r})).acquire()
                print("held", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
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
