"""The benchmark's data: a local folder of many small files and a few large ones, and the same files
uploaded to a real moto S3 server started on loopback for the run."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REGION = "us-east-1"
BUCKET = "bench-staging"
PREFIX = "dataset/"
#: Files per folder of small files, so the tree has depth like a real dataset.
FILES_PER_FOLDER = 100


@dataclass(frozen=True)
class DataSpec:
    small_files: int
    small_kb: float
    large_files: int
    large_mb: float


@dataclass(frozen=True)
class Dataset:
    root: Path
    num_files: int
    num_bytes: int


def write_dataset(root: Path, spec: DataSpec, seed: int = 0) -> Dataset:
    """Random (incompressible) files under ``root``: ``small/NNN/fNNNNN.bin`` of 0.5x-1.5x ``small_kb``
    KB each, and ``large/big-N.bin`` of ``large_mb`` MB each."""
    rng = random.Random(seed)
    num_bytes = 0
    for index in range(spec.small_files):
        size = max(1, round(spec.small_kb * 1000 * rng.uniform(0.5, 1.5)))
        path = root / "small" / f"{index // FILES_PER_FOLDER:03d}" / f"f{index:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        num_bytes += size
    for index in range(spec.large_files):
        path = root / "large" / f"big-{index}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        size = round(spec.large_mb * 1e6)
        with open(path, "wb") as handle:
            for start in range(0, size, 16 << 20):
                handle.write(os.urandom(min(16 << 20, size - start)))
        num_bytes += size
    return Dataset(root, spec.small_files + spec.large_files, num_bytes)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class Server:
    url: str
    pid: int


@contextmanager
def moto_server(log: Path) -> Iterator[Server]:
    """``moto.server`` on a free loopback port (a process of its own, as an S3 endpoint is). Its
    request log goes to the file ``log``: a pipe nobody reads would fill and stall the server."""
    port = free_port()
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
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
                    raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield Server(url, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def aws_env(work: Path, endpoint_url: str) -> dict[str, str]:
    """The environment of every side: moto's dummy credentials, no profile or config of the user's."""
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_CONFIG_FILE": str(work / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(work / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def s3_client(endpoint_url: str) -> Any:
    """A boto3 client of moto that keeps timestamps as the strings S3 sent (as the AWS CLI does): the
    listing floor below then measures S3's listing, not the parsing of dates."""
    import boto3
    import botocore.session
    from botocore.config import Config

    session = botocore.session.get_session()
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    return boto3.session.Session(botocore_session=session).client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(max_pool_connections=16),
    )


def upload(dataset: Dataset, endpoint_url: str) -> None:
    """Put every file of ``dataset`` under ``s3://BUCKET/PREFIX``: small ones 16 at a time, large ones
    as boto3 uploads them (multipart above 8 MB, so their ETags are multipart ETags, as in real data)."""
    client = s3_client(endpoint_url)
    client.create_bucket(Bucket=BUCKET)
    files = sorted(path for path in dataset.root.rglob("*") if path.is_file())
    small = [path for path in files if path.stat().st_size < 8 << 20]
    large = [path for path in files if path.stat().st_size >= 8 << 20]

    def put(path: Path) -> None:
        key = PREFIX + path.relative_to(dataset.root).as_posix()
        client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, small))
    for path in large:
        client.upload_file(str(path), BUCKET, PREFIX + path.relative_to(dataset.root).as_posix())


def list_seconds(endpoint_url: str) -> float:
    """How long listing the prefix takes (boto3's paginator, a client made beforehand): the floor of
    any unchanged re-stage, which must list to know that nothing changed."""
    client = s3_client(endpoint_url)
    started = time.monotonic()
    for _ in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX):
        pass
    return time.monotonic() - started
