"""``render_manifest`` against stored manifests in ``tests/unit/golden`` (``*.hyperpod.yaml`` for
``HyperPodPyTorchJob``, ``*.pytorchjob.yaml`` for Kubeflow), each HyperPod one also validated against
the CRD's JSON schema in ``tests/fixtures/schemas``, plus the pure helpers around them and the mapping of
what the API says onto ``JobState``.

Regenerate the stored manifests after an intended change with
``TUNEPOD_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_hyperpod_eks_render.py`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from tunepod.errors import TunepodError
from tunepod.launch.base import SUBMISSION_ID_ENV, JobSpec, JobState, Resources
from tunepod.launch.hyperpod_eks import (
    CRDS,
    MAX_NAME_LENGTH,
    SUBMISSION_ANNOTATION,
    ObjectRef,
    ObjectStatus,
    format_cpu,
    format_memory,
    ignored_settings,
    literal,
    object_name,
    render_manifest,
    state_from_conditions,
)
from tunepod.launch.hyperpod_eks.exits import (
    POD_NAME_ENV,
    exit_recorder,
    pod_name_env,
    recorded_exit,
    stale_records,
)
from tunepod.launch.hyperpod_eks.render import training_command
from tunepod.launch.watchdog import Limits
from tunepod.spec.models import HyperPodEksLauncherSpec, LauncherSpec

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TUNEPOD_UPDATE_GOLDEN") == "1"
SCHEMA_PATH = Path(__file__).parents[1] / "fixtures" / "schemas" / "hyperpodpytorchjob-spec.schema.json"
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def hyperpod_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return schema


def assert_matches_golden(name: str, manifest: dict[str, Any]) -> None:
    """``manifest`` as YAML equals ``golden/<name>``; with TUNEPOD_UPDATE_GOLDEN=1 it (re)writes it."""
    path = GOLDEN / name
    text = yaml.safe_dump(manifest, sort_keys=False, width=1000)
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} is missing; create it with TUNEPOD_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{path} differs; if intended, regenerate with TUNEPOD_UPDATE_GOLDEN=1"


def assert_valid_hyperpod(manifest: dict[str, Any]) -> None:
    assert manifest["apiVersion"] == "sagemaker.amazonaws.com/v1"
    assert manifest["kind"] == "HyperPodPyTorchJob"
    jsonschema.validate(manifest["spec"], hyperpod_schema(), cls=jsonschema.Draft202012Validator)


def spec(**fields: object) -> HyperPodEksLauncherSpec:
    base = {
        "kind": "hyperpod_eks",
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/train:1.4",
        "root": "/fsx/tunepod",
        "claim_name": "fsx-claim",
    }
    return HyperPodEksLauncherSpec.model_validate({**base, **fields})


CONTRACT_ENV = {
    "TUNEPOD_PARAMS": '{"lr": 0.01, "hidden": 64}',
    "TUNEPOD_CHECKPOINT_DIR": "/fsx/tunepod/jobs/digits/trial-7/checkpoints",
    "TUNEPOD_RESULT_FILE": "/fsx/tunepod/jobs/digits/trial-7/result.json",
    "TUNEPOD_TRIAL": "7",
}
DEFAULT_JOB = JobSpec(
    name="digits-trial-7",
    entrypoint=Path("/fsx/tunepod/code/train.py"),
    job_dir=Path("/fsx/tunepod/jobs/digits/trial-7"),
    env=CONTRACT_ENV,
)


def job(**fields: Any) -> JobSpec:
    return dataclasses.replace(DEFAULT_JOB, **fields)


FULL = {
    "namespace": "ml-team",
    "queue_name": "hyperpod-ns-ml-team-localqueue",
    "priority_class": "training-priority",
    "cpus_per_node": 90,
    "mem_gb": 1000,
    "efa_per_node": 32,
    "working_dir": "/fsx/tunepod/code",
    "env": {"NCCL_DEBUG": "WARN", "FI_PROVIDER": "efa", "TUNEPOD_TRIAL": "overridden by the job"},
    "node_selector": {"sagemaker.amazonaws.com/deep-health-check-status": "Passed"},
    "service_account": "training",
    "max_retries": 5,
    "ttl_after_finished_s": 7200,
}
GPU_JOB = job(
    args=("--epochs", "12"),
    resources=Resources(
        num_nodes=4,
        procs_per_node=8,
        gpus_per_node=8,
        instance_type="ml.p5.48xlarge",
        timeout_min=90.5,
        stop_grace_s=120,
    ),
    limits=Limits(timeout_s=5430, hang_timeout_s=900, startup_timeout_s=1200),
)


# ------------------------------------------------------------------------------------------ HyperPod


def test_minimal_hyperpod_job() -> None:
    manifest = render_manifest(job(), spec())
    assert_valid_hyperpod(manifest)
    assert_matches_golden("minimal.hyperpod.yaml", manifest)


def test_every_hyperpod_option() -> None:
    full = spec(
        **FULL,
        restart_eval_period_s=3600,
        max_full_job_restarts=2,
        hang_detection=[
            {"name": "started", "log_pattern": r".*epoch 0 .*", "start_within_s": 600},
            {
                "name": "progress",
                "log_pattern": r".*val_accuracy=(\d+\.\d+).*",
                "stop_pattern": ".*training done.*",
                "recur_within_s": 900,
            },
        ],
    )
    manifest = render_manifest(GPU_JOB, full)
    assert_valid_hyperpod(manifest)
    assert_matches_golden("full.hyperpod.yaml", manifest)


def test_awkward_names_and_dollars_are_made_safe() -> None:
    awkward = job(
        name="9 Trials/of Digits: lr=0.01 and much more text than a Kubernetes name can hold",
        args=("--note", "costs $5 and $(HOME) stays literal"),
        env={"TUNEPOD_PARAMS": '{"tag": "$(whoami)"}'},
    )
    manifest = render_manifest(awkward, spec(env={"PRICE": "$$2"}))
    assert_valid_hyperpod(manifest)
    assert_matches_golden("awkward.hyperpod.yaml", manifest)
    container = manifest["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    assert container["command"][-1] == "costs $$5 and $$(HOME) stays literal"
    assert {"name": "PRICE", "value": "$$$$2"} in container["env"]


def test_a_job_dir_outside_the_root_is_refused() -> None:
    with pytest.raises(TunepodError, match=r"outside the launcher root /fsx/tunepod.*fsx-claim"):
        render_manifest(job(job_dir=Path("/tmp/trial-7")), spec())


def test_an_entrypoint_outside_the_root_is_refused_naming_the_fix() -> None:
    with pytest.raises(
        TunepodError, match=r"entrypoint /home/me/train.py .* fix: run tunepod from a checkout"
    ):
        render_manifest(job(entrypoint=Path("/home/me/train.py")), spec())


def test_a_relative_root_is_refused() -> None:
    with pytest.raises(TunepodError, match="absolute path"):
        render_manifest(job(), spec(root="fsx/tunepod"))


def test_an_env_name_kubernetes_rejects_is_refused() -> None:
    with pytest.raises(TunepodError, match=r"'BAD-NAME'.*C identifier"):
        render_manifest(job(env={"BAD-NAME": "x"}), spec())


def test_the_job_env_wins_over_the_launcher_env() -> None:
    manifest = render_manifest(job(), spec(env={"TUNEPOD_TRIAL": "launcher", "EXTRA": "1"}))
    env = manifest["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "TUNEPOD_TRIAL", "value": "7"} in env
    assert {"name": "EXTRA", "value": "1"} in env
    assert [entry["name"] for entry in env].count("TUNEPOD_TRIAL") == 1


# ------------------------------------------------------------------------------------------ Kubeflow


def test_kubeflow_single_node() -> None:
    assert_matches_golden("minimal.pytorchjob.yaml", render_manifest(job(), spec(crd="kubeflow")))


def test_kubeflow_master_and_workers() -> None:
    manifest = render_manifest(GPU_JOB, spec(crd="kubeflow", **FULL))
    assert_matches_golden("full.pytorchjob.yaml", manifest)
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)


def test_kubeflow_elastic() -> None:
    manifest = render_manifest(GPU_JOB, spec(crd="kubeflow", elastic=True, max_retries=3))
    assert_matches_golden("elastic.pytorchjob.yaml", manifest)
    assert set(manifest["spec"]["pytorchReplicaSpecs"]) == {"Worker"}


ELASTIC_JOB = job(resources=Resources(num_nodes=4, min_nodes=2, procs_per_node=8, gpus_per_node=8))


def test_kubeflow_elastic_job_takes_its_bounds_from_min_nodes() -> None:
    """resources.min_nodes alone makes the elasticPolicy (no launcher flag needed), min to max pods,
    with torchrun's --nnodes=min:max and a restart per pod the job may lose."""
    manifest = render_manifest(ELASTIC_JOB, spec(crd="kubeflow"))
    policy = manifest["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (2, 4, 2)
    worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4
    command = worker["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes=2:4" in command
    # The launcher's retries count when there are more of them.
    retried = render_manifest(ELASTIC_JOB, spec(crd="kubeflow", max_retries=5))
    assert retried["spec"]["elasticPolicy"]["maxRestarts"] == 5


def test_hyperpod_elastic_job_gets_the_operators_elastic_policy() -> None:
    manifest = render_manifest(ELASTIC_JOB, spec())
    assert_valid_hyperpod(manifest)
    assert manifest["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4}
    assert manifest["spec"]["replicaSpecs"][0]["replicas"] == 4
    command = manifest["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes=2:4" in command
    assert "elasticPolicy" not in render_manifest(GPU_JOB, spec())["spec"]


def test_settings_the_chosen_crd_ignores_are_named() -> None:
    rules = [{"name": "r", "log_pattern": "x", "recur_within_s": 60}]
    assert set(ignored_settings(spec(crd="kubeflow", hang_detection=rules, restart_eval_period_s=60))) == {
        "hang_detection",
        "restart_eval_period_s",
    }
    assert set(ignored_settings(spec(elastic=True))) == {"elastic"}
    assert ignored_settings(spec()) == {}


# ------------------------------------------------------------------------------------------ secrets

SECRET_ENV = {
    "MLFLOW_TRACKING_URI": {"secret": "mlflow", "key": "tracking-uri"},
    "HF_TOKEN": {"secret": "hugging-face", "key": "token"},
}
# A job as the launcher renders it: with its attempt's submission id, and with tracking credentials in
# its own environment (the tracker hands MLFLOW_TRACKING_URI to every trial).
LAUNCHED_JOB = job(
    env={
        **CONTRACT_ENV,
        SUBMISSION_ID_ENV: "0123456789abcdef",
        "MLFLOW_TRACKING_URI": "https://tunepod:s3cr3t@mlflow.example.com",
    }
)


def pod_env(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    if manifest["kind"] == "HyperPodPyTorchJob":
        template = manifest["spec"]["replicaSpecs"][0]["template"]
    else:
        template = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    env: list[dict[str, Any]] = template["spec"]["containers"][0]["env"]
    return env


def test_secret_env_and_the_submission_annotation_hyperpod() -> None:
    manifest = render_manifest(LAUNCHED_JOB, spec(secret_env=SECRET_ENV, env={"NCCL_DEBUG": "WARN"}))
    assert_valid_hyperpod(manifest)
    assert_matches_golden("secrets.hyperpod.yaml", manifest)
    assert manifest["metadata"]["annotations"][SUBMISSION_ANNOTATION] == "0123456789abcdef"


def test_secret_env_and_the_submission_annotation_kubeflow() -> None:
    manifest = render_manifest(LAUNCHED_JOB, spec(crd="kubeflow", secret_env=SECRET_ENV))
    assert_matches_golden("secrets.pytorchjob.yaml", manifest)
    assert manifest["metadata"]["annotations"][SUBMISSION_ANNOTATION] == "0123456789abcdef"


@pytest.mark.parametrize("crd", ["hyperpod", "kubeflow"])
def test_a_secret_variable_is_never_inline_even_when_the_job_sets_it(crd: str) -> None:
    manifest = render_manifest(LAUNCHED_JOB, spec(crd=crd, secret_env=SECRET_ENV))
    assert "s3cr3t" not in json.dumps(manifest)
    tracking = [entry for entry in pod_env(manifest) if entry["name"] == "MLFLOW_TRACKING_URI"]
    assert tracking == [
        {
            "name": "MLFLOW_TRACKING_URI",
            "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "tracking-uri"}},
        }
    ]


def test_a_job_without_a_submission_id_carries_no_submission_annotation() -> None:
    # So that a job rendered outside a launcher (and every older golden) renders as before.
    assert SUBMISSION_ANNOTATION not in render_manifest(job(), spec())["metadata"]["annotations"]


def test_a_variable_in_both_env_and_secret_env_is_refused_naming_both() -> None:
    with pytest.raises(
        ValidationError, match=r"HF_TOKEN set in both env and secret_env; fix: remove HF_TOKEN from env"
    ):
        spec(env={"HF_TOKEN": "hf_abc", "NCCL_DEBUG": "WARN"}, secret_env=SECRET_ENV)


def test_secret_env_cannot_replace_the_runtime_contract() -> None:
    with pytest.raises(ValidationError, match=r"TUNEPOD_RESULT_FILE, which tunepod sets per job"):
        spec(secret_env={"TUNEPOD_RESULT_FILE": {"secret": "s", "key": "k"}})


@pytest.mark.parametrize("ref", [{"secret": "Not_A_Name", "key": "k"}, {"secret": "s", "key": "a/b"}])
def test_a_secret_reference_kubernetes_rejects_is_refused(ref: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match="should match pattern"):
        spec(secret_env={"X": ref})


def test_a_secret_variable_name_kubernetes_rejects_is_refused() -> None:
    with pytest.raises(TunepodError, match=r"'BAD-NAME'.*C identifier"):
        render_manifest(job(), spec(secret_env={"BAD-NAME": {"secret": "s", "key": "k"}}))


# ------------------------------------------------------------------------------------------ helpers


@pytest.mark.parametrize(
    "job_name",
    ["digits-trial-7", "Digits_Trial_7", "7", "---", "a" * 200, "trial 7: lr=0.1", "x" * 41 + "-" + "y" * 10],
)
def test_object_names_are_dns_labels_and_stable(job_name: str) -> None:
    name = object_name(job_name)
    assert DNS_1035.fullmatch(name), name
    assert len(name) <= MAX_NAME_LENGTH
    assert object_name(job_name) == name


def test_names_that_clean_up_alike_stay_distinct() -> None:
    assert object_name("trial_7") != object_name("trial-7")
    assert object_name("a" * 100 + "1") != object_name("a" * 100 + "2")


@pytest.mark.parametrize(
    ("text", "expected"), [("plain", "plain"), ("$(HOME)", "$$(HOME)"), ("$$", "$$$$"), ("a$b", "a$$b")]
)
def test_literal_doubles_every_dollar(text: str, expected: str) -> None:
    assert literal(text) == expected


@pytest.mark.parametrize(("gb", "quantity"), [(16, "16Gi"), (1.5, "1536Mi"), (0.001, "2Mi")])
def test_memory_quantities(gb: float, quantity: str) -> None:
    assert format_memory(gb) == quantity


@pytest.mark.parametrize(("cpus", "quantity"), [(8, "8"), (1.5, "1500m"), (0.25, "250m")])
def test_cpu_quantities(cpus: float, quantity: str) -> None:
    assert format_cpu(cpus) == quantity


# ------------------------------------------------------------------------------------------ spec


def test_the_launcher_union_picks_the_hyperpod_spec() -> None:
    parsed = TypeAdapter(LauncherSpec).validate_python(
        {"kind": "hyperpod_eks", "image": "i", "root": "/fsx", "claim_name": "c"}
    )
    assert isinstance(parsed, HyperPodEksLauncherSpec)
    assert parsed.ttl_after_finished_s > 0


def test_a_rule_that_can_never_fire_is_refused() -> None:
    with pytest.raises(ValidationError, match="can never fire"):
        spec(hang_detection=[{"name": "r", "log_pattern": "x"}])


def test_full_job_restarts_need_a_window() -> None:
    with pytest.raises(ValidationError, match="restart_eval_period_s"):
        spec(max_full_job_restarts=2)


def test_a_zero_ttl_is_refused() -> None:
    # The operator deletes a job at once with TTL 0, and its final state with it.
    with pytest.raises(ValidationError, match="ttl_after_finished_s"):
        spec(ttl_after_finished_s=0)


# ------------------------------------------------------------------------------------------ exit records


def as_kubelet_runs(command: list[str]) -> list[str]:
    """The container command after Kubernetes' expansion (the renderer escapes every ``$`` as ``$$``)."""
    return [part.replace("$$", "$") for part in command]


def wrapped(job_dir: Path, *command: str) -> subprocess.Popen[bytes]:
    """The exit recorder of a pod named ``trial-7-pod-0`` of submission ``sub-1``, running ``command``."""
    env = {**os.environ, POD_NAME_ENV: "trial-7-pod-0", SUBMISSION_ID_ENV: "sub-1"}
    return subprocess.Popen([*as_kubelet_runs(exit_recorder(job_dir)), *command], env=env)


@pytest.mark.parametrize("crd", ["hyperpod", "kubeflow"])
def test_the_container_runs_the_training_command_under_the_exit_recorder(crd: str) -> None:
    launcher = spec(crd=crd)
    manifest = render_manifest(job(), launcher)
    replicas = manifest["spec"].get("replicaSpecs") or list(manifest["spec"]["pytorchReplicaSpecs"].values())
    template = replicas[0]["template"]
    container = template["spec"]["containers"][0]
    assert container["command"] == [*exit_recorder(job().job_dir), *training_command(job(), launcher)]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert "tunepod_job_dir=/fsx/tunepod/jobs/digits/trial-7\n" in container["command"][2]
    # The pod's name reaches the shell through the downward API.
    assert pod_name_env() in container["env"]
    assert pod_name_env() == {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


@pytest.mark.parametrize("code", [0, 3])
def test_the_recorder_records_the_commands_exit_code_and_submission_in_the_job_dir(
    tmp_path: Path, code: int
) -> None:
    assert wrapped(tmp_path, "/bin/sh", "-c", f"exit {code}").wait(timeout=30) == code
    assert (tmp_path / "exit_code.trial-7-pod-0").read_text() == f"{code} sub-1\n"
    assert [path.name for path in tmp_path.iterdir()] == ["exit_code.trial-7-pod-0"]
    assert recorded_exit(tmp_path, "sub-1", pods=1) == code


def test_the_recorder_passes_sigterm_on_and_records_how_the_command_ended(tmp_path: Path) -> None:
    """Only the shell gets the signal, as PID 1 of a container does: its child must get it from the
    shell, and the shell must outlive it to record 143 (128 + SIGTERM)."""
    started = tmp_path / "started"
    process = wrapped(tmp_path, "/bin/sh", "-c", f"touch {started}; exec sleep 60")
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # the shell has noted its child's pid by now
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    assert (tmp_path / "exit_code.trial-7-pod-0").read_text() == "143 sub-1\n"


def test_a_job_is_judged_by_every_pods_record_of_its_submission(tmp_path: Path) -> None:
    def record(pod: str, text: str) -> None:
        (tmp_path / f"exit_code.{pod}").write_text(text)

    assert recorded_exit(tmp_path, "sub-2", pods=2) is None
    record("job-pod-0", "0 sub-2\n")
    assert recorded_exit(tmp_path, "sub-2", pods=2) is None  # pod 1 has not recorded: unknown
    record("job-pod-1", "0 sub-1\n")
    assert recorded_exit(tmp_path, "sub-2", pods=2) is None  # an earlier attempt's record
    record("job-pod-1", "0 sub-2\n")
    assert recorded_exit(tmp_path, "sub-2", pods=2) == 0
    record("job-pod-1.tmp", "137 sub-2\n")  # a write under way
    record("job-pod-2", "garbage")
    assert recorded_exit(tmp_path, "sub-2", pods=2) == 0
    record("job-pod-1", "137 sub-2\n")
    assert recorded_exit(tmp_path, "sub-2", pods=2) == 137  # any failed pod fails the job
    assert [path.name for path in stale_records(tmp_path)] == [
        "exit_code.job-pod-0",
        "exit_code.job-pod-1",
        "exit_code.job-pod-1.tmp",
        "exit_code.job-pod-2",
    ]


# ------------------------------------------------------------------------------------------ states


def cond(kind: str, status: str = "True") -> dict[str, str]:
    return {"type": kind, "status": status}


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ([], JobState.PENDING),
        ([cond("Created")], JobState.PENDING),
        ([cond("Created", "False"), cond("Suspended")], JobState.PENDING),
        ([cond("Created"), cond("Running")], JobState.RUNNING),
        # Between two runs of a restart in place: the next run is judged afresh once it runs.
        ([cond("Running", "False"), cond("Restarting")], JobState.PENDING),
        ([cond("Created"), cond("Running", "False"), cond("Succeeded")], JobState.SUCCEEDED),
        ([cond("Running", "False"), cond("Completed")], JobState.SUCCEEDED),
        ([cond("Running"), cond("Failed")], JobState.FAILED),
        ([cond("Failed", "False"), cond("Running")], JobState.RUNNING),
        ([cond("SomethingNew"), cond("Running")], JobState.RUNNING),
        ([cond("SomethingNew")], JobState.PENDING),
    ],
)
def test_conditions_map_to_job_states(conditions: list[dict[str, str]], expected: JobState) -> None:
    assert state_from_conditions(conditions) is expected


def test_a_run_restarted_in_place_has_a_run_mark_of_its_own() -> None:
    ref = ObjectRef(CRDS["kubeflow"], "ml-team", "trial-7-0123abcd", "uid-1")

    def at(kind: str, status: str, stamp: str) -> dict[str, str]:
        return {**cond(kind, status), "lastTransitionTime": stamp}

    first = ObjectStatus(ref, (at("Created", "True", "t0"), at("Running", "True", "t1")))
    between = ObjectStatus(ref, (at("Running", "False", "t2"), at("Restarting", "True", "t2")))
    second = ObjectStatus(ref, (at("Restarting", "False", "t3"), at("Running", "True", "t3")))
    assert (first.run_mark, between.run_mark, second.run_mark) == ("t1", None, "t3")


def test_a_gone_object_is_failed_and_says_why() -> None:
    ref = ObjectRef(CRDS["hyperpod"], "ml-team", "trial-7-0123abcd", "uid-1")
    gone = ObjectStatus.gone(ref, "deleted outside tunepod")
    assert gone.job_state is JobState.FAILED
    assert (
        gone.describe(ref.job_id)
        == "HyperPodPyTorchJob ml-team/trial-7-0123abcd is gone: deleted outside tunepod"
    )


def test_a_gone_object_whose_pods_recorded_exit_0_succeeded() -> None:
    ref = ObjectRef(CRDS["hyperpod"], "ml-team", "trial-7-0123abcd", "uid-1")
    assert ObjectStatus.gone(ref, "its TTL expired", recorded_exit=0).job_state is JobState.SUCCEEDED
    assert ObjectStatus.gone(ref, "its TTL expired", recorded_exit=1).job_state is JobState.FAILED


def test_a_status_names_its_newest_condition_and_a_pending_delete() -> None:
    running = {
        "type": "Running",
        "status": "True",
        "reason": "Started",
        "lastTransitionTime": "2025-01-02T00:00:00Z",
    }
    created = {"type": "Created", "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    obj = {
        "metadata": {"name": "n", "namespace": "ml", "uid": "u", "deletionTimestamp": "2025-01-03T00:00:00Z"},
        "status": {"conditions": [running, created]},
    }
    status = ObjectStatus.from_object(CRDS["kubeflow"], obj)
    assert status.ref == ObjectRef(CRDS["kubeflow"], "ml", "n", "u")
    assert status.describe() == "PyTorchJob ml/n RUNNING (being deleted), last condition Running (Started)"
