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
  the listed ETag (``IfMatch``), so a file is never half written nor a mix of two object versions;
- an object of ``RANGED_MIN_BYTES`` or more is downloaded in ranges of ``PART_BYTES``, several at a
  time (boto3's own s3transfer, each range with that ``IfMatch``): one HTTP stream to S3 carries far
  less than the link, many in parallel fill it. Its sha256 is then read back from the local copy, and
  S3's ``ChecksumSHA256``, which a ranged GET does not return, is asked for with a HEAD when the
  listing says the object has one, and compared when it covers the whole object.

Every key is checked before anything is downloaded: one that would land outside the target (``..``)
stops the run. boto3 is imported only when no client is given; it honours ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` and the rest of the standard AWS configuration.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from tunepod import watch
from tunepod.errors import TransientError, TunepodError
from tunepod.runtime.files import disk_full_explained, sha256_of
from tunepod.staging.folder import (
    DISK_FULL_FIX,
    LOCK_NAME,
    Manifest,
    ManifestEntry,
    StageReport,
    Synced,
    atomic_partial,
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
#: Objects this large are downloaded in ranges of PART_BYTES, several at once. Below it one stream is
#: enough: it carries such an object in a few seconds while the other workers carry other objects,
#: and each range is one more request (which S3 servers that slice the whole object, as moto does, pay
#: for in full).
RANGED_MIN_BYTES = 256 << 20
PART_BYTES = 64 << 20
#: Ranges of one object in flight at once (a few large objects share them).
PART_WORKERS = 8
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
    #: The listing's ChecksumAlgorithm: which checksums S3 keeps for the object.
    checksums: tuple[str, ...] = ()

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
        import botocore.session  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TunepodError(f"staging from s3:// needs boto3; fix: {INSTALL_HINT}") from exc
    session = botocore.session.get_session()
    # botocore parses each timestamp with dateutil, about a millisecond apiece: a listing's and every
    # download's LastModified then cost more CPU than small objects' bytes. The AWS CLI swaps the
    # parser the same way.
    parsers = session.get_component("response_parser_factory")
    parsers.set_parser_defaults(timestamp_parser=parse_timestamp)
    config = Config(max_pool_connections=max_connections)
    return boto3.session.Session(botocore_session=session).client("s3", config=config)


def parse_timestamp(value: object) -> datetime:
    """A timestamp of an S3 response: ISO 8601 in listings, RFC 1123 in headers, by the standard library's
    fast parsers; anything else (or without a time zone) by botocore's own."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError, TypeError):
            moment = datetime.fromisoformat(value) if value[:1].isdigit() else parsedate_to_datetime(value)
            if moment.tzinfo is not None:
                return moment
    from botocore.utils import parse_timestamp as botocore_parse_timestamp  # type: ignore[import-untyped]

    parsed: datetime = botocore_parse_timestamp(value)
    return parsed


def stage_s3(
    uri: str, target: Path, *, client: Any = None, workers: int = 16, verify: bool = False
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
    s3 = client if client is not None else s3_client(max_connections=workers + PART_WORKERS)
    objects = _listed_objects(s3, location)
    with disk_full_explained(target, DISK_FULL_FIX):
        target.mkdir(parents=True, exist_ok=True)
        with exclusive(target / LOCK_NAME):
            previous = read_manifest(target)
            is_current = functools.partial(_is_current, previous, target, verify)
            current = {obj.rel: previous[obj.rel] for obj in objects if is_current(obj)}
            downloads = [obj for obj in objects if obj.rel not in current]
            # The bytes downloaded, for whoever watches the run (tunepod run's view: tunepod.watch).
            on_bytes = watch.progress(sum(obj.size for obj in downloads), "bytes")
            with _ranged_downloader(s3, downloads) as ranged:
                download = functools.partial(_download, s3, ranged, location, target, on_bytes)
                synced = sync_all(downloads, previous, target, workers, download)
            removed = remove_deleted(target, previous, {obj.rel for obj in objects})
            manifest = {**current, **{rel: result.entry for rel, result in synced.items()}}
            write_manifest(target, manifest, previous)
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
    checksums = tuple(item.get("ChecksumAlgorithm", ()))
    return S3Object(
        key, rel, int(item["Size"]), item["ETag"].strip('"'), _ns(item["LastModified"]), checksums
    )


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
    s3: Any,
    ranged: Any,
    location: S3Location,
    target: Path,
    on_bytes: Callable[[int], None],
    obj: S3Object,
) -> Synced:
    """Download ``obj`` atomically (runs in a worker thread); its entry records what was fetched.
    ``ranged`` is the s3transfer manager for large objects, ``None`` when there are none."""
    times_ns = (obj.last_modified_ns, obj.last_modified_ns)
    with _explained_aws_errors(location, f"download {obj.key!r} of"):
        if ranged is not None and obj.size >= RANGED_MIN_BYTES:
            sha256, checksum = _download_ranged(s3, ranged, location, target, on_bytes, obj)
        else:
            # IfMatch: an object overwritten since the listing fails here instead of being recorded
            # with the old ETag. ChecksumMode: botocore verifies a stored SHA256 while streaming.
            response = s3.get_object(
                Bucket=location.bucket, Key=obj.key, IfMatch=f'"{obj.etag}"', ChecksumMode="ENABLED"
            )
            body = _CountingBody(response["Body"], on_bytes)
            sha256 = write_stream_atomic(body, target / obj.rel, mode=_FILE_MODE, times_ns=times_ns)
            checksum = response.get("ChecksumSHA256")
    entry = ManifestEntry(
        size=obj.size,
        sha256=sha256,
        mtime_ns=obj.last_modified_ns,
        etag=obj.etag,
        etag_kind=obj.etag_kind,
        checksum_sha256=checksum,
    )
    return Synced(entry, copied=True)


def _download_ranged(
    s3: Any,
    ranged: Any,
    location: S3Location,
    target: Path,
    on_bytes: Callable[[int], None],
    obj: S3Object,
) -> tuple[str, str | None]:
    """Download a large ``obj`` in parallel ranges into its partial file; its sha256 and S3's checksum."""
    from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError  # type: ignore[import-untyped]

    times_ns = (obj.last_modified_ns, obj.last_modified_ns)
    where = f"cannot download {obj.key!r} of {location.uri}"
    with atomic_partial(target / obj.rel, mode=_FILE_MODE, times_ns=times_ns) as dst:
        transfer = ranged.download(location.bucket, obj.key, dst, subscribers=[_ListedObject(obj, on_bytes)])
        try:
            transfer.result()
        except S3DownloadFailedError as exc:  # what s3transfer makes of a range's 412 PreconditionFailed
            raise TransientError(
                f"{where}: the object changed during staging ({exc}); fix: stage again"
            ) from exc
        except RetriesExceededError as exc:
            raise TransientError(
                f"{where}: every try broke off ({exc.last_exception}); fix: check the network, stage again"
            ) from exc
        dst.seek(0)
        digest = hashlib.file_digest(dst, "sha256")
        checksum = _checked_sha256(s3, location, obj, digest.digest()) if "SHA256" in obj.checksums else None
    return digest.hexdigest(), checksum


def _checked_sha256(s3: Any, location: S3Location, obj: S3Object, sha256: bytes) -> str | None:
    """S3's ``ChecksumSHA256`` of ``obj`` (a HEAD of the listed version), compared with the bytes
    downloaded when it is the whole object's (not a multipart upload's checksum of part checksums)."""
    head = s3.head_object(
        Bucket=location.bucket, Key=obj.key, IfMatch=f'"{obj.etag}"', ChecksumMode="ENABLED"
    )
    stored: str | None = head.get("ChecksumSHA256")
    whole_object = (
        stored is not None and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT" and "-" not in stored
    )
    if whole_object and stored != base64.b64encode(sha256).decode():
        raise TransientError(
            f"cannot download {obj.key!r} of {location.uri}: its bytes do not match the SHA256 S3 stores "
            f"for it ({stored}); fix: stage again"
        )
    return stored


class _ListedObject:
    """An s3transfer subscriber: tells the transfer the listed size (no HEAD needed) and ETag (sent as
    ``IfMatch`` with every range), and feeds the progress bar."""

    def __init__(self, obj: S3Object, on_bytes: Callable[[int], None]) -> None:
        self._obj = obj
        self._on_bytes = on_bytes

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._obj.size)
        future.meta.provide_object_etag(f'"{self._obj.etag}"')

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._on_bytes(bytes_transferred)


@contextlib.contextmanager
def _ranged_downloader(s3: Any, downloads: list[S3Object]) -> Iterator[Any]:
    """An s3transfer ``TransferManager`` for the large objects among ``downloads``; ``None`` when there
    are none, or when this s3transfer is too old to send the listed ETag with each range."""
    from s3transfer.futures import TransferMeta  # type: ignore[import-untyped]
    from s3transfer.manager import TransferConfig, TransferManager  # type: ignore[import-untyped]

    if not hasattr(TransferMeta, "provide_object_etag") or all(
        obj.size < RANGED_MIN_BYTES for obj in downloads
    ):
        yield None
        return
    config = TransferConfig(
        multipart_threshold=RANGED_MIN_BYTES,
        multipart_chunksize=PART_BYTES,
        max_request_concurrency=PART_WORKERS,
    )
    with TransferManager(s3, config) as manager:
        yield manager


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
def _explained_aws_errors(location: S3Location, action: str) -> Iterator[None]:
    """Turn botocore's errors into ``TunepodError``s that say what to fix."""
    from botocore import exceptions

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
