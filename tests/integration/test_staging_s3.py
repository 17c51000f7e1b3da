"""Staging from S3 against a real moto server (real HTTP, real botocore): what is downloaded, kept, removed.

Downloads are counted with botocore's own event hooks on the real client. moto accepts any access key,
so the rejected-credentials and access-denied answers come from botocore's ``Stubber`` on a real S3
client, a stand-in for an S3 that checks signatures.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from file_identity import file_identity
from moto_server import REGION, MotoServer, put_objects

from tunepod.errors import TransientError, TunepodError
from tunepod.staging import read_manifest, stage, stage_s3
from tunepod.staging import s3 as s3_staging
from tunepod.staging.folder import MANIFEST_NAME, PARTIAL_SUFFIX
from tunepod.staging.s3 import parse_s3_uri, parse_timestamp

pytest.importorskip("boto3")

BUCKET = "datasets"
URI = f"s3://{BUCKET}/digits/"
OBJECTS = {
    "train.csv": b"x,y\n1,2\n",
    "shards/part-0.bin": bytes(range(256)) * 64,
    "shards/deep/part-1.bin": b"\x00\x01" * 1000,
}


@pytest.fixture
def s3(moto: MotoServer) -> Any:
    """A real S3 client on an empty moto holding the bucket ``datasets`` with ``OBJECTS`` under digits/."""
    moto.reset()
    client = moto.client("s3")
    put_objects(client, BUCKET, "digits/", OBJECTS)
    client.put_object(Bucket=BUCKET, Key="digits/shards/", Body=b"")  # a console "folder" marker
    client.put_object(Bucket=BUCKET, Key="other/readme.txt", Body=b"not staged")
    return client


@pytest.fixture
def downloads(s3: Any) -> list[str]:
    """The keys the client fetches with GetObject, recorded by botocore's own event hook."""
    keys: list[str] = []
    s3.meta.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: keys.append(params["Key"])
    )
    return keys


