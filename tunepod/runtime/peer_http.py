"""The memory tier between nodes: each rank serves its node's job folder over HTTP, and pushes its
memory saves to peers and fetches what a restore needs from them.

Requests (every one carries the attempt's token, drawn by rank 0 and known only to the job's ranks;
anything else is refused):

    GET    /step-000060/<file>                  a step file
    PUT    /step-000060/<file>                  a file: written under a hidden name, then renamed
    DELETE /step-000060/manifest-rank<r>.json   a writer's manifest, before it pushes the step again

A pusher sends its files, then its manifest, last: as on the writer's own node, the manifest's
presence on the peer means the files are complete there. Paths outside the job's step folders are
refused (``memory_store.request_path``). Standard library only.
"""

from __future__ import annotations

import hashlib
import http.client
import shutil
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, Protocol

from tunepod.runtime.memory_store import UnsafePathError, manifest_name, request_path, writing

TOKEN_HEADER = "X-Tunepod-Token"


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


class _Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


TIMEOUT_S = 120.0
_CHUNK = 1 << 20


class PeerError(RuntimeError):
    """A peer refused or failed a request, or its file did not match the manifest."""


class PeerServer:
    """Serves ``job`` (this node's job folder) at ``host`` on a free port, in a daemon thread.

    ``on_manifest`` runs after a pushed manifest lands (the node's local rank 0 prunes there).
    """

    def __init__(
        self, job: Path, host: str, token: str, on_manifest: Callable[[], None] | None = None
    ) -> None:
        # A staticmethod, or the class attribute would bind the handler as its first argument.
        hooks = {
            "job": job,
            "token": token,
            "on_manifest": staticmethod(on_manifest) if on_manifest else None,
        }
        handler = type("Handler", (_Handler,), hooks)
        self._server = ThreadingHTTPServer((host, 0), handler)
        self._server.daemon_threads = True
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="tunepod-peer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    job: Path
    token: str
    on_manifest: Callable[[], None] | None
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self._checked_path()
        if path is None:
            return
        try:
            handle = open(path, "rb")  # noqa: SIM115 - closed below, after the headers went out
        except FileNotFoundError:
            self._reply(404, f"no {path.name}")
            return
        with handle:
            size = path.stat().st_size
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            shutil.copyfileobj(handle, self.wfile, _CHUNK)

    def do_PUT(self) -> None:
        path = self._checked_path()
        if path is None:
            return
        length = int(self.headers.get("Content-Length", "-1"))
        if length < 0:
            self._reply(411, "Content-Length needed")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with writing(path) as handle:
                if _copy_exactly(self.rfile, handle, length) != length:
                    raise PeerError(f"the push of {path.name} ended early")  # discards the hidden file
        except PeerError as exc:
            self._reply(400, str(exc))
            return
        if path.name.startswith("manifest-") and self.on_manifest is not None:
            self.on_manifest()  # before the reply: the pusher's next step finds the old ones pruned
        self._reply(204, "")

    def do_DELETE(self) -> None:
        path = self._checked_path()
        if path is None:
            return
        if not path.name.startswith("manifest-"):
            self._reply(403, "only manifests are deleted by peers")
            return
        path.unlink(missing_ok=True)
        self._reply(204, "")

    def _checked_path(self) -> Path | None:
        if self.headers.get(TOKEN_HEADER) != self.token:
            self._reply(403, "wrong token")
            return None
        try:
            return request_path(self.job, self.path)
        except UnsafePathError as exc:
            self._reply(400, str(exc))
            return None

    def _reply(self, status: int, text: str) -> None:
        body = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would drown the job's log


def push_file(address: str, token: str, step_name: str, source: Path) -> None:
    """PUT ``source`` as ``step_name/<its name>`` on the peer at ``address``."""
    size = source.stat().st_size
    with open(source, "rb") as body:
        _request(address, token, "PUT", f"/{step_name}/{source.name}", body, size)


def delete_manifest(address: str, token: str, step_name: str, writer: int) -> None:
    _request(address, token, "DELETE", f"/{step_name}/{manifest_name(writer)}", None, 0)


def fetch_file(address: str, token: str, step_name: str, into: Path, sha256: str, size: int) -> None:
    """GET ``step_name/<into's name>`` from the peer at ``address`` into ``into`` (hidden name, then
    renamed), checking its size and sha256 against the manifest's; ``PeerError`` when they differ."""
    connection = http.client.HTTPConnection(*_host_port(address), timeout=TIMEOUT_S)
    try:
        connection.request("GET", f"/{step_name}/{into.name}", headers={TOKEN_HEADER: token})
        response = connection.getresponse()
        if response.status != 200:
            raise PeerError(
                f"{address} answered {response.status} for {step_name}/{into.name}: {response.read()!r}"
            )
        digest = hashlib.sha256()
        with writing(into) as handle:
            written = _copy_exactly(response, handle, size, digest)
            if written != size or digest.hexdigest() != sha256:
                raise PeerError(f"{step_name}/{into.name} from {address} does not match its manifest")
    finally:
        connection.close()


def _request(address: str, token: str, method: str, url: str, body: BinaryIO | None, size: int) -> None:
    connection = http.client.HTTPConnection(*_host_port(address), timeout=TIMEOUT_S)
    try:
        headers = {TOKEN_HEADER: token, "Content-Length": str(size)}
        connection.request(method, url, body=body, headers=headers)
        response = connection.getresponse()
        text = response.read()
        if response.status >= 300:
            raise PeerError(f"{address} answered {response.status} to {method} {url}: {text!r}")
    finally:
        connection.close()


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _copy_exactly(
    source: _Readable,
    into: BinaryIO,
    size: int,
    digest: _Digest | None = None,
) -> int:
    """Copy ``size`` bytes (fewer if ``source`` ends first); returns how many were copied."""
    left = size
    while left > 0:
        chunk = source.read(min(_CHUNK, left))
        if not chunk:
            break
        into.write(chunk)
        if digest is not None:
            digest.update(chunk)
        left -= len(chunk)
    return size - left
