"""A real moto server on loopback for the AWS tests: real HTTP, real botocore, no patching.

moto answers an unimplemented call with HTTP 500, which botocore retries: clients made here use one
attempt, so such a call fails at once.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import httpx
from ports import free_port

REGION = "us-east-1"


@dataclass(frozen=True)
class MotoServer:
    endpoint_url: str

    def client(self, service: str) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            service,
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(retries={"max_attempts": 1}),
        )

    def reset(self) -> None:
        """Forget every bucket, job and cluster (moto's own reset endpoint)."""
        httpx.post(f"{self.endpoint_url}/moto-api/reset", timeout=10).raise_for_status()


def put_objects(client: Any, bucket: str, prefix: str, objects: Mapping[str, bytes]) -> None:
    """Create ``bucket`` and put each of ``objects`` (relative key -> bytes) under ``prefix``."""
    client.create_bucket(Bucket=bucket)
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}{key}", Body=data)


@contextmanager
def moto_server() -> Iterator[MotoServer]:
    """Start ``moto.server`` on a free loopback port; stop it on exit."""
    # Its log to a file, never a pipe: moto logs every request, and a pipe nobody reads fills up and
    # stalls the server after a few hundred requests.
    with tempfile.TemporaryFile() as log:
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            yield MotoServer(wait_until_up(f"http://127.0.0.1:{port}", process, log))
        finally:
            process.terminate()
            process.wait(timeout=10)


def wait_until_up(url: str, process: subprocess.Popen[bytes], log: IO[bytes]) -> str:
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/moto-api/", timeout=1)
            return url
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not start: {read_log(log)}") from None
            time.sleep(0.2)


def read_log(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read()[-4000:].decode(errors="replace")
