"""Mirror an S3 prefix (``s3://bucket/prefix/``) into a folder, downloading only what changed.

The rules are those of ``tunepod.staging.folder`` and share its manifest, lock and atomic writes:

- every object under the prefix (listed with pagination) becomes ``<target>/<key minus prefix>``;
  keys ending in ``/`` are folder markers and are skipped;
- each manifest entry records the object's size and ETag, the ETag's kind (``etag-multipart`` when it
  has a ``-N`` suffix, else ``etag``), the ``ChecksumSHA256`` when S3 returned one, and the sha256
  and mtime of the local copy (set to the object's LastModified);
- an object whose size and ETag match its entry, with an intact local copy (same size and mtime;
  with ``verify``, same sha256 as the entry), is not downloaded again;
- a file whose object was deleted is removed only if the manifest lists it and its copy is intact;
- each download goes to a ``.<name>.tunepod-partial`` file renamed over the final name, and asks for
  the listed ETag (``IfMatch``), so a file is never half written nor a mix of two object versions.

Every key is checked before anything is downloaded: one that would land outside the target (``..``)
stops the run. boto3 is imported only when no client is given; it honours ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` and the rest of the standard AWS configuration.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tunepod.errors import TransientError, TunepodError
from tunepod.runtime.files import disk_full_explained, sha256_of
from tunepod.staging.folder import (
    DISK_FULL_FIX,
    LOCK_NAME,
    Manifest,
    ManifestEntry,
    StageReport,
    Synced,
    exclusive,
    is_reserved,
    read_manifest,
    remove_deleted,
    stat_or_none,
    sync_all,
    write_manifest,
    write_stream_atomic,
)

logger = logging.getLogger(__name__)

_BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")
_MULTIPART_ETAG = re.compile(r"[0-9a-fA-F]+-[0-9]+")
_FILE_MODE = 0o644
# A bar for a transfer that takes more than a few seconds; below that it would only flicker.
_PROGRESS_MIN_BYTES = 256 << 20
_PROGRESS_MIN_FILES = 1000
_CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
)
_ACCESS_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "403"})
_CHANGED_CODES = frozenset({"PreconditionFailed", "412", "NoSuchKey"})
INSTALL_HINT = "pip install 'tunepod[aws]'"


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix that names a folder: ``""`` (the whole bucket) or ending in ``/``."""

    bucket: str
    prefix: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class S3Object:
    """One listed object and the path, relative to the target, it is staged to."""

    key: str
    rel: str
    size: int
    etag: str
    last_modified_ns: int

    @property
    def etag_kind(self) -> str:
        return "etag-multipart" if _MULTIPART_ETAG.fullmatch(self.etag) else "etag"


def parse_s3_uri(uri: str) -> S3Location:
    """``s3://bucket/prefix`` -> ``S3Location``; the prefix is a folder, so ``s3://b/data`` and
    ``s3://b/data/`` are the same. Raises ``TunepodError`` for anything else."""
    scheme, separator, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme != "s3" or not separator or not _BUCKET_NAME.fullmatch(bucket) or "//" in f"/{prefix}":
        raise TunepodError(
            f"cannot stage {uri!r}: not an S3 folder URI; fix: write it as s3://BUCKET/PREFIX/ "
            "(bucket name of 3-255 letters, digits, '.', '-', '_'; no empty path segments)"
        )
    return S3Location(bucket, prefix.strip("/") + "/" if prefix.strip("/") else "")


def s3_client(*, max_connections: int = 10) -> Any:
    """A new S3 client from a fresh boto3 session, so credentials are resolved now rather than reused
    from an earlier call. Raises ``TunepodError`` naming the extra to install when boto3 is missing."""
    try:
        import boto3  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TunepodError(f"staging from s3:// needs boto3; fix: {INSTALL_HINT}") from exc
    return boto3.session.Session().client("s3", config=Config(max_pool_connections=max_connections))


