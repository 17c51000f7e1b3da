"""A TCP forwarder on loopback: what a test uses to make a real server unreachable, then reachable again,
on an address a client already holds (the client sees refused connections, then the real server)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


def _pipe(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def forwarding(listen_port: int, target_host: str, target_port: int) -> Iterator[None]:
    """Accept on 127.0.0.1:``listen_port`` and relay each connection to the target, until exit."""
    server = socket.create_server(("127.0.0.1", listen_port), reuse_port=False)
    server.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection((target_host, target_port))
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, target), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        server.close()
