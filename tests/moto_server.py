"""A real moto server on loopback for the AWS tests: real HTTP, real botocore, no patching.

moto answers an unimplemented call with HTTP 500, which botocore retries: clients made here use one
attempt, so such a call fails at once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=1)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(  # noqa: B904 (the connection error is expected, not the cause)
                        f"moto server did not start: {process.stderr.read() if process.stderr else ''}"
                    )
                time.sleep(0.2)
        yield MotoServer(url)
    finally:
        process.terminate()
        process.wait(timeout=10)