def stage_s3(
    uri: str, target: Path, *, client: Any = None, workers: int = 8, verify: bool = False
) -> StageReport:
    """Mirror the objects under ``uri`` into ``target`` (see the module docstring for the rules).

    ``client`` is a boto3 S3 client (default: ``s3_client()``); it is shared by ``workers`` download
    threads, which boto3 clients allow. Raises ``TunepodError`` for a malformed URI, a missing bucket,
    a prefix with no objects, missing or rejected credentials, denied access and a key that would
    escape the target; ``TransientError`` when S3 cannot be reached or an object changed mid-run;
    ``DiskFullError`` when the target's filesystem is full. A failed download is raised after
    recording the downloads that completed. ``verify`` hashes each local copy instead of trusting an
    unchanged size and mtime.
    """
    started = time.monotonic()
    location = parse_s3_uri(uri)
    target = _checked_target(target, location)
    s3 = client if client is not None else s3_client(max_connections=max(workers, 10))
    objects = _listed_objects(s3, location)
    with disk_full_explained(target, DISK_FULL_FIX):
        target.mkdir(parents=True, exist_ok=True)
        with exclusive(target / LOCK_NAME):
            previous = read_manifest(target)
            is_current = functools.partial(_is_current, previous, target, verify)
            current = {obj.rel: previous[obj.rel] for obj in objects if is_current(obj)}
            downloads = [obj for obj in objects if obj.rel not in current]
            with _progress(location, downloads) as on_bytes:
                download = functools.partial(_download, s3, location, target, on_bytes)
                synced = sync_all(downloads, previous, target, workers, download)
            removed = remove_deleted(target, previous, {obj.rel for obj in objects})
            write_manifest(target, {**current, **{rel: result.entry for rel, result in synced.items()}})
    report = StageReport(
        target=target,
        num_files=len(objects),
        num_bytes=sum(obj.size for obj in objects),
        copied_files=len(synced),
        copied_bytes=sum(obj.size for obj in downloads),
        removed_files=removed,
        seconds=time.monotonic() - started,
    )
    logger.info("staged %s -> %s: %s", location.uri, target, report)
    return report


def _checked_target(target: Path, location: S3Location) -> Path:
    target = target.expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise TunepodError(
            f"cannot stage {location.uri} into {target}: it is a file; fix: choose a folder as the target"
        )
    return target


def _listed_objects(s3: Any, location: S3Location) -> list[S3Object]:
    """Every object under the prefix, each key checked to map to a path inside the target."""
    objects: list[S3Object] = []
    with _explained_aws_errors(location, "list"):
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=location.prefix)
        for page in pages:
            objects.extend(obj for item in page.get("Contents", []) if (obj := _object(item, location)))
        if not objects:
            raise _no_objects_error(s3, location)
    return objects


def _object(item: dict[str, Any], location: S3Location) -> S3Object | None:
    """The ``S3Object`` of one listing entry; ``None`` for a folder marker or a reserved name."""
    key: str = item["Key"]
    rel = key[len(location.prefix) :]
    if rel.endswith("/"):
        return None  # a console "folder": nothing to mirror
    parts = rel.split("/")
    if ".." in parts:
        raise TunepodError(
            f"cannot stage {location.uri}: object key {key!r} would be written outside the target "
            "(it contains '..'); fix: rename or delete that object, or stage a prefix below it"
        )
    if "" in parts or "." in parts:
        raise TunepodError(
            f"cannot stage {location.uri}: object key {key!r} has an empty or '.' path segment, so it "
            "has no file path of its own; fix: rename that object"
        )
    if is_reserved(rel):
        logger.warning("staging skips s3://%s/%s: its name is reserved for tunepod", location.bucket, key)
        return None
    return S3Object(key, rel, int(item["Size"]), item["ETag"].strip('"'), _ns(item["LastModified"]))


def _ns(moment: datetime) -> int:
    # Integer arithmetic: a float timestamp in nanoseconds would lose precision.
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


def _no_objects_error(s3: Any, location: S3Location) -> TunepodError:
    """The error for a prefix with no objects, listing what its parent holds to point at a typo."""
    parent = location.prefix.rstrip("/").rpartition("/")[0]
    parent = f"{parent}/" if parent else ""
    page = s3.list_objects_v2(Bucket=location.bucket, Prefix=parent, Delimiter="/", MaxKeys=20)
    nearby = [entry["Prefix"] for entry in page.get("CommonPrefixes", [])]
    hint = f"; s3://{location.bucket}/{parent} holds: {', '.join(nearby)}" if nearby else ""
    return TunepodError(
        f"cannot stage {location.uri}: no objects under that prefix (it is empty or does not exist){hint}; "
        "fix: check the prefix in the stage step's source"
    )


def _is_current(previous: Manifest, target: Path, verify: bool, obj: S3Object) -> bool:
    """Whether the local copy is this very object version, intact: nothing to download. Intact means
    the entry's size and mtime; with ``verify``, its sha256 too (a copy changed in place)."""
    entry = previous.get(obj.rel)
    if entry is None or entry.etag != obj.etag or entry.size != obj.size:
        return False
    info = stat_or_none(target / obj.rel)
    if info is None or not entry.describes(info):
        return False
    return not verify or sha256_of(target / obj.rel) == entry.sha256


