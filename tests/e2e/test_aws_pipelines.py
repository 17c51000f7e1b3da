"""The digits pipeline end to end (stage -> tune -> evaluate -> register, through the Prefect flow) on
the two AWS launchers, against their STAND-INS (no Kubernetes API server nor SageMaker can run here):

- ``hyperpod_eks`` with ``tests/standins/kube_api.py`` (the Kubernetes REST API over HTTP, each pod's
  command run as local torchrun processes), for both CRDs;
- ``sagemaker`` with ``tests/standins/sagemaker_api.py`` (the SageMaker and CloudWatch Logs JSON APIs
  over HTTP, jobs run the way the PyTorch container's training toolkit runs them) and a read-write FSx
  channel, so checkpoints, metrics and results stay on "FSx" where the orchestrator reads them. No S3
  is needed: nothing syncs with S3 on a read-write channel.

As on a real cluster, tunepod runs from a checkout on the shared file system: the test copies the
digits scripts and the ``tunepod`` package to ``<root>/src`` and runs the pipeline from there, so the
jobs find the entrypoints, the staged dataset and ``tunepod`` (PYTHONPATH) under the launcher's root.
Tiny budget: 2 trials side by side, 2 epochs, 1 process each, the best one evaluated.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient
from standins.kube_api import KubeApiStandIn
from standins.sagemaker_api import SageMakerStandIn
from test_digits_pipeline import assert_pipeline_recorded

from flows.pipeline import pipeline
from tunepod.pipeline import PipelineSummary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FILE_SYSTEM = ("fs-0123456789abcdef0", "/abcdefgh/tunepod")


def checkout_on_fsx(repo: Path, root: Path) -> Path:
    """``<root>/src``: the digits scripts and the tunepod package, as a checkout on the shared file system."""
    checkout = root / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(repo / "examples" / "digits", checkout / "examples" / "digits", ignore=ignore)
    shutil.copytree(repo / "tunepod", checkout / "tunepod", ignore=ignore)
    return checkout


def write_spec(repo: Path, checkout: Path, launcher: dict[str, Any]) -> Path:
    """examples/digits/pipeline.yaml with ``launcher`` in place of the local one."""
    spec = yaml.safe_load((repo / "examples" / "digits" / "pipeline.yaml").read_text())
    spec["launcher"] = launcher
    path = checkout / f"pipeline-{launcher['kind']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def tiny_budget(tmp_path: Path) -> list[str]:
    return [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
        "steps.search.with.num_trials=2",
        "steps.search.with.num_parallel=2",
        "steps.search.with.train.args.epochs=2",
        "steps.search.with.train.resources.procs_per_node=1",
        "steps.check.with.top_k=1",
    ]


def assert_trials_tracked(tmp_path: Path, summary: PipelineSummary, launcher: str) -> tuple[list[str], str]:
    """What a user checks in MLflow beyond ``assert_pipeline_recorded``: each trial's metrics and the
    backend job that ran it, the final checkpoint of every completed trial as a logged model, the
    evaluation of the best one, and the registered version made from that model. Returns the backend
    job ids of the trials and of the evaluation."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    job_ids = []
    for trial in summary.trials:
        run = client.get_run(trial.run_id or "")
        assert run.data.tags["tunepod.launcher"] == launcher
        # Hyperband's min_resource 2 lies past the last step (1): no trial can be pruned.
        assert run.data.tags["tunepod.state"] == "COMPLETE", run.data.tags
        history = client.get_metric_history(run.info.run_id, "val_accuracy")
        assert [m.step for m in history][:1] == [0], history  # reported from epoch 0 on
        job_ids.append(run.data.tags["tunepod.job_id"])
        model = client.get_logged_model(run.data.tags["tunepod.model_id"])
        assert model.source_run_id == run.info.run_id
        assert model.status.to_proto() == model.status.READY.to_proto()
        assert model.tags["tunepod.step"] == "1"  # the checkpoint after the last of 2 epochs
        checkpoint = Path(model.tags["tunepod.checkpoint"])
        assert checkpoint.is_relative_to(Path(run.data.tags["tunepod.job_dir"]))
        assert {a.path for a in client.list_logged_model_artifacts(model.model_id)} >= {"metadata.json"}

    assert summary.best is not None and summary.best.run_id is not None
    best = client.get_run(summary.best.run_id)
    assert best.data.metrics["test_accuracy"] == summary.evaluation[f"trial-{summary.best.number}"] > 0.5
    evaluation_job_id = best.data.tags["tunepod.check.job_id"]
    assert evaluation_job_id not in job_ids
    assert "/check/" in best.data.tags["tunepod.check.job_dir"]
    parent = client.get_run(summary.run_id)
    assert parent.data.metrics["check.best_test_accuracy"] == best.data.metrics["test_accuracy"]
    version = client.get_model_version_by_alias("digits-mlp", "champion")
    # The version was made from the best trial's logged model (the SQLite store leaves model_id unset).
    assert version.source == f"models:/{best.data.tags['tunepod.model_id']}"
    assert version.run_id == best.info.run_id
    return job_ids, evaluation_job_id


# ---------------------------------------------------------------------------------- HyperPod EKS


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeApiStandIn]:
    with KubeApiStandIn(tmp_path / "kube-state", grace_s=3.0) as standin:
        yield standin


