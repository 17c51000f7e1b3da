"""Preemption: SIGTERM read as "save and stop", for scripts that ask (``ctx.should_stop()``).

Every way a job is stopped ends in SIGTERM to its processes, then SIGKILL after a grace period
(``resources.stop_grace_s``): a prune or timeout by tunepod, ``scontrol requeue`` or preemption on
Slurm (its KillWait), the time limit (``sbatch --signal``), a pod eviction on EKS, a SageMaker stop.
A script that calls ``should_stop`` in its loop gets the grace period to save a checkpoint; the
job is then restarted (or requeued by Slurm) and resumes from it. A script that never asks keeps
SIGTERM's default: it dies at once, as it would without tunepod.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

STOP_SIGNAL = signal.SIGTERM


class StopRequest:
    """Whether this process was asked to stop, and since when."""

    def __init__(self, on_request: Callable[[str, float], None] | None = None) -> None:
        self.signal_name: str | None = None
        self.requested_at: float | None = None
        self._on_request = on_request
        self._asked = False

    def install(self) -> StopRequest:
        """Take over SIGTERM, unless someone else already handles it (the script, a framework) or
        this is not the main thread (Python only lets the main thread set handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        if signal.getsignal(STOP_SIGNAL) is not signal.SIG_DFL:
            return self
        signal.signal(STOP_SIGNAL, self._on_signal)
        return self

    def requested(self) -> bool:
        """Whether a stop was asked for; from the first call on, SIGTERM no longer kills at once."""
        self._asked = True
        return self.signal_name is not None

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self._asked:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signal_name is not None:
            return
        self.signal_name = signal.Signals(signum).name
        self.requested_at = time.time()
        if self._on_request is not None:
            self._on_request(self.signal_name, self.requested_at)
