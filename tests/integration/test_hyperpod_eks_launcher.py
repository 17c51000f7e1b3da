"""The launcher contract against ``HyperPodEksLauncher`` through the real ``kubernetes`` client and a
STAND-IN Kubernetes API (``standins.kube_api``: real HTTP, real REST paths, a tiny operator that runs
each pod's command as local torchrun processes; no API server can run here), for both CRDs, plus
EKS-only tests: the object in the cluster is the rendered manifest, one LIST serves every handle,
refusing a running job dir, attach after a resubmission, a deleted object, the API's errors, and
2-node jobs (HyperPod, Kubeflow, Kubeflow elastic) that form one gloo process group across their pods
or fail as a whole when one node fails.

``tmp_path`` is the shared root: the stand-in's pods see the claim's mount path as the same local path.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from launcher_contract import JOBS, LauncherContract, finish, fixture_job, is_alive, recorded_pids, wait_until
from standins.kube_api import KubeApiStandIn

from tunepod import runtime
from tunepod.errors import JobError, TransientError, TunepodError
from tunepod.launch.base import JobHandle, JobSpec, JobState, Launcher, Resources
from tunepod.launch.hyperpod_eks import HYPERPOD_PLURAL, render_manifest
from tunepod.launch.kube import MANIFEST_NAME, HyperPodEksLauncher, KubeJob
from tunepod.spec.models import HyperPodEksLauncherSpec

pytestmark = pytest.mark.timeout(120)

# Metadata the API server adds to a created object; everything else must be the rendered manifest.
SERVER_FIELDS = ("uid", "creationTimestamp", "generation", "resourceVersion")


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeApiStandIn]:
    with KubeApiStandIn(tmp_path / "kube-state", grace_s=3.0) as standin:
        yield standin


def eks_spec(root: Path, kubeconfig: Path | None, **fields: Any) -> HyperPodEksLauncherSpec:
    values = {
        "kind": "hyperpod_eks",
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/tunepod-train:latest",
        "root": str(root),
        "claim_name": "fsx-claim",
        "python": sys.executable,
        "kubeconfig": None if kubeconfig is None else str(kubeconfig),
        "poll_cache_s": 0.2,
        **fields,
    }
    return HyperPodEksLauncherSpec.model_validate(values)


def eks_job(job_dir: Path, script: str, *args: str, **fields: Any) -> JobSpec:
    """A fixture job with its code beside the job dir, under root: on a cluster the pods see only the
    claim (and the image), so the scripts live on FSx like a user's checkout."""
    code = job_dir.parent / "code"
    shutil.copytree(JOBS, code, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return dataclasses.replace(fixture_job(job_dir, script, *args, **fields), entrypoint=code / script)


def eks_launcher(kube: KubeApiStandIn, tmp_path: Path, **fields: Any) -> HyperPodEksLauncher:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    return HyperPodEksLauncher(eks_spec(tmp_path, kubeconfig, **fields), cancel_timeout_s=30)


class TestHyperPodEksContract(LauncherContract):
    @pytest.fixture(params=["hyperpod", "kubeflow"])
    def launcher(self, request: pytest.FixtureRequest, kube: KubeApiStandIn, tmp_path: Path) -> Launcher:
        self.kube = kube
        return eks_launcher(kube, tmp_path, crd=request.param)

    def restart(self, launcher: Launcher) -> Launcher:
        assert isinstance(launcher, HyperPodEksLauncher)
        return HyperPodEksLauncher(launcher.spec)

    def kill_hard(self, handle: JobHandle) -> None:
        assert isinstance(handle, KubeJob)
        self.kube.crash(handle.ref.namespace, handle.ref.name)

    def make_job(self, job_dir: Path, script: str, *args: str, procs: int = 1) -> JobSpec:
        return eks_job(job_dir, script, *args, procs=procs)


def test_launcher_implements_the_protocol(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    assert isinstance(launcher, Launcher)
    assert launcher.kind == "hyperpod_eks"


def test_the_object_in_the_cluster_is_the_rendered_manifest(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    release = tmp_path / "release"
    job = eks_job(tmp_path / "jobs" / "trial-1", "succeed.py", str(release))
    handle = launcher.submit(job)
    rendered = render_manifest(job, launcher.spec)

    # Read back through the real client, as kubectl would.
    stored = launcher.api.get_object(handle.ref.crd, "default", handle.ref.name)
    assert stored is not None
    stored.pop("status", None)
    for field in SERVER_FIELDS:
        stored["metadata"].pop(field)
    assert stored == rendered
    assert json.loads((job.job_dir / MANIFEST_NAME).read_text()) == rendered
    record = json.loads(job.paths.submission.read_text())
    assert record["job_id"] == handle.job_id == f"default/{rendered['metadata']['name']}/{handle.ref.uid}"
    assert (record["kind"], record["object"], record["attempt"]) == ("HyperPodPyTorchJob", handle.ref.name, 1)
    release.touch()
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    assert handle.describe().startswith(f"HyperPodPyTorchJob default/{handle.ref.name} SUCCEEDED")
    assert "exit code 0" in handle.describe()


def test_one_list_call_serves_every_handle(
    kube: KubeApiStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tunepod.launch.kube")
    # elastic applies to Kubeflow only: the launcher warns about it once, not once per job.
    launcher = eks_launcher(kube, tmp_path, poll_cache_s=3600, elastic=True)
    release = tmp_path / "release"
    jobs = [eks_job(tmp_path / f"job{i}", "succeed.py", str(release)) for i in range(3)]
    handles = [launcher.submit(job) for job in jobs]
    handles.append(launcher.attach(handles[0].job_id, jobs[0].job_dir))
    calls_before = kube.calls.copy()
    states: list[JobState] = []

    def poll() -> None:
        states.extend(handle.state() for handle in handles for _ in range(3))

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert kube.calls - calls_before == {f"list {HYPERPOD_PLURAL}": 1}
    assert len(states) == 4 * 4 * 3
    assert set(states) <= {JobState.PENDING, JobState.RUNNING}
    assert sum("elastic=true ignored" in record.getMessage() for record in caplog.records) == 1
    release.touch()
    for handle in handles:
        handle.cancel()  # cancel looks past the long cache period; whatever ran stops or ends well
        assert handle.state() in (JobState.CANCELLED, JobState.SUCCEEDED)


def test_running_job_dir_is_refused_and_a_resubmission_replaces_the_ended_object(
    kube: KubeApiStandIn, tmp_path: Path
) -> None:
    launcher = eks_launcher(kube, tmp_path)
    job_dir = tmp_path / "job"
    pid_dir = tmp_path / "pids"
    first = launcher.submit(eks_job(job_dir, "hang.py", str(pid_dir)))
    with pytest.raises(JobError, match=r"has not ended .*kubectl -n default delete hyperpodpytorchjobs"):
        launcher.submit(eks_job(job_dir, "succeed.py"))
    wait_until(lambda: (pid_dir / "rank-0.json").exists(), "the rank to start")
    first.cancel()
    assert first.state() is JobState.CANCELLED

    second = launcher.submit(eks_job(job_dir, "succeed.py"))
    assert second.ref.name == first.ref.name and second.job_id != first.job_id
    assert not job_dir.joinpath("cancelled").exists()
    assert finish(second) is JobState.SUCCEEDED, second.logs()
    assert json.loads((job_dir / "submission.json").read_text())["attempt"] == 2
    with pytest.raises(JobError, match=f"names {second.job_id}"):
        launcher.attach(first.job_id, job_dir)
    assert first.state() is JobState.CANCELLED  # the old handle keeps its outcome


def test_object_deleted_outside_tunepod_is_failed_and_says_so(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    pid_dir = tmp_path / "pids"
    handle = launcher.submit(eks_job(tmp_path / "job", "hang.py", str(pid_dir)))
    wait_until(lambda: (pid_dir / "rank-0.json").exists(), "the rank to start")
    assert handle.state() is JobState.RUNNING
    # A LIST that fails transiently serves the last known state, until that is too old.
    kube.refuse_with(503, "ServiceUnavailable", "etcd is busy")
    launcher.cache.max_age_s = 0  # every state() lists again
    assert handle.state() is JobState.RUNNING
    launcher.cache.stale_limit_s = 0
    with pytest.raises(TransientError, match=r"HTTP 503.*etcd is busy"):
        handle.state()
    kube.refuse_with(0, "", "")
    launcher.api.delete_object(handle.ref)  # what `kubectl delete` does
    assert finish(handle) is JobState.FAILED
    assert "deleted outside tunepod" in handle.describe()
    assert "no pods" in handle.logs()


def test_an_object_of_another_job_dir_is_never_replaced(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    # Two job dirs whose jobs share a name share an object name.
    first = eks_job(tmp_path / "study-a" / "trial-0", "fail.py")
    handle = launcher.submit(first)
    assert finish(handle) is JobState.FAILED
    second = dataclasses.replace(first, job_dir=tmp_path / "study-b" / "trial-0")
    with pytest.raises(
        JobError, match=rf"exists for job dir {re.escape(str(first.job_dir))}.*distinct names"
    ):
        launcher.submit(second)
    assert launcher.attach(handle.job_id, first.job_dir).state() is JobState.FAILED


# ------------------------------------------------------------------------------------- multi-node

MULTI_NODE = [
    pytest.param({"crd": "hyperpod"}, id="hyperpod"),
    pytest.param({"crd": "kubeflow"}, id="kubeflow"),
    pytest.param({"crd": "kubeflow", "elastic": True}, id="kubeflow-elastic"),
]


def two_node_job(job_dir: Path, script: str, *args: str) -> JobSpec:
    """A 2-node job (one process per node) running the fixture ``script``."""
    return eks_job(job_dir, script, *args, resources=Resources(num_nodes=2))


@pytest.mark.parametrize("settings", MULTI_NODE)
def test_a_two_node_job_forms_one_process_group_across_its_pods(
    kube: KubeApiStandIn, tmp_path: Path, settings: dict[str, Any]
) -> None:
    launcher = eks_launcher(kube, tmp_path, **settings)
    job = two_node_job(tmp_path / "job", "all_reduce.py")
    handle = launcher.submit(job)
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    result = runtime.read_result(job.paths.result)
    assert result is not None
    assert result.metrics == {"world_size": 2.0, "rank_sum": 3.0}  # ranks 0 and 1 reduced together
    pods = sorted(pod["metadata"]["name"] for pod in launcher.api.list_pods(handle.ref))
    assert len(pods) == 2
    logs = handle.logs()
    for name in pods:
        assert f"==> pod {name} <==" in logs
    assert "rank 0/2 on node" in logs and "rank 1/2 on node" in logs
    assert handle.describe().count("exit code 0 (Completed)") == 2


@pytest.mark.parametrize("settings", MULTI_NODE)
def test_one_failing_node_fails_the_job_and_the_other_node_is_stopped(
    kube: KubeApiStandIn, tmp_path: Path, settings: dict[str, Any]
) -> None:
    launcher = eks_launcher(kube, tmp_path, **settings)
    pid_dir = tmp_path / "pids"
    handle = launcher.submit(two_node_job(tmp_path / "job", "rank_1_fails.py", str(pid_dir)))
    assert finish(handle) is JobState.FAILED
    # The job fails at the first failed pod; the other pod's end follows.
    wait_until(lambda: handle.describe().count(" exit code ") == 2, "the other pod to be stopped")
    described = handle.describe()
    # torchrun exits 1 when a worker fails; the pod that ran rank 0 was killed (128 + SIGKILL).
    failed = re.search(r"failed: pod (\S+) exited with code 1\b", described)
    assert failed is not None, described
    assert f"pod {failed.group(1)} exit code 1 (Error)" in described
    assert re.search(r"pod (?!" + re.escape(failed.group(1)) + r")\S+ exit code 137", described), described
    assert "rank 1 fails on purpose" in handle.logs()
    assert recorded_pids(pid_dir)
    assert [pid for pid in recorded_pids(pid_dir) if is_alive(pid)] == []


def test_forbidden_is_a_job_error_naming_rbac(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    kube.refuse_with(403, "Forbidden", 'user "standin" cannot create resource "hyperpodpytorchjobs"')
    with pytest.raises(JobError, match=r"HTTP 403.*cannot create resource.*RBAC"):
        launcher.submit(eks_job(tmp_path / "job", "succeed.py"))
    handle = launcher.attach("default/trial-1-0123abcd/0b0c6c2e-uid", tmp_path / "job")
    with pytest.raises(JobError, match="RBAC"):
        handle.state()


def test_a_missing_crd_is_a_job_error_saying_to_install_it(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    kube.refuse_with(404, "NotFound", "the server could not find the requested resource")
    with pytest.raises(
        JobError, match=r"HTTP 404 .* fix: check that the CRD is installed \(kubectl get crd\)"
    ):
        launcher.submit(eks_job(tmp_path / "job", "succeed.py"))


def test_api_down_is_transient(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    kube.stop()  # the API server goes away
    with pytest.raises(TransientError, match="did not answer"):
        launcher.submit(eks_job(tmp_path / "job", "succeed.py"))
    with pytest.raises(TransientError):
        launcher.attach("default/trial-1-0123abcd/0b0c6c2e-uid", tmp_path / "job").state()


def test_missing_kubeconfig_or_context_is_named(kube: KubeApiStandIn, tmp_path: Path) -> None:
    with pytest.raises(TunepodError, match=r"launcher.kubeconfig .*nowhere.* does not exist"):
        HyperPodEksLauncher(eks_spec(tmp_path, tmp_path / "nowhere"))
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    with pytest.raises(TunepodError, match=r"launcher\.context"):
        HyperPodEksLauncher(eks_spec(tmp_path, kubeconfig, context="no-such-context"))


def test_without_kubeconfig_the_launcher_reads_the_kubeconfig_variable(
    kube: KubeApiStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nowhere"))
    spec = eks_spec(tmp_path, None)
    with pytest.raises(TunepodError, match=r"set launcher\.kubeconfig"):
        HyperPodEksLauncher(spec)
    monkeypatch.setenv("KUBECONFIG", str(kube.write_kubeconfig(tmp_path / "kubeconfig")))
    handle = HyperPodEksLauncher(spec).attach("default/trial-1-0123abcd/0b0c6c2e-uid", tmp_path / "job")
    assert handle.state() is JobState.FAILED  # the stand-in answered: no such object
    assert "deleted outside tunepod" in handle.describe()


def test_without_the_kubernetes_package_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(TunepodError, match=r"pip install 'tunepod\[eks\]'"):
        HyperPodEksLauncher(eks_spec(tmp_path, tmp_path / "kubeconfig"))


def test_attach_refuses_what_is_not_a_job_id(kube: KubeApiStandIn, tmp_path: Path) -> None:
    with pytest.raises(JobError, match="namespace/object-name/uid"):
        eks_launcher(kube, tmp_path).attach("local-1-1", tmp_path)