@pytest.mark.parametrize("crd", ["hyperpod", "kubeflow"])
def test_digits_pipeline_on_hyperpod_eks(
    prefect_api: None,
    in_repo: Path,
    tmp_path: Path,
    kube: KubeApiStandIn,
    crd: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "fsx"
    checkout = checkout_on_fsx(in_repo, root)
    launcher = {
        "kind": "hyperpod_eks",
        "crd": crd,
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/tunepod-train:latest",
        "root": str(root),
        "claim_name": "fsx-claim",
        "python": sys.executable,  # the image's python; the stand-in runs this machine's anyway
        "working_dir": str(checkout),
        "env": {"PYTHONPATH": str(checkout)},
        "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "poll_cache_s": 0.2,
    }
    spec = write_spec(in_repo, checkout, launcher)
    monkeypatch.chdir(checkout)

    state = pipeline(str(spec), tiny_budget(tmp_path), return_state=True)
    summary = assert_pipeline_recorded(state, tmp_path, num_trials=2)
    job_ids, evaluation_job_id = assert_trials_tracked(tmp_path, summary, "hyperpod_eks")

    # Every trial's job id names an object the cluster holds (ended jobs stay until their TTL).
    plural = "hyperpodpytorchjobs" if crd == "hyperpod" else "pytorchjobs"
    objects = {
        f"{o['metadata']['namespace']}/{o['metadata']['name']}/{o['metadata']['uid']}": o
        for o in kube_objects(kube, plural)
    }
    scripts = {job_id: "train.py" for job_id in job_ids} | {evaluation_job_id: "evaluate.py"}
    for job_id, script in scripts.items():
        conditions = [c["type"] for c in objects[job_id]["status"]["conditions"] if c["status"] == "True"]
        assert conditions[-1] in ("Completed", "Succeeded"), conditions
        # The pods ran the script of the checkout on the claim.
        assert str(checkout / "examples" / "digits" / script) in pod_container(objects[job_id])["command"]
    # Stage wrote no job; two trials and one evaluation ran as objects of the chosen CRD.
    assert len(objects) == 3


def pod_container(obj: dict[str, Any]) -> dict[str, Any]:
    """The training container of a HyperPodPyTorchJob or a (single-replica) Kubeflow PyTorchJob."""
    if obj["kind"] == "HyperPodPyTorchJob":
        replicas = obj["spec"]["replicaSpecs"]
    else:
        replicas = list(obj["spec"]["pytorchReplicaSpecs"].values())
    container: dict[str, Any] = replicas[0]["template"]["spec"]["containers"][0]
    return container


def kube_objects(kube: KubeApiStandIn, plural: str) -> list[dict[str, Any]]:
    """The objects of ``plural`` in namespace default, listed through the real client (as kubectl does)."""
    from kubernetes import client, config

    api = client.CustomObjectsApi(
        config.new_client_from_config(str(kube.write_kubeconfig(kube.state_dir / "kc")))
    )
    group = "sagemaker.amazonaws.com" if plural == "hyperpodpytorchjobs" else "kubeflow.org"
    items: list[dict[str, Any]] = api.list_namespaced_custom_object(group, "v1", "default", plural)["items"]
    return items


# ---------------------------------------------------------------------------------- SageMaker


@pytest.fixture
def sagemaker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SageMakerStandIn]:
    """The SageMaker stand-in mounting ``<tmp_path>/fsx`` as the FSx directory; boto3 pointed at it.
    Its S3 endpoint is never called (no CheckpointConfig on a read-write channel): no moto server."""
    root = tmp_path / "fsx"
    root.mkdir()
    with SageMakerStandIn(
        file_systems={FILE_SYSTEM: root},
        work_dir=tmp_path / "instances",
        s3_endpoint_url="http://127.0.0.1:9",
    ) as server:
        for name, value in server.client_environment().items():
            monkeypatch.setenv(name, value)
        yield server


def test_digits_pipeline_on_sagemaker(
    prefect_api: None,
    in_repo: Path,
    tmp_path: Path,
    sagemaker: SageMakerStandIn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "fsx"
    checkout = checkout_on_fsx(in_repo, root)
    launcher = {
        "kind": "sagemaker",
        "root": str(root),
        "role_arn": "arn:aws:iam::123456789012:role/tunepod-test",
        # The image is looked up by the SageMaker Python SDK for the version, region and instance type.
        "framework_version": "2.5",
        "region": "us-east-1",
        "output_s3_uri": "s3://tunepod-test/output/",
        "instance_type": "ml.m5.xlarge",  # a CPU type: one process per job
        "fsx": {"file_system_id": FILE_SYSTEM[0], "directory_path": FILE_SYSTEM[1]},
        "subnets": ["subnet-0a1b2c3d"],
        "security_group_ids": ["sg-0a1b2c3d"],
        "env": {"PYTHONPATH": "/opt/ml/input/data/train/src"},  # the checkout on the mounted channel
        "poll_cache_s": 0.2,
    }
    spec = write_spec(in_repo, checkout, launcher)
    monkeypatch.chdir(checkout)

    state = pipeline(str(spec), tiny_budget(tmp_path), return_state=True)
    summary = assert_pipeline_recorded(state, tmp_path, num_trials=2)
    job_ids, evaluation_job_id = assert_trials_tracked(tmp_path, summary, "sagemaker")

    assert sorted(sagemaker.jobs) == sorted([*job_ids, evaluation_job_id])
    for job_id, program in [*((j, "train.py") for j in job_ids), (evaluation_job_id, "evaluate.py")]:
        job = sagemaker.jobs[job_id]
        assert job.status == "Completed", job.failure_reason
        image = job.request["AlgorithmSpecification"]["TrainingImage"]
        assert image == "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.5-cpu-py311"
        assert job.hyperparameters["sagemaker_program"] == program
        # The code came from the checkout on the channel, as did tunepod (PYTHONPATH) and the data.
        assert (
            job.hyperparameters["sagemaker_submit_directory"]
            == "/opt/ml/input/data/train/src/examples/digits"
        )
        assert job.request["Environment"]["TUNEPOD_DATA_DIR"] == "/opt/ml/input/data/train/datasets/digits"