def tree(root: Path) -> dict[str, bytes]:
    """Every data file under ``root`` (tunepod's bookkeeping files left out) and its bytes."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.name.startswith(".tunepod-manifest")
    }


def test_first_stage_downloads_every_object_and_records_its_etag(s3: Any, tmp_path: Path) -> None:
    target = tmp_path / "target"
    report = stage_s3(URI, target, client=s3)
    assert tree(target) == OBJECTS
    assert (report.num_files, report.copied_files, report.removed_files) == (3, 3, 0)
    assert report.num_bytes == report.copied_bytes == sum(map(len, OBJECTS.values()))
    entry = read_manifest(target)["train.csv"]
    assert entry.etag == hashlib.md5(OBJECTS["train.csv"]).hexdigest()  # a single-part ETag is the MD5
    assert (entry.etag_kind, entry.size) == ("etag", len(OBJECTS["train.csv"]))
    assert entry.sha256 == hashlib.sha256(OBJECTS["train.csv"]).hexdigest()
    assert (target / "train.csv").stat().st_mtime_ns == entry.mtime_ns


def test_a_rerun_downloads_nothing(s3: Any, downloads: list[str], tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    manifest = (target / MANIFEST_NAME).stat()
    downloads.clear()
    report = stage_s3(URI, target, client=s3, workers=2)
    assert downloads == []
    assert (report.copied_files, report.copied_bytes, report.num_files) == (0, 0, 3)
    assert tree(target) == OBJECTS
    # Nothing changed, so the manifest was not rewritten either (same file, same mtime).
    assert file_identity((target / MANIFEST_NAME).stat()) == file_identity(manifest)


def test_verify_downloads_again_a_copy_changed_with_its_size_and_mtime_kept(
    s3: Any, downloads: list[str], tmp_path: Path
) -> None:
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    downloads.clear()
    copy = target / "train.csv"
    kept = copy.stat()
    copy.write_bytes(b"x,y\n9,9\n")  # same length, other bytes, and the old mtime restored
    os.utime(copy, ns=(kept.st_atime_ns, kept.st_mtime_ns))

    assert stage_s3(URI, target, client=s3).copied_files == 0  # size and mtime are trusted by default
    assert copy.read_bytes() == b"x,y\n9,9\n"
    report = stage_s3(URI, target, client=s3, verify=True)
    assert (report.copied_files, downloads) == (1, ["digits/train.csv"])
    assert tree(target) == OBJECTS


def test_a_changed_object_is_the_only_one_downloaded(s3: Any, downloads: list[str], tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    s3.put_object(Bucket=BUCKET, Key="digits/shards/part-0.bin", Body=b"new bytes")
    downloads.clear()
    report = stage_s3(URI, target, client=s3)
    assert downloads == ["digits/shards/part-0.bin"]
    assert report.copied_files == 1
    assert tree(target) == {**OBJECTS, "shards/part-0.bin": b"new bytes"}


def test_a_damaged_local_copy_is_downloaded_again(s3: Any, downloads: list[str], tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    (target / "train.csv").write_bytes(b"edited by hand\n")
    downloads.clear()
    stage_s3(URI, target, client=s3)
    assert downloads == ["digits/train.csv"]
    assert tree(target) == OBJECTS


def test_a_deleted_object_is_removed_and_foreign_files_survive(s3: Any, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    (target / "notes.txt").write_bytes(b"mine")
    s3.delete_object(Bucket=BUCKET, Key="digits/shards/deep/part-1.bin")
    report = stage_s3(URI, target, client=s3)
    assert report.removed_files == 1
    assert not (target / "shards" / "deep").exists()  # emptied folders go too
    expected = {rel: data for rel, data in OBJECTS.items() if rel != "shards/deep/part-1.bin"}
    assert tree(target) == {**expected, "notes.txt": b"mine"}
    assert "shards/deep/part-1.bin" not in read_manifest(target)


def test_a_staged_file_edited_locally_is_kept_when_its_object_is_deleted(s3: Any, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    (target / "train.csv").write_bytes(b"local edits\n")
    s3.delete_object(Bucket=BUCKET, Key="digits/train.csv")
    assert stage_s3(URI, target, client=s3).removed_files == 0
    assert (target / "train.csv").read_bytes() == b"local edits\n"


def test_multipart_etags_and_sha256_checksums_are_recorded(s3: Any, tmp_path: Path) -> None:
    part = b"p" * (5 << 20)  # S3's smallest part but the last
    upload = s3.create_multipart_upload(Bucket=BUCKET, Key="digits/big.bin")
    etags = [
        s3.upload_part(
            Bucket=BUCKET, Key="digits/big.bin", UploadId=upload["UploadId"], PartNumber=number, Body=data
        )["ETag"]
        for number, data in ((1, part), (2, b"tail"))
    ]
    s3.complete_multipart_upload(
        Bucket=BUCKET,
        Key="digits/big.bin",
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": n} for n, etag in enumerate(etags, 1)]},
    )
    s3.put_object(Bucket=BUCKET, Key="digits/summed.txt", Body=b"summed", ChecksumAlgorithm="SHA256")
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    manifest = read_manifest(target)
    assert manifest["big.bin"].etag_kind == "etag-multipart"
    assert manifest["big.bin"].etag.endswith("-2")
    assert (target / "big.bin").read_bytes() == part + b"tail"
    assert (
        manifest["summed.txt"].checksum_sha256
        == base64.b64encode(hashlib.sha256(b"summed").digest()).decode()
    )
    assert manifest["train.csv"].checksum_sha256 is None


def test_manifest_keeps_folder_entries_shape_and_adds_the_s3_identity(s3: Any, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)
    raw = json.loads((target / MANIFEST_NAME).read_text())["files"]["train.csv"]
    assert set(raw) == {"size", "sha256", "mtime_ns", "etag", "etag_kind"}


#: 12 MiB that are not one repeated byte: three ranges of ``small_ranges``' 5 MiB.
LARGE = bytes(range(256)) * (48 << 10)


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranged downloads from 6 MiB on, in parts of 5 MiB, so a test object of 12 MiB takes three."""
    monkeypatch.setattr(s3_staging, "RANGED_MIN_BYTES", 6 << 20)
    monkeypatch.setattr(s3_staging, "PART_BYTES", 5 << 20)


def get_requests(s3: Any) -> list[dict[str, Any]]:
    """The parameters of every GetObject the client sends, recorded by botocore's own event hook."""
    requests: list[dict[str, Any]] = []
    s3.meta.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: requests.append(dict(params))
    )
    return requests


def byte_range(header: str, size: int) -> tuple[int, int]:
    first, _, last = header.removeprefix("bytes=").partition("-")
    return int(first), int(last) if last else size - 1


