"""A stand-in for the FSx for Lustre data repository API: no FSx can run here (and moto has none of
these calls), so this serves them on 127.0.0.1 over the real AWS JSON 1.1 protocol
(``X-Amz-Target: AWSSimbaAPIService_v20180301.<Operation>``), for a real ``boto3.client("fsx")``
pointed at it with ``AWS_ENDPOINT_URL_FSX``. Every answer is checked against botocore's FSx output
model before it is sent; one that does not fit is answered with HTTP 500 and kept in ``problems``.

Emulated:
- CreateDataRepositoryAssociation, DescribeDataRepositoryAssociations (AssociationIds, the
  ``file-system-id`` filter, MaxResults/NextToken paging with ``page_size`` per page by default),
  CreateDataRepositoryTask, DescribeDataRepositoryTasks (TaskIds, ``file-system-id`` and
  ``task-lifecycle`` filters), with AWS-shaped errors (``__type``: BadRequest, FileSystemNotFound,
  DataRepositoryAssociationNotFound, DataRepositoryTaskNotFound, UnsupportedOperation).
- Each file system id is a local folder (its "mount"); FSx path ``/a/b`` is ``<folder>/a/b``.
- Lifecycles move one state per describe call that returns the object: an association goes
  CREATING -> AVAILABLE, or MISCONFIGURED (with FailureDetails) when its bucket does not exist; a
  task goes PENDING -> EXECUTING -> SUCCEEDED or FAILED (FailureDetails, Status counts).
- IMPORT_METADATA_FROM_REPOSITORY copies every object of the associated prefix from S3 (real S3
  API calls, to moto) into the folder. Real FSx imports only metadata and loads contents lazily.
- EXPORT_TO_REPOSITORY uploads the new and changed files (MD5 against the ETag) under the task's
  paths to the associated prefix; Status counts the files it uploaded.
- RELEASE_DATA_FROM_FILESYSTEM only counts the exported files and their bytes: contents stay here,
  where real FSx would free them (reads would then load them back from S3).

Not emulated: auto import/export (the policies are stored, never acted on), BatchImportMetaDataOnCreate,
one task at a time per file system, deletion of files whose objects were deleted, failure reports
written to S3, association updates and deletion, tags, file caches, NFS repositories, signatures.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import botocore.session
from botocore.exceptions import ClientError
from botocore.validate import ParamValidator

TARGET_PREFIX = "AWSSimbaAPIService_v20180301."
TASK_TYPES = ("IMPORT_METADATA_FROM_REPOSITORY", "EXPORT_TO_REPOSITORY", "RELEASE_DATA_FROM_FILESYSTEM")
_MODEL = botocore.session.get_session().get_service_model("fsx")


class ApiError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class FsxStandIn:
    """The emulated service: state behind one lock, so the threaded HTTP server may call it at once."""

    def __init__(self, s3: Any, file_systems: Mapping[str, Path], page_size: int = 2) -> None:
        self.s3, self.file_systems, self.page_size = s3, dict(file_systems), page_size
        self.associations: dict[str, dict[str, Any]] = {}
        self.tasks: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.problems: list[str] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def handle(self, operation: str, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.calls.append(operation)
            handler = getattr(self, f"_{operation}", None)
            if handler is None:
                raise ApiError("UnsupportedOperation", f"the FSx stand-in does not emulate {operation}")
            response: dict[str, Any] = handler(request)
        report = ParamValidator().validate(response, _MODEL.operation_model(operation).output_shape)
        if report.has_errors():
            self.problems.append(f"{operation}: {report.generate_report()}")
            raise RuntimeError(self.problems[-1])
        return response

    # ------------------------------------------------------------------------------ associations

    def _CreateDataRepositoryAssociation(self, request: dict[str, Any]) -> dict[str, Any]:
        fs_id, path = request["FileSystemId"], request["FileSystemPath"]
        self._mount(fs_id)
        for other in self.associations.values():
            if other["FileSystemId"] == fs_id and _overlaps(other["FileSystemPath"], path):
                raise ApiError(
                    "BadRequest", f"FileSystemPath {path} overlaps association {other['AssociationId']}"
                )
        association = {
            "AssociationId": f"dra-{next(self._ids):017x}",
            "FileSystemId": fs_id,
            "FileSystemPath": path,
            "DataRepositoryPath": request["DataRepositoryPath"],
            "BatchImportMetaDataOnCreate": request.get("BatchImportMetaDataOnCreate", False),
            "Lifecycle": "CREATING",
            "CreationTime": time.time(),
        }
        if "S3" in request:
            association["S3"] = request["S3"]
        self.associations[association["AssociationId"]] = association
        return {"Association": dict(association)}

    def _DescribeDataRepositoryAssociations(self, request: dict[str, Any]) -> dict[str, Any]:
        if "AssociationIds" in request:
            missing = [i for i in request["AssociationIds"] if i not in self.associations]
            if missing:
                raise ApiError("DataRepositoryAssociationNotFound", f"no association {missing[0]}")
            found = [self.associations[i] for i in request["AssociationIds"]]
        else:
            found = [a for a in self.associations.values() if _matches(a, request.get("Filters", []))]
        page, token = self._page(found, request)
        for association in page:
            self._advance_association(association)
        return {"Associations": [dict(a) for a in page], **token}

    def _advance_association(self, association: dict[str, Any]) -> None:
        if association["Lifecycle"] != "CREATING":
            return
        bucket = _split(association["DataRepositoryPath"])[0]
        try:
            self.s3.head_bucket(Bucket=bucket)
            association["Lifecycle"] = "AVAILABLE"
        except ClientError as exc:
            association["Lifecycle"] = "MISCONFIGURED"
            association["FailureDetails"] = {
                "Message": f"cannot reach bucket {bucket}: {exc.response['Error'].get('Code')}"
            }

    # ------------------------------------------------------------------------------ tasks

    def _CreateDataRepositoryTask(self, request: dict[str, Any]) -> dict[str, Any]:
        if request["Type"] not in TASK_TYPES:
            raise ApiError("UnsupportedOperation", f"the FSx stand-in does not run {request['Type']} tasks")
        self._mount(request["FileSystemId"])
        task = {
            "TaskId": f"task-{next(self._ids):017x}",
            "Type": request["Type"],
            "Lifecycle": "PENDING",
            "CreationTime": time.time(),
            "FileSystemId": request["FileSystemId"],
            "Paths": request.get("Paths", []),
            "Report": request["Report"],
        }
        self.tasks[task["TaskId"]] = task
        return {"DataRepositoryTask": dict(task)}

    def _DescribeDataRepositoryTasks(self, request: dict[str, Any]) -> dict[str, Any]:
        if "TaskIds" in request:
            missing = [i for i in request["TaskIds"] if i not in self.tasks]
            if missing:
                raise ApiError("DataRepositoryTaskNotFound", f"no task {missing[0]}")
            found = [self.tasks[i] for i in request["TaskIds"]]
        else:
            found = [t for t in self.tasks.values() if _matches(t, request.get("Filters", []))]
        page, token = self._page(found, request)
        for task in page:
            self._advance_task(task)
        return {"DataRepositoryTasks": [dict(t) for t in page], **token}

    def _advance_task(self, task: dict[str, Any]) -> None:
        if task["Lifecycle"] == "PENDING":
            task.update(Lifecycle="EXECUTING", StartTime=time.time())
        elif task["Lifecycle"] == "EXECUTING":
            try:
                done, num_bytes = self._run(task)
                task.update(Lifecycle="SUCCEEDED")
                task["Status"] = {"TotalCount": done, "SucceededCount": done, "FailedCount": 0}
                if task["Type"] == "RELEASE_DATA_FROM_FILESYSTEM":
                    task["Status"]["ReleasedCapacity"] = num_bytes
            except (ApiError, ClientError) as exc:
                message = exc.message if isinstance(exc, ApiError) else str(exc)
                task.update(Lifecycle="FAILED", FailureDetails={"Message": message})
                task["Status"] = {"TotalCount": 0, "SucceededCount": 0, "FailedCount": 0}
            task["EndTime"] = time.time()

    def _run(self, task: dict[str, Any]) -> tuple[int, int]:
        """(files done, bytes) of the task's work, done now; raises what makes it FAILED."""
        mount = self._mount(task["FileSystemId"])
        done = num_bytes = 0
        for association, path in self._linked(task):
            bucket, key_prefix = _split(association["DataRepositoryPath"])
            below = path[len(association["FileSystemPath"].rstrip("/")) :].strip("/")
            key_prefix += f"{below}/" if below else ""
            folder = mount / path.lstrip("/")
            if task["Type"] == "IMPORT_METADATA_FROM_REPOSITORY":
                for key in self._keys(bucket, key_prefix):
                    body = self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
                    (folder / key[len(key_prefix) :]).parent.mkdir(parents=True, exist_ok=True)
                    (folder / key[len(key_prefix) :]).write_bytes(body)
                    done, num_bytes = done + 1, num_bytes + len(body)
                continue
            etags = self._keys(bucket, key_prefix)
            for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                key = key_prefix + file.relative_to(folder).as_posix()
                data = file.read_bytes()
                same = etags.get(key) == hashlib.md5(data).hexdigest()
                if task["Type"] == "EXPORT_TO_REPOSITORY" and not same:
                    self.s3.put_object(Bucket=bucket, Key=key, Body=data)
                elif task["Type"] == "EXPORT_TO_REPOSITORY" or not same:
                    continue  # export: unchanged, nothing to send; release: never exported, kept
                done, num_bytes = done + 1, num_bytes + len(data)
        return done, num_bytes

    def _linked(self, task: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
        """(association, path) for each task path; all associations when the task names none."""
        mine = [
            a
            for a in self.associations.values()
            if a["FileSystemId"] == task["FileSystemId"] and a["Lifecycle"] == "AVAILABLE"
        ]
        if not task["Paths"]:
            return [(a, a["FileSystemPath"]) for a in mine]
        linked = []
        for path in task["Paths"]:
            owner = next((a for a in mine if _inside(path, a["FileSystemPath"])), None)
            if owner is None:
                raise ApiError("BadRequest", f"path {path} is not in any data repository association")
            linked.append((owner, path))
        return linked

    def _keys(self, bucket: str, prefix: str) -> dict[str, str]:
        """Object keys under the prefix and their ETags (real S3 calls; folder markers left out)."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {
            o["Key"]: o["ETag"].strip('"')
            for page in pages
            for o in page.get("Contents", [])
            if not o["Key"].endswith("/")
        }

    # ------------------------------------------------------------------------------ helpers

    def _mount(self, fs_id: str) -> Path:
        if fs_id not in self.file_systems:
            raise ApiError("FileSystemNotFound", f"file system {fs_id} does not exist")
        return self.file_systems[fs_id]

    def _page(self, items: list[dict[str, Any]], request: dict[str, Any]) -> tuple[list[Any], dict[str, str]]:
        start = int(request.get("NextToken", "0"))
        end = start + int(request.get("MaxResults", self.page_size))
        return items[start:end], ({"NextToken": str(end)} if end < len(items) else {})


def _split(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b/``); the prefix of a whole bucket is ``""``."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, (key.strip("/") + "/" if key.strip("/") else "")


def _inside(path: str, folder: str) -> bool:
    path, folder = path.rstrip("/") or "/", folder.rstrip("/") or "/"
    return folder == "/" or path == folder or path.startswith(folder + "/")


def _overlaps(left: str, right: str) -> bool:
    return _inside(left, right) or _inside(right, left)


def _matches(item: dict[str, Any], filters: list[dict[str, Any]]) -> bool:
    fields = {"file-system-id": "FileSystemId", "task-lifecycle": "Lifecycle"}
    return all(item.get(fields.get(f["Name"], f["Name"])) in f["Values"] for f in filters)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        operation = self.headers.get("X-Amz-Target", "").removeprefix(TARGET_PREFIX)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        try:
            status, body = 200, self.server.standin.handle(operation, request)
        except ApiError as exc:
            status, body = 400, {"__type": exc.code, "Message": exc.message}
        except Exception as exc:  # a bug in the stand-in: a 500 the test sees
            status, body = 500, {"__type": "InternalServerError", "Message": str(exc)}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        del format, args  # quiet: pytest shows failures, not every request


class _Server(ThreadingHTTPServer):
    standin: FsxStandIn


@contextmanager
def fsx_standin(
    s3: Any, file_systems: Mapping[str, Path], page_size: int = 2
) -> Iterator[tuple[FsxStandIn, str]]:
    """Serve a new ``FsxStandIn`` on a free loopback port; yields it and its endpoint URL."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.standin = FsxStandIn(s3, file_systems, page_size)
    thread = threading.Thread(target=server.serve_forever, name="fsx-standin", daemon=True)
    thread.start()
    try:
        yield server.standin, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
