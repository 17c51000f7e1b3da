"""FSx for Lustre data repositories: link a file-system folder to an S3 prefix, and move data across.

A data repository association (DRA) makes ``s3://bucket/prefix/`` appear under a folder of the file
system; data repository tasks then import metadata from S3, export files to it, or release file
contents from the file system (the metadata stays, S3 keeps the bytes). Every function takes a boto3
``fsx`` client (``boto3.client("fsx")``), blocks until AWS reports a terminal state, polling every
``poll_s`` seconds for at most ``timeout_s``, and raises ``TunepodError`` with AWS's failure details.
Functions share no state: call them from any thread, each with its client or one shared client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tunepod.errors import TransientError, TunepodError

AUTO_EVENTS = ("NEW", "CHANGED", "DELETED")
_REPORT_FORMAT = "REPORT_CSV_20191124"
_ASSOCIATION_FAILED = frozenset({"FAILED", "MISCONFIGURED"})
_TASK_FAILED = frozenset({"FAILED", "CANCELED"})


@dataclass(frozen=True)
class Association:
    """An AVAILABLE data repository association."""

    association_id: str
    file_system_id: str
    file_system_path: str
    data_repository_path: str
    lifecycle: str

    @classmethod
    def from_aws(cls, raw: dict[str, Any]) -> Association:
        return cls(
            association_id=raw["AssociationId"],
            file_system_id=raw["FileSystemId"],
            file_system_path=raw["FileSystemPath"],
            data_repository_path=raw["DataRepositoryPath"],
            lifecycle=raw["Lifecycle"],
        )


@dataclass(frozen=True)
class TaskReport:
    """A data repository task that SUCCEEDED, with the counts AWS reported."""

    task_id: str
    task_type: str
    lifecycle: str
    num_total: int
    num_succeeded: int
    num_failed: int
    released_bytes: int | None
    report_path: str | None

    @classmethod
    def from_aws(cls, raw: dict[str, Any]) -> TaskReport:
        status = raw.get("Status", {})
        report = raw.get("Report", {})
        return cls(
            task_id=raw["TaskId"],
            task_type=raw["Type"],
            lifecycle=raw["Lifecycle"],
            num_total=int(status.get("TotalCount", 0)),
            num_succeeded=int(status.get("SucceededCount", 0)),
            num_failed=int(status.get("FailedCount", 0)),
            released_bytes=status.get("ReleasedCapacity"),
            report_path=report.get("Path") if report.get("Enabled") else None,
        )


def ensure_association(
    client: Any,
    file_system_id: str,
    file_system_path: str,
    s3_prefix: str,
    *,
    auto_import_events: Sequence[str] = AUTO_EVENTS,
    auto_export_events: Sequence[str] = (),
    batch_import_metadata: bool = True,
    poll_s: float = 10.0,
    timeout_s: float = 1800.0,
) -> Association:
    """The association of ``file_system_path`` with ``s3_prefix``: the existing one (waited for while
    it is being created or updated), or a new one. ``auto_import_events`` / ``auto_export_events``
    (subsets of ``AUTO_EVENTS``; empty turns the policy off) apply only to a new association.

    Raises ``TunepodError`` when the path is already linked to another prefix (naming both), or the
    association ends FAILED or MISCONFIGURED; ``TransientError`` when it is being deleted.
    """
    existing = _association_at(client, file_system_id, file_system_path)
    if existing is None:
        request = _association_request(
            file_system_id, file_system_path, s3_prefix, auto_import_events, auto_export_events
        )
        created = client.create_data_repository_association(
            **request, BatchImportMetaDataOnCreate=batch_import_metadata
        )
        existing = created["Association"]
    elif not _same_folder(existing["DataRepositoryPath"], s3_prefix):
        raise TunepodError(
            f"FSx {file_system_id} path {file_system_path} is already linked to "
            f"{existing['DataRepositoryPath']} (association {existing['AssociationId']}), "
            f"not to {s3_prefix}; "
            "fix: use another file system path for this prefix, or delete that association first"
        )
    elif existing["Lifecycle"] == "DELETING":
        raise TransientError(
            f"FSx association {existing['AssociationId']} ({file_system_path} -> {s3_prefix}) is being "
            "deleted; fix: retry once it is gone"
        )
    return Association.from_aws(_wait_for_association(client, existing, poll_s, timeout_s))


def import_metadata(
    client: Any,
    file_system_id: str,
    paths: Sequence[str],
    *,
    report_path: str | None = None,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
) -> TaskReport:
    """Import the S3 metadata of ``paths`` (file-system paths under associations; empty: all) so new
    and changed objects appear as files. ``report_path`` (``s3://...``) asks for a CSV of failed files."""
    task = _start_task(client, file_system_id, "IMPORT_METADATA_FROM_REPOSITORY", paths, report_path)
    return _finished_task(client, task, poll_s, timeout_s)


def export_to_repository(
    client: Any,
    file_system_id: str,
    paths: Sequence[str],
    *,
    report_path: str | None = None,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
) -> TaskReport:
    """Export the new and changed files under ``paths`` (empty: all) to their associated S3 prefixes."""
    task = _start_task(client, file_system_id, "EXPORT_TO_REPOSITORY", paths, report_path)
    return _finished_task(client, task, poll_s, timeout_s)


def release_from_file_system(
    client: Any,
    file_system_id: str,
    paths: Sequence[str],
    *,
    min_days_since_last_access: int | None = None,
    report_path: str | None = None,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
) -> TaskReport:
    """Free the file-system space of exported files under ``paths`` (the files stay listed and are
    read back from S3 on access); only files not accessed for ``min_days_since_last_access`` days
    when given. FSx releases only files already exported, so export first."""
    extra: dict[str, Any] = {}
    if min_days_since_last_access is not None:
        extra["ReleaseConfiguration"] = {
            "DurationSinceLastAccess": {"Unit": "DAYS", "Value": min_days_since_last_access}
        }
    task = _start_task(client, file_system_id, "RELEASE_DATA_FROM_FILESYSTEM", paths, report_path, extra)
    return _finished_task(client, task, poll_s, timeout_s)


def _association_at(client: Any, file_system_id: str, file_system_path: str) -> dict[str, Any] | None:
    """The association of ``file_system_path`` on the file system, if any (all pages searched)."""
    request: dict[str, Any] = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}]}
    while True:
        page = client.describe_data_repository_associations(**request)
        for association in page.get("Associations", []):
            if _same_folder(association.get("FileSystemPath", ""), file_system_path):
                return dict(association)
        if not page.get("NextToken"):
            return None
        request["NextToken"] = page["NextToken"]


