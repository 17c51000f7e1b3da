"""FSx for Lustre data repository associations and tasks, through a real botocore ``fsx`` client.

Stand-in: moto has no FSx data repository calls, so AWS's answers come from botocore's ``Stubber``.
It checks every request tunepod sends against the real FSx API model (operation, parameter names,
types, enums, required fields), checks the canned answers against it too, and fails a test when an
expected call is not made, in order, with exactly the parameters listed here.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tunepod.errors import TransientError, TunepodError
from tunepod.staging.fsx import (
    Association,
    TaskReport,
    ensure_association,
    export_to_repository,
    import_metadata,
    release_from_file_system,
)
from tunepod.staging.fsx_stage import export_folders

boto3 = pytest.importorskip("boto3")
from botocore.stub import Stubber  # noqa: E402 (after the skip: botocore comes with boto3)

FS = "fs-0123456789abcdef0"
PREFIX = "s3://datasets/digits/"
BY_FILE_SYSTEM = {"Filters": [{"Name": "file-system-id", "Values": [FS]}]}
NOW = datetime(2025, 1, 1, tzinfo=UTC)
FAST = {"poll_s": 0, "timeout_s": 30}


@pytest.fixture
def fsx() -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()  # every answer listed was asked for


def association(path: str, prefix: str, lifecycle: str, **extra: Any) -> dict[str, Any]:
    return {
        "AssociationId": "dra-0123456789abcdef0",
        "FileSystemId": FS,
        "FileSystemPath": path,
        "DataRepositoryPath": prefix,
        "Lifecycle": lifecycle,
        **extra,
    }


def task(lifecycle: str, task_type: str = "IMPORT_METADATA_FROM_REPOSITORY", **extra: Any) -> dict[str, Any]:
    return {
        "TaskId": "task-0123456789abcdef0",
        "Lifecycle": lifecycle,
        "Type": task_type,
        "CreationTime": NOW,
        "FileSystemId": FS,
        **extra,
    }


def test_an_existing_association_for_the_same_prefix_is_reused(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    other = association("/other", "s3://datasets/other/", "AVAILABLE") | {
        "AssociationId": "dra-0fedcba9876543210"
    }
    stubber.add_response(
        "describe_data_repository_associations", {"Associations": [other], "NextToken": "t"}, BY_FILE_SYSTEM
    )
    stubber.add_response(
        "describe_data_repository_associations",
        {"Associations": [association("/digits/", PREFIX.rstrip("/"), "AVAILABLE")]},
        {**BY_FILE_SYSTEM, "NextToken": "t"},
    )
    found = ensure_association(client, FS, "/digits", PREFIX, **FAST)
    assert found == Association("dra-0123456789abcdef0", FS, "/digits/", "s3://datasets/digits", "AVAILABLE")


def test_a_path_linked_to_another_prefix_is_an_error_naming_both(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response(
        "describe_data_repository_associations",
        {"Associations": [association("/digits", "s3://old-bucket/digits/", "AVAILABLE")]},
        BY_FILE_SYSTEM,
    )
    with pytest.raises(
        TunepodError,
        match=r"/digits is already linked to s3://old-bucket/digits/ .*not to "
        r"s3://datasets/digits/; fix: use another file system path",
    ):
        ensure_association(client, FS, "/digits", PREFIX, **FAST)


def test_a_missing_association_is_created_and_waited_for(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response("describe_data_repository_associations", {"Associations": []}, BY_FILE_SYSTEM)
    stubber.add_response(
        "create_data_repository_association",
        {"Association": association("/digits", PREFIX, "CREATING")},
        {
            "FileSystemId": FS,
            "FileSystemPath": "/digits",
            "DataRepositoryPath": PREFIX,
            "BatchImportMetaDataOnCreate": True,
            "S3": {
                "AutoImportPolicy": {"Events": ["NEW", "CHANGED"]},
                "AutoExportPolicy": {"Events": ["NEW"]},
            },
        },
    )
    by_id = {"AssociationIds": ["dra-0123456789abcdef0"]}
    for lifecycle in ("CREATING", "AVAILABLE"):
        stubber.add_response(
            "describe_data_repository_associations",
            {"Associations": [association("/digits", PREFIX, lifecycle)]},
            by_id,
        )
    created = ensure_association(
        client,
        FS,
        "/digits",
        PREFIX,
        auto_import_events=("NEW", "CHANGED"),
        auto_export_events=("NEW",),
        **FAST,
    )
    assert (created.lifecycle, created.data_repository_path) == ("AVAILABLE", PREFIX)


def test_a_failed_association_is_an_error_with_the_failure_details(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response("describe_data_repository_associations", {"Associations": []}, BY_FILE_SYSTEM)
    stubber.add_response(
        "create_data_repository_association",
        {"Association": association("/digits", PREFIX, "CREATING")},
        {
            "FileSystemId": FS,
            "FileSystemPath": "/digits",
            "DataRepositoryPath": PREFIX,
            "BatchImportMetaDataOnCreate": False,
        },
    )
    failed = association(
        "/digits",
        PREFIX,
        "MISCONFIGURED",
        FailureDetails={"Message": "S3 bucket policy denies fsx.amazonaws.com"},
    )
    stubber.add_response(
        "describe_data_repository_associations",
        {"Associations": [failed]},
        {"AssociationIds": ["dra-0123456789abcdef0"]},
    )
    with pytest.raises(
        TunepodError, match=r"dra-0123456789abcdef0 .* is MISCONFIGURED: S3 bucket policy denies"
    ):
        ensure_association(
            client, FS, "/digits", PREFIX, auto_import_events=(), batch_import_metadata=False, **FAST
        )


def test_an_association_being_deleted_is_a_transient_error(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response(
        "describe_data_repository_associations",
        {"Associations": [association("/digits", PREFIX, "DELETING")]},
        BY_FILE_SYSTEM,
    )
    with pytest.raises(TransientError, match="is being deleted"):
        ensure_association(client, FS, "/digits", PREFIX, **FAST)


def test_unknown_auto_events_are_rejected_before_creating_anything(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response("describe_data_repository_associations", {"Associations": []}, BY_FILE_SYSTEM)
    with pytest.raises(TunepodError, match=r"unknown FSx auto import/export events \['MOVED'\]"):
        ensure_association(client, FS, "/digits", PREFIX, auto_import_events=("NEW", "MOVED"), **FAST)


def test_import_metadata_waits_and_reports_the_counts(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": task("PENDING")},
        {
            "Type": "IMPORT_METADATA_FROM_REPOSITORY",
            "FileSystemId": FS,
            "Paths": ["digits"],
            "Report": {"Enabled": False},
        },
    )
    counts = {"TotalCount": 1797, "SucceededCount": 1797, "FailedCount": 0}
    for lifecycle, status in (
        ("EXECUTING", {"TotalCount": 1797, "SucceededCount": 5}),
        ("SUCCEEDED", counts),
    ):
        stubber.add_response(
            "describe_data_repository_tasks",
            {"DataRepositoryTasks": [task(lifecycle, Status=status)]},
            {"TaskIds": ["task-0123456789abcdef0"]},
        )
    report = import_metadata(client, FS, ["digits"], **FAST)
    assert report == TaskReport(
        task_id="task-0123456789abcdef0",
        task_type="IMPORT_METADATA_FROM_REPOSITORY",
        lifecycle="SUCCEEDED",
        num_total=1797,
        num_succeeded=1797,
        num_failed=0,
        released_bytes=None,
        report_path=None,
    )


def test_a_failed_task_is_an_error_with_details_counts_and_report(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    report = {
        "Enabled": True,
        "Path": "s3://datasets/reports",
        "Format": "REPORT_CSV_20191124",
        "Scope": "FAILED_FILES_ONLY",
    }
    stubber.add_response(
        "create_data_repository_task",
        {
            "DataRepositoryTask": task(
                "FAILED",
                Report=report,
                Status={"TotalCount": 10, "SucceededCount": 7, "FailedCount": 3},
                FailureDetails={"Message": "Access denied to s3://datasets/digits/x"},
            )
        },
        {"Type": "IMPORT_METADATA_FROM_REPOSITORY", "FileSystemId": FS, "Paths": [], "Report": report},
    )
    with pytest.raises(TunepodError) as raised:
        import_metadata(client, FS, [], report_path="s3://datasets/reports", **FAST)
    message = str(raised.value)
    assert "task-0123456789abcdef0" in message
    assert "FAILED: Access denied to s3://datasets/digits/x (3 of 10 files failed, 7 succeeded)" in message
    assert "listed under s3://datasets/reports" in message


def test_export_to_repository_runs_an_export_task(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": task("EXECUTING", "EXPORT_TO_REPOSITORY")},
        {
            "Type": "EXPORT_TO_REPOSITORY",
            "FileSystemId": FS,
            "Paths": ["digits/checkpoints"],
            "Report": {"Enabled": False},
        },
    )
    done = task(
        "SUCCEEDED", "EXPORT_TO_REPOSITORY", Status={"TotalCount": 4, "SucceededCount": 4, "FailedCount": 0}
    )
    stubber.add_response(
        "describe_data_repository_tasks",
        {"DataRepositoryTasks": [done]},
        {"TaskIds": ["task-0123456789abcdef0"]},
    )
    report = export_to_repository(client, FS, ["digits/checkpoints"], **FAST)
    assert (report.task_type, report.num_succeeded) == ("EXPORT_TO_REPOSITORY", 4)


def test_release_frees_files_not_accessed_for_some_days(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    release = "RELEASE_DATA_FROM_FILESYSTEM"
    stubber.add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": task("PENDING", release)},
        {
            "Type": release,
            "FileSystemId": FS,
            "Paths": ["digits"],
            "Report": {"Enabled": False},
            "ReleaseConfiguration": {"DurationSinceLastAccess": {"Unit": "DAYS", "Value": 7}},
        },
    )
    done = task("SUCCEEDED", release, Status={"TotalCount": 2, "SucceededCount": 2, "ReleasedCapacity": 4096})
    stubber.add_response(
        "describe_data_repository_tasks",
        {"DataRepositoryTasks": [done]},
        {"TaskIds": ["task-0123456789abcdef0"]},
    )
    report = release_from_file_system(client, FS, ["digits"], min_days_since_last_access=7, **FAST)
    assert (report.task_type, report.released_bytes) == (release, 4096)


def test_a_task_still_running_at_the_timeout_is_a_transient_error(fsx: tuple[Any, Stubber]) -> None:
    client, stubber = fsx
    stubber.add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": task("EXECUTING", "EXPORT_TO_REPOSITORY")},
        {"Type": "EXPORT_TO_REPOSITORY", "FileSystemId": FS, "Paths": [], "Report": {"Enabled": False}},
    )
    with pytest.raises(TransientError, match=r"still EXECUTING after 0 s.*describe-data-repository-tasks"):
        export_to_repository(client, FS, [], poll_s=0, timeout_s=0)


def test_export_folders_links_the_jobs_root_once_and_exports_in_tasks_of_100_paths(
    fsx: tuple[Any, Stubber], tmp_path: Path
) -> None:
    client, stubber = fsx
    root = tmp_path / "tunepod" / "jobs"
    folders = [root / "study" / f"trial-{n}" / "checkpoints" for n in range(101)]
    paths = [f"/tunepod/jobs/study/trial-{n}/checkpoints" for n in range(101)]
    linked = association("/tunepod/jobs", "s3://bucket/ckpt/", "AVAILABLE")
    stubber.add_response("describe_data_repository_associations", {"Associations": []}, BY_FILE_SYSTEM)
    # Only explicit tasks move data: no auto import/export policy, no import on create.
    stubber.add_response(
        "create_data_repository_association",
        {"Association": linked},
        {
            "FileSystemId": FS,
            "FileSystemPath": "/tunepod/jobs",
            "DataRepositoryPath": "s3://bucket/ckpt/",
            "BatchImportMetaDataOnCreate": False,
        },
    )
    for chunk in (paths[:100], paths[100:]):
        done = task("SUCCEEDED", "EXPORT_TO_REPOSITORY", Status={"SucceededCount": len(chunk)})
        stubber.add_response(
            "create_data_repository_task",
            {"DataRepositoryTask": done},
            {
                "Type": "EXPORT_TO_REPOSITORY",
                "FileSystemId": FS,
                "Paths": chunk,
                "Report": {"Enabled": False},
            },
        )
    report = export_folders(
        folders,
        file_system_id=FS,
        root=root,
        mount=tmp_path,
        s3_prefix="s3://bucket/ckpt",
        client=client,
        **FAST,
    )
    assert [t.num_succeeded for t in report.export_tasks] == [100, 1]
    assert report.release_tasks == []
    assert report.s3_uris[folders[7]] == "s3://bucket/ckpt/study/trial-7/checkpoints/"


def test_export_folders_refuses_a_folder_outside_the_linked_root(tmp_path: Path) -> None:
    with pytest.raises(TunepodError, match=r"is not under .*jobs \(the associated folder\)"):
        export_folders(
            [tmp_path / "elsewhere"],
            file_system_id=FS,
            root=tmp_path / "jobs",
            mount=tmp_path,
            s3_prefix="s3://bucket/ckpt/",
            client=object(),
        )
