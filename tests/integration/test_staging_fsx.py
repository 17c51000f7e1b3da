"""``fsx://<file-system-id>/<path>`` stage targets and the export step, end to end over real HTTP.

Stand-in: no FSx can run here and moto has no FSx data repository calls, so FSx is
``tests/standins/fsx_api.py`` (the real AWS JSON protocol, answers checked against botocore's FSx
model; each file system is a local folder). It imports from and exports to a real moto S3 server.
tunepod reaches it with its own ``boto3.client("fsx")`` through ``AWS_ENDPOINT_URL_FSX``; preload
jobs run as real torchrun processes on the local launcher. The exact requests tunepod sends are
checked with botocore's Stubber in ``tests/unit/test_fsx_repository.py``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient
from moto_server import REGION, MotoServer, put_objects
from standins.fsx_api import FsxStandIn, fsx_standin

from tunepod.errors import JobError, TunepodError
from tunepod.outputs import Dataset, Export, TrialRecord, TrialSet
from tunepod.pipeline import PipelineRun
from tunepod.runtime.checkpoints import save_checkpoint
from tunepod.spec.models import FsxStageSpec
from tunepod.staging import FsxTarget, stage_fsx

pytest.importorskip("boto3")

FS = "fs-0123456789abcdef0"
BUCKET = "datasets"
SOURCE = f"s3://{BUCKET}/digits/"
TARGET = f"fsx://{FS}/datasets/digits"
OBJECTS = {"train.csv": b"x,y\n1,2\n", "test.csv": b"x,y\n3,4\n", "shards/part-0.bin": bytes(range(256))}
FAST = {"poll_s": 0.01, "timeout_s": 30}


@pytest.fixture
def s3(moto: MotoServer) -> Any:
    """An empty moto holding ``OBJECTS`` under s3://datasets/digits/."""
    moto.reset()
    client = moto.client("s3")
    put_objects(client, BUCKET, "digits/", OBJECTS)
    return client


@pytest.fixture
def mount(tmp_path: Path) -> Path:
    """The file system's folder, which is also the local launcher's root."""
    return tmp_path / "shared"


