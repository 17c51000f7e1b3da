"""Prefect's temporary server, started ahead of the flow call (``tunepod run`` with no server set)."""

from __future__ import annotations

import threading
from concurrent.futures import Future


def boot_temporary_server() -> Future[None]:
    """Start the temporary server Prefect would start inside the flow call, now, in the background:
    its seconds of booting (a process of its own) overlap the caller's imports and MLflow's start-up.
    It is Prefect's own singleton, so the flow's client finds it running and Prefect stops it at exit
    as it would have. The future fails as the flow call would if the server cannot start."""
    booted: Future[None] = Future()

    def boot() -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().start()
        except BaseException as exc:
            booted.set_exception(exc)
        else:
            booted.set_result(None)

    threading.Thread(target=boot, name="prefect-server-boot", daemon=True).start()
    return booted