def _download(
    s3: Any, location: S3Location, target: Path, on_bytes: Callable[[int], None], obj: S3Object
) -> Synced:
    """Download ``obj`` atomically (runs in a worker thread); its entry records what was fetched."""
    with _explained_aws_errors(location, f"download {obj.key!r} of"):
        # IfMatch: an object overwritten since the listing fails here instead of being recorded with
        # the old ETag. ChecksumMode: botocore verifies a stored SHA256 while streaming.
        response = s3.get_object(
            Bucket=location.bucket, Key=obj.key, IfMatch=f'"{obj.etag}"', ChecksumMode="ENABLED"
        )
        body = _CountingBody(response["Body"], on_bytes)
        times_ns = (obj.last_modified_ns, obj.last_modified_ns)
        sha256 = write_stream_atomic(body, target / obj.rel, mode=_FILE_MODE, times_ns=times_ns)
    entry = ManifestEntry(
        size=obj.size,
        sha256=sha256,
        mtime_ns=obj.last_modified_ns,
        etag=obj.etag,
        etag_kind=obj.etag_kind,
        checksum_sha256=response.get("ChecksumSHA256"),
    )
    return Synced(entry, copied=True)


class _CountingBody:
    """An S3 response body that reports how many bytes each read returned (for the progress bar)."""

    def __init__(self, body: Any, on_bytes: Callable[[int], None]) -> None:
        self._body = body
        self._on_bytes = on_bytes

    def read(self, size: int = -1, /) -> bytes:
        chunk: bytes = self._body.read(size)
        self._on_bytes(len(chunk))
        return chunk


@contextlib.contextmanager
def _progress(location: S3Location, downloads: list[S3Object]) -> Iterator[Callable[[int], None]]:
    """A callback fed bytes downloaded: drives a rich bar on stderr when it is a terminal and the
    transfer is large, and does nothing otherwise (logs, CI, small datasets)."""
    total = sum(obj.size for obj in downloads)
    large = total >= _PROGRESS_MIN_BYTES or len(downloads) >= _PROGRESS_MIN_FILES
    if not (large and sys.stderr.isatty()):
        yield _ignore_bytes
        return
    from rich.console import Console
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    columns = (*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"staging {location.uri}", total=total)
        # Progress.advance takes its own lock: safe from the download threads.
        yield lambda num_bytes: bar.advance(task, num_bytes)


def _ignore_bytes(num_bytes: int) -> None:
    del num_bytes


@contextlib.contextmanager
def _explained_aws_errors(location: S3Location, action: str) -> Iterator[None]:
    """Turn botocore's errors into ``TunepodError``s that say what to fix."""
    from botocore import exceptions  # type: ignore[import-untyped]

    try:
        yield
    except (exceptions.NoCredentialsError, exceptions.PartialCredentialsError) as exc:
        raise TunepodError(
            f"cannot {action} {location.uri}: no usable AWS credentials ({exc}); fix: set AWS_PROFILE "
            "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, run `aws sso login`, or use an instance role"
        ) from exc
    except exceptions.EndpointConnectionError as exc:
        raise TransientError(
            f"cannot {action} {location.uri}: S3 is unreachable ({exc}); fix: check the network and "
            "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL if set"
        ) from exc
    except exceptions.ClientError as exc:
        raise _client_error(exc, location, action) from exc


def _client_error(exc: Any, location: S3Location, action: str) -> TunepodError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", "?"))
    said = f"S3 said {code}: {error.get('Message', exc)}"
    where = f"cannot {action} {location.uri}"
    if code == "NoSuchBucket":
        return TunepodError(
            f"{where}: bucket {location.bucket!r} does not exist ({said}); fix: check the bucket name "
            "in the stage step's source (`aws s3 ls` lists yours)"
        )
    if code in _CREDENTIAL_CODES:
        return TunepodError(
            f"{where}: AWS rejected the credentials ({said}); fix: refresh them (`aws sso login`, "
            "AWS_PROFILE) or check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    if code in _ACCESS_CODES:
        return TunepodError(
            f"{where}: access denied ({said}); fix: grant this identity s3:ListBucket on "
            f"arn:aws:s3:::{location.bucket} and s3:GetObject on "
            f"arn:aws:s3:::{location.bucket}/{location.prefix}*"
        )
    if code in _CHANGED_CODES:
        return TransientError(f"{where}: the object changed during staging ({said}); fix: stage again")
    return TunepodError(f"{where}: {said}")