@pytest.fixture
def fsx(s3: Any, mount: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FsxStandIn]:
    """The FSx stand-in serving file system ``FS`` (``mount``); tunepod's clients are pointed at it."""
    with fsx_standin(s3, {FS: mount}) as (standin, url):
        monkeypatch.setenv("AWS_ENDPOINT_URL_FSX", url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
        yield standin
    assert standin.problems == []  # every answer fitted the FSx API model


def fsx_client(fsx: FsxStandIn) -> Any:
    import boto3

    return boto3.client("fsx", region_name=REGION)


def files_under(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_a_new_association_is_created_once_then_reused(fsx: FsxStandIn, mount: Path) -> None:
    client = fsx_client(fsx)
    for path in ("/other-a", "/other-b"):  # with two per page, the dataset's association is on page 2
        client.create_data_repository_association(
            FileSystemId=FS, FileSystemPath=path, DataRepositoryPath=f"s3://{BUCKET}{path}/"
        )
    settings = FsxStageSpec(**FAST)
    first = stage_fsx(SOURCE, FsxTarget.parse(TARGET), settings, mount)
    second = stage_fsx(SOURCE, FsxTarget.parse(TARGET), settings, mount)

    assert fsx.calls.count("CreateDataRepositoryAssociation") == 3
    assert first.association.association_id == second.association.association_id
    assert first.association.lifecycle == "AVAILABLE"
    assert first.association.file_system_path == "/datasets/digits"
    assert files_under(mount / "datasets" / "digits") == OBJECTS
    assert (first.num_files, first.num_bytes) == (3, sum(map(len, OBJECTS.values())))
    assert (second.import_task.lifecycle, second.import_task.num_succeeded) == ("SUCCEEDED", 3)
    created = next(a for a in fsx.associations.values() if a["FileSystemPath"] == "/datasets/digits")
    assert created["S3"]["AutoImportPolicy"]["Events"] == ["NEW", "CHANGED", "DELETED"]


def test_a_path_linked_to_another_prefix_is_refused_naming_both(fsx: FsxStandIn, mount: Path) -> None:
    fsx_client(fsx).create_data_repository_association(
        FileSystemId=FS, FileSystemPath="/datasets/digits", DataRepositoryPath=f"s3://{BUCKET}/older/"
    )
    with pytest.raises(TunepodError) as caught:
        stage_fsx(SOURCE, FsxTarget.parse(TARGET), FsxStageSpec(**FAST), mount)
    assert f"s3://{BUCKET}/older/" in str(caught.value) and SOURCE in str(caught.value)
    assert "fix:" in str(caught.value)
    assert "CreateDataRepositoryTask" not in fsx.calls


def test_a_missing_bucket_leaves_the_association_misconfigured(fsx: FsxStandIn, mount: Path) -> None:
    with pytest.raises(TunepodError, match=r"is MISCONFIGURED: cannot reach bucket no-such-bucket"):
        stage_fsx("s3://no-such-bucket/x/", FsxTarget.parse(TARGET), FsxStageSpec(**FAST), mount)


def test_a_failed_import_task_raises_its_failure_details(fsx: FsxStandIn, s3: Any, mount: Path) -> None:
    stage_fsx(SOURCE, FsxTarget.parse(TARGET), FsxStageSpec(**FAST), mount)
    for rel in OBJECTS:
        s3.delete_object(Bucket=BUCKET, Key=f"digits/{rel}")
    s3.delete_bucket(Bucket=BUCKET)

    with pytest.raises(TunepodError) as caught:
        stage_fsx(SOURCE, FsxTarget.parse(TARGET), FsxStageSpec(**FAST), mount)
    message = str(caught.value)
    failed = [t for t in fsx.tasks.values() if t["Lifecycle"] == "FAILED"]
    assert len(failed) == 1
    assert f"IMPORT_METADATA_FROM_REPOSITORY task {failed[0]['TaskId']} on {FS} FAILED" in message
    assert "NoSuchBucket" in message


# ---------------------------------------------------------------------------------------------- as steps


def write_spec(tmp_path: Path, fsx_settings: dict[str, Any], export: dict[str, Any] | None = None) -> Path:
    """A stage -> tune (-> export) spec whose stores and launcher root live under ``tmp_path``."""
    steps: dict[str, Any] = {
        "data": {"uses": "stage", "with": {"source": SOURCE, "target": TARGET, "fsx": fsx_settings}},
        "search": {
            "uses": "tune",
            "needs": ["data"],
            "with": {
                "train": {"entrypoint": "tests/fixtures/trainers/quadratic.py"},
                "study": {"name": "quad", "metric": "score", "storage": f"journal://{tmp_path}/optuna.log"},
                "num_trials": 1,
                "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            },
        },
    }
    if export is not None:
        steps["save"] = {"uses": "export", "needs": ["search"], "with": export}
    spec = {
        "name": "fsx-test",
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "fsx"},
        "launcher": {"kind": "local", "root": str(tmp_path / "shared")},
        "steps": steps,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_import_counts_reach_the_dataset_and_mlflow(
    fsx: FsxStandIn, in_repo: Path, tmp_path: Path, mount: Path
) -> None:
    run = PipelineRun.start(write_spec(tmp_path, FAST))
    dataset = run.run_step("data", {})
    run.finish(ok=True)

    assert isinstance(dataset, Dataset) and dataset.fsx is not None
    assert dataset.path == str(mount.resolve() / "datasets" / "digits")
    assert (dataset.num_files, dataset.copied_files, dataset.copied_bytes) == (3, 3, 0)
    assert (dataset.fsx.num_imported_files, dataset.fsx.num_failed_files) == (3, 0)
    assert dataset.fsx.num_preloaded_files is None
    recorded = MlflowClient(run.tracker.tracking_uri).get_run(run.run_id).data
    assert recorded.metrics["data.imported_files"] == 3
    assert recorded.metrics["data.num_bytes"] == sum(map(len, OBJECTS.values()))
    assert recorded.tags["tunepod.data.fsx_association"] == dataset.fsx.association_id
    assert recorded.tags["tunepod.data.fsx_import_task"] == dataset.fsx.import_task_id


def test_preload_without_lfs_fails_saying_it_needs_a_lustre_client(
    fsx: FsxStandIn, in_repo: Path, tmp_path: Path
) -> None:
    if shutil.which("lfs") is not None:
        pytest.skip("a real lfs is on PATH here")
    run = PipelineRun.start(write_spec(tmp_path, {**FAST, "preload": True}))
    with pytest.raises(JobError, match="preload needs a Lustre client: `lfs` is not on PATH"):
        run.run_step("data", {})


def test_preload_runs_lfs_hsm_restore_as_a_launcher_job(
    fsx: FsxStandIn, in_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stand-in for the Lustre client's lfs: records each call, as a real hsm_restore request returns
    # once FSx has queued the restores.
    calls = tmp_path / "lfs-calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "lfs").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    run = PipelineRun.start(write_spec(tmp_path, {**FAST, "preload": True, "num_files_per_batch": 2}))
    dataset = run.run_step("data", {})

    assert isinstance(dataset, Dataset) and dataset.fsx is not None
    assert dataset.fsx.num_preloaded_files == 3
    folder = Path(dataset.path)
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["hsm_restore", "hsm_restore"]
    restored = [arg for line in lines for arg in line.split()[1:]]
    assert sorted(restored) == sorted(str(folder / rel) for rel in OBJECTS)
    recorded = MlflowClient(run.tracker.tracking_uri).get_run(run.run_id).data
    assert recorded.metrics["data.preloaded_files"] == 3


def test_export_and_release_land_the_best_checkpoints_in_s3(
    fsx: FsxStandIn, s3: Any, in_repo: Path, tmp_path: Path
) -> None:
    export = {
        "file_system_id": FS,
        "s3_prefix": f"s3://{BUCKET}/checkpoints/",
        "top_k": 2,
        "release": True,
        **FAST,
    }
    run = PipelineRun.start(write_spec(tmp_path, FAST, export))
    trials = trial_set(run, values={0: 0.5, 1: 0.9, 2: 0.1})
    first = run.run_step("save", {"search": trials})
    again = run.run_step("save", {"search": trials})

    assert isinstance(first, Export) and isinstance(again, Export)
    assert [c.trial for c in first.checkpoints] == [1, 0]
    expected = f"s3://{BUCKET}/checkpoints/quad/trial-1/checkpoints/"
    assert first.checkpoints[0].s3_uri == expected
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/")["Contents"]}
    assert {k.split("/")[2] for k in keys} == {"trial-0", "trial-1"}  # trial 2 was not chosen
    assert "checkpoints/quad/trial-1/checkpoints/step-000000/metadata.json" in keys
    assert first.num_exported_files == len(keys) == 4
    assert first.num_released_files == 4
    assert again.association_id == first.association_id
    assert (again.num_exported_files, fsx.calls.count("CreateDataRepositoryAssociation")) == (0, 1)
    created = next(a for a in fsx.associations.values() if a["FileSystemPath"] == "/jobs")
    assert "S3" not in created and created["BatchImportMetaDataOnCreate"] is False
    tags = MlflowClient(run.tracker.tracking_uri).get_run(run.run_id).data.tags
    assert tags["tunepod.save.trial-1.checkpoint_s3"] == expected


def test_export_refuses_trials_without_checkpoints_and_a_step_without_completed_trials(
    fsx: FsxStandIn, in_repo: Path, tmp_path: Path
) -> None:
    export = {"file_system_id": FS, "s3_prefix": f"s3://{BUCKET}/checkpoints/", **FAST}
    run = PipelineRun.start(write_spec(tmp_path, FAST, export))
    trials = trial_set(run, values={0: 0.5})
    shutil.rmtree(trials.trials[0].checkpoint_dir)
    with pytest.raises(JobError, match=r"no checkpoint folder for trial 0 .* fix: call ctx.save_checkpoint"):
        run.run_step("save", {"search": trials})
    pruned = trials.model_copy(update={"trials": [trials.trials[0].model_copy(update={"outcome": "PRUNED"})]})
    with pytest.raises(JobError, match="search has no completed trial, so no checkpoint to export"):
        run.run_step("save", {"search": pruned})
    run.finish(ok=False)
    assert "CreateDataRepositoryAssociation" not in fsx.calls  # refused before anything was linked


def test_an_empty_prefix_is_an_error_naming_the_source_and_the_mount(
    fsx: FsxStandIn, s3: Any, mount: Path
) -> None:
    with pytest.raises(TunepodError, match=r"holds no files: the prefix is empty, or the file system is not"):
        stage_fsx(f"s3://{BUCKET}/nothing-here/", FsxTarget.parse(TARGET), FsxStageSpec(**FAST), mount)


def trial_set(run: PipelineRun, values: dict[int, float]) -> TrialSet:
    """Trials of study ``quad`` with one real checkpoint each (step 0), as a tune step leaves them."""
    records = []
    for number, value in values.items():
        job_dir = run.shared.jobs_dir("quad") / f"trial-{number}"
        save_checkpoint(job_dir / "checkpoints", f"weights {number}".encode(), 0, keep=1)
        records.append(
            TrialRecord(
                number=number,
                outcome="COMPLETE",
                params={"x": value},
                value=value,
                job_dir=str(job_dir),
                checkpoint_dir=str(job_dir / "checkpoints"),
            )
        )
    dataset = Dataset(source=SOURCE, path="/unused", num_files=0, num_bytes=0, copied_files=0, copied_bytes=0)
    return TrialSet(
        step="search", study="quad", metric="score", direction="maximize", dataset=dataset, trials=records
    )