def test_a_large_object_is_downloaded_in_ranges_each_asking_for_the_listed_etag(
    s3: Any, small_ranges: None, tmp_path: Path
) -> None:
    s3.put_object(Bucket=BUCKET, Key="digits/large.bin", Body=LARGE, ChecksumAlgorithm="SHA256")
    etag = s3.head_object(Bucket=BUCKET, Key="digits/large.bin")["ETag"]
    requests = get_requests(s3)
    target = tmp_path / "target"
    stage_s3(URI, target, client=s3)

    ranged = [request for request in requests if request["Key"] == "digits/large.bin"]
    spans = sorted(byte_range(request["Range"], len(LARGE)) for request in ranged)
    assert len(spans) == 3 and spans[0][0] == 0 and spans[-1][1] == len(LARGE) - 1
    assert all(end + 1 == start for (_, end), (start, _) in itertools.pairwise(spans)), spans
    assert {request["IfMatch"] for request in ranged} == {etag}
    assert all("Range" not in request for request in requests if request["Key"] != "digits/large.bin")
    assert tree(target) == {**OBJECTS, "large.bin": LARGE}
    entry = read_manifest(target)["large.bin"]
    assert entry.sha256 == hashlib.sha256(LARGE).hexdigest()
    # A ranged GET does not return S3's checksum: it was asked for with a HEAD and matched.
    assert entry.checksum_sha256 == base64.b64encode(hashlib.sha256(LARGE).digest()).decode()
    assert list(target.rglob(f"*{PARTIAL_SUFFIX}")) == []


def test_a_large_object_overwritten_during_its_download_is_not_staged(
    moto: MotoServer, s3: Any, small_ranges: None, tmp_path: Path
) -> None:
    s3.put_object(Bucket=BUCKET, Key="digits/large.bin", Body=LARGE)
    writer = moto.client("s3")
    overwritten: list[bool] = []

    def overwrite_once(params: dict[str, Any], **_: Any) -> None:
        if params["Key"] == "digits/large.bin" and not overwritten:
            overwritten.append(True)  # between the listing and the first range
            writer.put_object(Bucket=BUCKET, Key="digits/large.bin", Body=b"v2" * (4 << 20))

    s3.meta.events.register("before-parameter-build.s3.GetObject", overwrite_once)
    target = tmp_path / "target"
    with pytest.raises(TunepodError, match=r"failed on large\.bin: .*the object changed during staging"):
        stage_s3(URI, target, client=s3)
    assert not (target / "large.bin").exists()
    assert list(target.rglob(f"*{PARTIAL_SUFFIX}")) == []
    assert "large.bin" not in read_manifest(target)

    stage_s3(URI, target, client=s3)
    assert (target / "large.bin").read_bytes() == b"v2" * (4 << 20)


