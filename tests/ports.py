"""A free TCP port on loopback, for the servers and rendezvous the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now. Whoever binds it next should do so at once: another process could
    take it in between (the tests accept that small race rather than pass sockets around)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
