"""The digits pipeline with its data in S3 and an FSx for Lustre target, then its best checkpoints
exported back to S3: the Prefect flow, real torchrun jobs, Optuna and MLflow stores, a moto S3
server, and the FSx stand-in (``tests/standins/fsx_api.py``: no FSx can run here) that folder
``<launcher root>`` stands for. Small budget: 2 trials, 2 epochs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient
from moto_server import REGION, moto_server
from standins.fsx_api import FsxStandIn, fsx_standin
from test_digits_pipeline import assert_pipeline_recorded

from flows.pipeline import pipeline
from tunepod.staging.builtin import write_digits

pytestmark = pytest.mark.slow
pytest.importorskip("boto3")

FS = "fs-0123456789abcdef0"
BUCKET = "datasets"


@pytest.fixture
def aws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FsxStandIn]]:
    """moto S3 holding the digits files under s3://datasets/digits/, and the FSx stand-in whose
    file system is the launcher's root; tunepod's boto3 clients are pointed at both."""
    with moto_server() as server:
        s3 = server.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        for path in write_digits(tmp_path / "digits"):
            s3.upload_file(str(path), BUCKET, f"digits/{path.relative_to(tmp_path / 'digits').as_posix()}")
        with fsx_standin(s3, {FS: tmp_path / "shared"}) as (standin, url):
            monkeypatch.setenv("AWS_ENDPOINT_URL_FSX", url)
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
            yield s3, standin
        assert standin.problems == []


def fsx_spec(tmp_path: Path, in_repo: Path) -> Path:
    """examples/digits/pipeline.yaml with an S3 source, an FSx target and an export step."""
    spec = yaml.safe_load((in_repo / "examples/digits/pipeline.yaml").read_text())
    fast = {"poll_s": 0.05, "timeout_s": 60}
    spec["steps"]["data"]["with"] = {
        "source": f"s3://{BUCKET}/digits/",
        "target": f"fsx://{FS}/datasets/digits",
        "fsx": fast,
    }
    spec["steps"]["save"] = {
        "uses": "export",
        "needs": ["search"],
        "with": {
            "file_system_id": FS,
            "s3_prefix": f"s3://{BUCKET}/checkpoints/",
            "trials": "completed",
            **fast,
        },
    }
    path = tmp_path / "pipeline-fsx.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_digits_pipeline_from_s3_through_fsx(
    prefect_api: None, in_repo: Path, tmp_path: Path, aws: tuple[Any, FsxStandIn]
) -> None:
    s3, standin = aws
    overrides = [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"launcher.root={tmp_path}/shared",
        f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
        "steps.search.with.num_trials=2",
        "steps.search.with.num_parallel=2",
        "steps.search.with.train.args.epochs=2",
        "steps.check.with.top_k=1",
    ]
    state = pipeline(str(fsx_spec(tmp_path, in_repo)), overrides, return_state=True)
    summary = assert_pipeline_recorded(state, tmp_path, num_trials=2)

    staged = tmp_path / "shared" / "datasets" / "digits"
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in (tmp_path / "digits").iterdir())
    parent = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(summary.run_id).data
    assert parent.tags["tunepod.data.path"] == str(staged)
    assert parent.metrics["data.imported_files"] == parent.metrics["data.num_files"] > 0

    completed = [t for t in summary.trials if t.outcome == "COMPLETE"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/")["Contents"]]
    for trial in completed:
        uri = f"s3://{BUCKET}/checkpoints/digits/trial-{trial.number}/checkpoints/"
        assert parent.tags[f"tunepod.save.trial-{trial.number}.checkpoint_s3"] == uri
        exported = [k for k in keys if k.startswith(uri.removeprefix(f"s3://{BUCKET}/"))]
        assert any(k.endswith("/metadata.json") for k in exported), keys
    assert parent.metrics["save.exported_files"] == len(keys)
    assert [a["FileSystemPath"] for a in standin.associations.values()] == ["/datasets/digits", "/jobs"]