def _same_folder(left: str, right: str) -> bool:
    # AWS echoes paths as given: "/data" and "/data/" (or "s3://b/p" and "s3://b/p/") are one folder.
    return left.rstrip("/") == right.rstrip("/")


def _association_request(
    file_system_id: str,
    file_system_path: str,
    s3_prefix: str,
    auto_import_events: Sequence[str],
    auto_export_events: Sequence[str],
) -> dict[str, Any]:
    unknown = sorted((set(auto_import_events) | set(auto_export_events)) - set(AUTO_EVENTS))
    if unknown:
        raise TunepodError(f"unknown FSx auto import/export events {unknown}; fix: use some of {AUTO_EVENTS}")
    policies: dict[str, Any] = {}
    if auto_import_events:
        policies["AutoImportPolicy"] = {"Events": list(auto_import_events)}
    if auto_export_events:
        policies["AutoExportPolicy"] = {"Events": list(auto_export_events)}
    request: dict[str, Any] = {
        "FileSystemId": file_system_id,
        "FileSystemPath": file_system_path,
        "DataRepositoryPath": s3_prefix,
    }
    if policies:
        request["S3"] = policies
    return request


def _wait_for_association(
    client: Any, association: dict[str, Any], poll_s: float, timeout_s: float
) -> dict[str, Any]:
    association_id = association["AssociationId"]

    def describe() -> dict[str, Any]:
        page = client.describe_data_repository_associations(AssociationIds=[association_id])
        return dict(page["Associations"][0])

    final = _poll(association, describe, {"AVAILABLE"} | _ASSOCIATION_FAILED, poll_s, timeout_s)
    if final["Lifecycle"] == "AVAILABLE":
        return final
    if final["Lifecycle"] in _ASSOCIATION_FAILED:
        details = final.get("FailureDetails", {}).get("Message", "no details given")
        raise TunepodError(
            f"FSx association {association_id} ({final['FileSystemPath']} -> {final['DataRepositoryPath']}) "
            f"is {final['Lifecycle']}: {details}; fix: correct the bucket policy, prefix or file system path "
            "it names, delete the association and stage again"
        )
    raise TransientError(
        f"FSx association {association_id} is still {final['Lifecycle']} after {timeout_s:.0f} s; "
        f"fix: check `aws fsx describe-data-repository-associations --association-ids {association_id}` "
        "and stage again (the association is reused)"
    )


def _start_task(
    client: Any,
    file_system_id: str,
    task_type: str,
    paths: Sequence[str],
    report_path: str | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {"Enabled": False}
    if report_path is not None:
        report = {
            "Enabled": True,
            "Path": report_path,
            "Format": _REPORT_FORMAT,
            "Scope": "FAILED_FILES_ONLY",
        }
    response = client.create_data_repository_task(
        Type=task_type, FileSystemId=file_system_id, Paths=list(paths), Report=report, **(extra or {})
    )
    return dict(response["DataRepositoryTask"])


def _finished_task(client: Any, task: dict[str, Any], poll_s: float, timeout_s: float) -> TaskReport:
    task_id = task["TaskId"]

    def describe() -> dict[str, Any]:
        return dict(client.describe_data_repository_tasks(TaskIds=[task_id])["DataRepositoryTasks"][0])

    final = _poll(task, describe, {"SUCCEEDED"} | _TASK_FAILED, poll_s, timeout_s)
    report = TaskReport.from_aws(final)
    if report.lifecycle == "SUCCEEDED":
        return report
    where = f"FSx {report.task_type} task {task_id} on {final.get('FileSystemId', '?')}"
    counts = f"{report.num_failed} of {report.num_total} files failed, {report.num_succeeded} succeeded"
    if report.lifecycle in _TASK_FAILED:
        details = final.get("FailureDetails", {}).get("Message", "no details given")
        see = f"; the failed files are listed under {report.report_path}" if report.report_path else ""
        raise TunepodError(
            f"{where} {report.lifecycle}: {details} ({counts}){see}; fix: correct what the details name "
            "(permissions, paths, an association) and run the step again"
        )
    raise TransientError(
        f"{where} is still {report.lifecycle} after {timeout_s:.0f} s ({counts} so far); fix: check "
        f"`aws fsx describe-data-repository-tasks --task-ids {task_id}`, or raise timeout_s"
    )


def _poll(
    first: dict[str, Any],
    describe: Callable[[], dict[str, Any]],
    terminal: set[str] | frozenset[str],
    poll_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """``first``, or what ``describe`` returns, once its Lifecycle is ``terminal`` or ``timeout_s``
    has passed (the caller tells the two apart by the Lifecycle)."""
    deadline = time.monotonic() + timeout_s
    current = first
    while current["Lifecycle"] not in terminal and time.monotonic() < deadline:
        time.sleep(poll_s)
        current = describe()
    return current
