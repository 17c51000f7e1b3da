"""``tunepod.stack.watch`` against a real HTTP server that stops and starts again on its port (the whole
fault, with Prefect, is ``tests/integration/test_stack.py::test_a_run_rides_out_its_prefect_...``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from ports import free_port

from tunepod.stack.watch import TEMPORARY_SERVER_BOOT_S, ServerWatch, lost_server


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def serve_health(port: int) -> ThreadingHTTPServer:
    """A server whose ``/api/health`` answers 200, on ``port``, until ``stop(server)``."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


def test_lost_server_finds_the_connection_error_behind_a_failure() -> None:
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    try:
        try:
            raise refused
        except httpx.ConnectError as exc:
            raise RuntimeError("flow run crashed") from exc
    except RuntimeError as wrapped:
        assert lost_server(wrapped) is refused
    assert lost_server(ValueError("a step failed")) is None
    assert lost_server(httpx.HTTPStatusError("422", request=None, response=None)) is None  # type: ignore[arg-type]


def test_the_watch_says_when_the_server_goes_and_when_it_is_back(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    caplog.set_level(logging.WARNING, logger="tunepod.stack.watch")
    server = serve_health(port)
    try:
        with ServerWatch(api, poll_s=0.05):
            stop(server)
            deadline = time.monotonic() + 30
            while not any("does not answer" in m for m in caplog.messages):
                assert time.monotonic() < deadline, "the watch never said the server is gone"
                time.sleep(0.05)
            assert_lost_connection_logged_without_traceback()
            server = serve_health(port)  # back on its port; the watch ends before its next poll
    finally:
        stop(server)
    [gone, back] = caplog.messages
    assert f"Prefect server {api} does not answer (" in gone and "tunepod up" in gone, gone
    assert f"Prefect server {api} answers again" in back, back


def assert_lost_connection_logged_without_traceback() -> None:
    record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 0, "crashed", None, None)
    try:
        raise httpx.ConnectError("[Errno 111] Connection refused")
    except httpx.ConnectError as exc:
        record.exc_info = (type(exc), exc, exc.__traceback__)
    assert logging.getLogger("prefect.flow_runs").filter(record)
    assert record.exc_info is None, "the watch drops the traceback of a lost connection"


def test_every_run_gives_prefects_temporary_server_two_minutes_to_boot() -> None:
    # In a fresh interpreter without the test suite's own setting (conftest sets the same variable):
    # Prefect itself must read the name tunepod sets, or a busy machine fails runs at Prefect's 20 s.
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    code = (
        "import os\n"
        "from tunepod.stack.watch import run_environment_defaults\n"
        "for name, value in run_environment_defaults().items(): os.environ.setdefault(name, value)\n"
        "from prefect.settings import get_current_settings\n"
        "print(get_current_settings().server.ephemeral.startup_timeout_seconds)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == TEMPORARY_SERVER_BOOT_S == 120