class ChecksumLies:
    """The real client, except that HEAD reports a SHA256 that the object's bytes do not have."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def head_object(self, **kwargs: Any) -> Any:
        return {**self._client.head_object(**kwargs), "ChecksumSHA256": base64.b64encode(b"\0" * 32).decode()}


def test_a_large_object_that_does_not_match_its_stored_sha256_is_not_staged(
    s3: Any, small_ranges: None, tmp_path: Path
) -> None:
    s3.put_object(Bucket=BUCKET, Key="digits/large.bin", Body=LARGE, ChecksumAlgorithm="SHA256")
    target = tmp_path / "target"
    with pytest.raises(TunepodError, match=r"failed on large\.bin: .*do not match the SHA256 S3 stores"):
        stage_s3(URI, target, client=ChecksumLies(s3))
    assert not (target / "large.bin").exists()
    assert list(target.rglob(f"*{PARTIAL_SUFFIX}")) == []


class BodyBreaksOff:
    """The real client, except that downloading ``key`` breaks off after 100 bytes (a dropped link)."""

    def __init__(self, client: Any, key: str) -> None:
        self._client = client
        self._key = key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        response = self._client.get_object(**kwargs)
        if kwargs["Key"] == self._key:
            response["Body"] = _Truncated(response["Body"])
        return response


class _Truncated:
    def __init__(self, body: Any) -> None:
        self._body = body
        self._read = False

    def read(self, size: int = -1) -> bytes:
        if self._read:
            raise ConnectionResetError("connection reset by peer (simulated)")
        self._read = True
        return bytes(self._body.read(100))


def test_an_interrupted_download_leaves_no_partial_file_and_the_next_run_completes(
    s3: Any, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    with pytest.raises(TunepodError, match=r"failed on shards/part-0\.bin: .*connection reset"):
        stage_s3(URI, target, client=BodyBreaksOff(s3, "digits/shards/part-0.bin"), workers=1)
    assert not (target / "shards" / "part-0.bin").exists()
    assert list(target.rglob(f"*{PARTIAL_SUFFIX}")) == []
    recorded = read_manifest(target)
    assert all((target / rel).read_bytes() == OBJECTS[rel] for rel in recorded)  # the record is true
    report = stage_s3(URI, target, client=s3)
    assert report.copied_files == len(OBJECTS) - len(recorded)
    assert tree(target) == OBJECTS


def test_stage_routes_s3_sources_to_the_s3_stager(
    moto: MotoServer, s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolated_aws_env(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.endpoint_url)  # boto3 reads it: no client passed
    report = stage(URI, tmp_path / "target", tmp_path / "cache")
    assert report.copied_files == 3
    assert tree(tmp_path / "target") == OBJECTS


def isolated_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials from anywhere: no variables, no files, no instance metadata."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


def test_missing_credentials_are_explained(
    moto: MotoServer, s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolated_aws_env(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.endpoint_url)
    with pytest.raises(TunepodError, match=r"no usable AWS credentials.*fix: set AWS_PROFILE"):
        stage_s3(URI, tmp_path / "target")
    assert not (tmp_path / "target").exists()


@pytest.mark.parametrize(
    ("code", "explained"),
    [
        ("InvalidAccessKeyId", r"AWS rejected the credentials \(S3 said InvalidAccessKeyId"),
        ("AccessDenied", r"access denied .*s3:ListBucket on arn:aws:s3:::datasets"),
    ],
)
def test_rejected_credentials_and_denied_access_are_explained(
    moto: MotoServer, tmp_path: Path, code: str, explained: str
) -> None:
    from botocore.stub import Stubber

    client = moto.client("s3")
    with Stubber(client) as stubber:
        stubber.add_client_error("list_objects_v2", service_error_code=code, http_status_code=403)
        with pytest.raises(TunepodError, match=explained):
            stage_s3(URI, tmp_path / "target", client=client)


def test_an_unreachable_endpoint_is_a_transient_error(s3: Any, tmp_path: Path) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:9",  # discard port: nothing listens there
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"max_attempts": 1}),
    )
    with pytest.raises(TransientError, match="S3 is unreachable"):
        stage_s3(URI, tmp_path / "target", client=client)


def test_a_missing_bucket_is_explained(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(TunepodError, match=r"bucket 'nope' does not exist \(S3 said NoSuchBucket"):
        stage_s3("s3://nope/digits/", tmp_path / "target", client=s3)


def test_an_empty_prefix_is_explained_with_what_the_parent_holds(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(TunepodError, match=r"no objects under that prefix.*holds: digits/, other/"):
        stage_s3(f"s3://{BUCKET}/digts/", tmp_path / "target", client=s3)


def test_a_key_escaping_the_target_stops_the_run_before_any_download(
    s3: Any, downloads: list[str], tmp_path: Path
) -> None:
    s3.put_object(Bucket=BUCKET, Key="digits/../../etc/evil", Body=b"x")
    with pytest.raises(
        TunepodError, match=r"'digits/\.\./\.\./etc/evil' would be written outside the target"
    ):
        stage_s3(URI, tmp_path / "target", client=s3)
    assert downloads == []
    assert not (tmp_path / "etc").exists()


@pytest.mark.parametrize(
    "uri",
    ["s3:/datasets/digits", "gs://datasets/digits/", "s3://", "s3://a/x", "s3://bad bucket/x", "s3://b-1//x"],
)
def test_a_malformed_uri_is_explained(uri: str, tmp_path: Path) -> None:
    with pytest.raises(TunepodError, match=r"not an S3 folder URI; fix: write it as s3://BUCKET/PREFIX/"):
        stage_s3(uri, tmp_path / "target", client=object())


@pytest.mark.parametrize(
    ("uri", "bucket", "prefix"),
    [("s3://b-1/data", "b-1", "data/"), ("s3://b-1/data/x/", "b-1", "data/x/"), ("s3://b-1", "b-1", "")],
)
def test_a_uri_names_a_bucket_and_a_folder_prefix(uri: str, bucket: str, prefix: str) -> None:
    location = parse_s3_uri(uri)
    assert (location.bucket, location.prefix) == (bucket, prefix)


@pytest.mark.parametrize(
    "text",
    ["2026-12-01T22:05:10.000Z", "2026-12-01T22:05:10.123456+02:00", "Tue, 01 Dec 2026 22:05:10 GMT",
     "2026-12-01T22:05:10", "1764627910"],
)  # fmt: skip
def test_timestamps_parse_to_the_same_moment_as_botocores_parser(text: str) -> None:
    from botocore.utils import parse_timestamp as botocore_parse_timestamp

    assert parse_timestamp(text) == botocore_parse_timestamp(text)
