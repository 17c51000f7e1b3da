"""The launcher contract against ``HyperPodEksLauncher`` through the real ``kubernetes`` client and a
STAND-IN Kubernetes API (``standins.kube_api``: real HTTP, real REST paths, a tiny operator that runs
each pod's command as local torchrun processes; no API server can run here), for both CRDs, plus
EKS-only tests: the object in the cluster is the rendered manifest, one LIST serves every handle,
refusing a running job dir, attach after a resubmission, a deleted object, the API's errors, exactly
once through the real client (a lost create reply, a crash between create and record, an earlier
attempt's object under the same name), secrets that never enter the object, 2-node jobs
(HyperPod, Kubeflow, Kubeflow elastic) that form one gloo process group across their pods or fail as
a whole when one node fails, and HyperPod's own hang detection (a log rule from the spec's
``hang_detection`` that restarts a silent job in place, or fails it with no retry left).

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
import yaml
from launcher_contract import JOBS, LauncherContract, finish, fixture_job, is_alive, recorded_pids, wait_until
from standins.kube_api import KubeApiStandIn, pids_of
from tiny_study import QUADRATIC, as_submitted, preview_first_trial

from tunepod import runtime
from tunepod.errors import JobError, TransientError, TunepodError
from tunepod.launch.base import (
    SUBMISSION_ID_ENV,
    Accepted,
    Job,
    JobHandle,
    JobSpec,
    JobState,
    Launcher,
    Resources,
)
from tunepod.launch.drive import DriveSettings, JobDriver, Outcome
from tunepod.launch.hyperpod_eks import (
    CRDS,
    HYPERPOD_PLURAL,
    MANIFEST_NAME,
    SUBMISSION_ANNOTATION,
    HyperPodEksLauncher,
    ObjectRef,
    parse_job_id,
    render_manifest,
)
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import new_submission_id, read_submission, write_submission
from tunepod.launch.watchdog import Limits
from tunepod.runtime.progress import HEARTBEAT_S_ENV, PROGRESS_LOG_S_ENV
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


def restarted(launcher: HyperPodEksLauncher) -> HyperPodEksLauncher:
    """A new launcher for the same cluster: an orchestrator that restarted and lost every handle."""
    return HyperPodEksLauncher(launcher.spec, cancel_timeout_s=launcher.cancel_timeout_s)


def object_ids(launcher: HyperPodEksLauncher, name: str) -> list[str]:
    """The job ids of every object named ``name`` in the launcher's namespace, of either CRD (whoever
    made it: a GET by name, not the LIST of tunepod's objects)."""
    found = ((crd, launcher.api.get_object(crd, launcher.spec.namespace, name)) for crd in CRDS.values())
    return [ObjectRef.of(crd, obj).job_id for crd, obj in found if obj is not None]


def stored_object(launcher: HyperPodEksLauncher, handle: JobHandle) -> dict[str, Any]:
    """The object of ``handle`` as the API serves it (as kubectl get -o yaml shows it)."""
    assert isinstance(handle, Job)
    ref = launcher.object_ref(handle)
    stored = launcher.api.get_object(ref.crd, ref.namespace, ref.name)
    assert stored is not None
    return stored


def died(job: JobSpec, rendered: object, intent: object) -> Accepted:
    raise KeyboardInterrupt("orchestrator killed before sending")


class TestHyperPodEksContract(LauncherContract):
    @pytest.fixture(params=["hyperpod", "kubeflow"])
    def launcher(self, request: pytest.FixtureRequest, kube: KubeApiStandIn, tmp_path: Path) -> Launcher:
        self.kube = kube
        return eks_launcher(kube, tmp_path, crd=request.param)

    def restart(self, launcher: Launcher) -> Launcher:
        assert isinstance(launcher, HyperPodEksLauncher)
        return restarted(launcher)

    def kill_hard(self, handle: JobHandle) -> None:
        namespace, name, _ = parse_job_id(handle.job_id)
        self.kube.crash(namespace, name)

    def jobs_named(self, launcher: Launcher, name: str) -> list[str]:
        assert isinstance(launcher, HyperPodEksLauncher)
        return object_ids(launcher, name)

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
    record = read_submission(job.paths)
    assert record is not None
    # The job as the launcher rendered it: carrying its attempt's submission id.
    rendered = render_manifest(job.with_env({SUBMISSION_ID_ENV: record.submission_id}), launcher.spec)

    # Read back through the real client, as kubectl would.
    stored = stored_object(launcher, handle)
    uid = stored["metadata"]["uid"]
    stored.pop("status", None)
    for field in SERVER_FIELDS:
        stored["metadata"].pop(field)
    assert stored == rendered
    assert rendered["metadata"]["annotations"][SUBMISSION_ANNOTATION] == record.submission_id
    assert json.loads((job.job_dir / MANIFEST_NAME).read_text()) == rendered
    name = rendered["metadata"]["name"]
    assert record.job_id == handle.job_id == f"default/{name}/{uid}"
    assert (record.details["kind"], record.name, record.attempt) == ("HyperPodPyTorchJob", name, 1)
    release.touch()
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    assert handle.describe().startswith(f"HyperPodPyTorchJob default/{name} SUCCEEDED")
    assert "exit code 0" in handle.describe()


def test_one_list_call_serves_every_handle(
    kube: KubeApiStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tunepod.launch.base")
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
    with pytest.raises(
        JobError, match=r"has not ended; delete it \(kubectl -n default delete hyperpodpytorchjobs"
    ):
        launcher.submit(eks_job(job_dir, "succeed.py"))
    wait_until(lambda: (pid_dir / "rank-0.json").exists(), "the rank to start")
    first.cancel()
    assert first.state() is JobState.CANCELLED

    second = launcher.submit(eks_job(job_dir, "succeed.py"))
    assert launcher.object_ref(second).name == launcher.object_ref(first).name
    assert second.job_id != first.job_id
    assert not job_dir.joinpath("cancelled").exists()
    assert finish(second) is JobState.SUCCEEDED, second.logs()
    assert json.loads((job_dir / "submission.json").read_text())["attempt"] == 2
    with pytest.raises(JobError, match=f"names job {second.job_id}"):
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
    launcher.api.delete_object(launcher.object_ref(handle))  # what `kubectl delete` does
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


def test_an_unrecorded_live_object_of_the_job_dir_is_refused(kube: KubeApiStandIn, tmp_path: Path) -> None:
    launcher = eks_launcher(kube, tmp_path)
    job = eks_job(tmp_path / "job", "succeed.py", str(tmp_path / "release"))
    handle = launcher.submit(job)
    job.paths.submission.unlink()  # the record is lost; the object under the name still runs
    with pytest.raises(JobError, match=r"has not ended .*not in its submission record; stop it \(kubectl"):
        launcher.submit(job)
    assert object_ids(launcher, launcher.object_ref(handle).name) == [handle.job_id]
    handle.cancel()


def test_an_object_missing_from_the_list_is_looked_up_by_name(
    kube: KubeApiStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = eks_launcher(kube, tmp_path, poll_cache_s=0)
    handle = launcher.submit(eks_job(tmp_path / "job", "succeed.py", str(tmp_path / "release")))
    # A LIST served from a cache that predates the create does not hold the new object.
    monkeypatch.setattr(launcher.api, "list_objects", lambda crd, namespace: [])
    gets = kube.calls[f"get {HYPERPOD_PLURAL}"]
    assert handle.state() in (JobState.PENDING, JobState.RUNNING)
    assert kube.calls[f"get {HYPERPOD_PLURAL}"] == gets + 1
    monkeypatch.undo()
    handle.cancel()


# ------------------------------------------------------------------------------------- TTL


def exit_records(job_dir: Path) -> list[str]:
    """What each pod recorded of its command's end in ``job_dir`` (one record per pod)."""
    return [path.read_text() for path in sorted(job_dir.glob("exit_code.*"))]


def deleted_by_ttl(launcher: HyperPodEksLauncher, handle: Job[Any]) -> None:
    """Wait, without asking the handle anything (as if no orchestrator ran), until the job's
    ``ttlSecondsAfterFinished`` has deleted its object."""
    name = launcher.object_ref(handle).name
    wait_until(lambda: not object_ids(launcher, name), "ttlSecondsAfterFinished to delete the object")


@pytest.mark.parametrize("crd", ["hyperpod", "kubeflow"])
def test_a_job_that_exited_0_unwatched_and_was_deleted_by_its_ttl_succeeded(
    kube: KubeApiStandIn, tmp_path: Path, crd: str
) -> None:
    """The job exits 0 without a result file (the contract allows it) while no orchestrator watches,
    and its TTL deletes the object: the orchestrator that comes back finds no object (404) and reads
    SUCCEEDED from the exit codes the pods recorded in the job dir, not FAILED (which would restart a
    finished trial, or fail it)."""
    launcher = eks_launcher(kube, tmp_path, crd=crd, ttl_after_finished_s=1)
    out = tmp_path / "args.json"
    job = eks_job(tmp_path / "job", "echo_args.py", str(out))
    handle = launcher.submit(job)
    deleted_by_ttl(launcher, handle)
    assert out.exists() and not job.paths.result.exists()

    found = restarted(launcher).recorded(job.job_dir)
    assert found is not None and found.job_id == handle.job_id
    assert found.state() is JobState.SUCCEEDED
    assert "ttlSecondsAfterFinished expired" in found.describe()
    assert "its pods recorded exit code 0" in found.describe()


def test_an_intent_whose_object_ran_and_was_deleted_by_its_ttl_is_that_job_never_a_new_one(
    kube: KubeApiStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The orchestrator died between the create and the record (only the intent is in the job dir),
    and the job exited 0 and its TTL deleted the object before an orchestrator came back: no object
    answers the intent's name, but its pods' exit records do. The intent resolves to that ended job,
    SUCCEEDED; it is never sent again (which would train a finished trial a second time)."""
    caplog.set_level(logging.WARNING, logger="tunepod.launch.base")
    launcher = eks_launcher(kube, tmp_path, ttl_after_finished_s=1)
    job = eks_job(tmp_path / "job", "echo_args.py", str(tmp_path / "args.json"))
    handle = launcher.submit(job)
    record = read_submission(job.paths)
    assert record is not None
    write_submission(job.paths, record.model_copy(update={"job_id": None, "submitted_at": None}))
    deleted_by_ttl(launcher, handle)

    found = restarted(launcher).recorded(job.job_dir)
    assert found is not None, "the intent was taken for a job that never existed: it would be sent again"
    assert found.state() is JobState.SUCCEEDED
    assert "its pods recorded exit code 0" in found.describe()
    assert "of an unrecorded submission" in caplog.text
    completed = read_submission(job.paths)
    assert completed is not None
    assert (completed.job_id, completed.submission_id) == (found.job_id, record.submission_id)
    assert kube.calls[f"create {HYPERPOD_PLURAL}"] == 1


def test_a_failed_job_deleted_by_its_ttl_is_failed_with_its_code_and_the_next_attempt_starts_clean(
    kube: KubeApiStandIn, tmp_path: Path
) -> None:
    launcher = eks_launcher(kube, tmp_path, ttl_after_finished_s=1)
    job_dir = tmp_path / "job"
    first = launcher.submit(eks_job(job_dir, "fail.py", "attempt 1 failed"))
    deleted_by_ttl(launcher, first)
    assert finish(first) is JobState.FAILED
    assert "its pods recorded exit code 1" in first.describe()
    record = read_submission(JobPaths(job_dir))
    assert record is not None
    assert exit_records(job_dir) == [f"1 {record.submission_id}\n"]  # one pod, one record

    release = tmp_path / "release"
    second = launcher.submit(eks_job(job_dir, "succeed.py", str(release)))
    assert exit_records(job_dir) == []  # attempt 1's records went with its attempt
    release.touch()
    assert finish(second) is JobState.SUCCEEDED, second.logs()
    record = read_submission(JobPaths(job_dir))
    assert record is not None
    assert exit_records(job_dir) == [f"0 {record.submission_id}\n"]


def test_a_deleted_jobs_pods_record_how_the_stop_ended_its_command(
    kube: KubeApiStandIn, tmp_path: Path
) -> None:
    """The recording shell outlives a delete's SIGTERM, waits for the command it passed it on to, and
    records that command's status (torchrun's, nonzero), never a success."""
    launcher = eks_launcher(kube, tmp_path)
    pid_dir = tmp_path / "pids"
    job = eks_job(tmp_path / "job", "hang.py", str(pid_dir))
    handle = launcher.submit(job)
    wait_until(lambda: (pid_dir / "rank-0.json").exists(), "the rank to start")
    handle.cancel()
    assert handle.state() is JobState.CANCELLED
    submission = read_submission(job.paths)
    assert submission is not None
    [record] = exit_records(job.job_dir)
    code, submission_id = record.split()
    assert (int(code) != 0, submission_id) == (True, submission.submission_id)


# ------------------------------------------------------------------------------------- exactly once


def test_a_create_whose_reply_was_lost_adopts_the_object(
    kube: KubeApiStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The API server creates the object, then the connection drops before the reply (the real client
    sees urllib3's ProtocolError, and urllib3 never retries a POST): submit finds the object by its
    name and submission annotation and adopts it, with one create in all."""
    caplog.set_level(logging.WARNING, logger="tunepod.launch.base")
    launcher = eks_launcher(kube, tmp_path)
    kube.lose_replies(f"create {HYPERPOD_PLURAL}")
    release = tmp_path / "release"
    job = eks_job(tmp_path / "job", "succeed.py", str(release))
    handle = launcher.submit(job)
    assert f"sending failed, but job {handle.job_id} exists; adopted it" in caplog.text
    record = read_submission(job.paths)
    assert record is not None and record.job_id == handle.job_id
    assert kube.calls[f"create {HYPERPOD_PLURAL}"] == 1
    assert object_ids(launcher, record.name) == [handle.job_id]
    assert stored_object(launcher, handle)["metadata"]["annotations"][SUBMISSION_ANNOTATION] == (
        record.submission_id
    )
    release.touch()
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()


def test_a_retried_create_adopts_its_own_object_and_never_touches_anothers(
    kube: KubeApiStandIn, tmp_path: Path
) -> None:
    """A create sent again for the same attempt (its first reply was lost, and the look-up ran before
    the object showed) meets 409 on the attempt's own object: adopted. A 409 on any other object is
    an error naming it, and that object stays."""
    launcher = eks_launcher(kube, tmp_path)
    job = eks_job(tmp_path / "job", "succeed.py", str(tmp_path / "release"))
    handle = launcher.submit(job)
    record = read_submission(job.paths)
    assert record is not None
    intent = record.model_copy(update={"job_id": None, "submitted_at": None})
    ours = launcher.render(job.with_env({SUBMISSION_ID_ENV: intent.submission_id}), intent.attempt)
    assert launcher.send(job, ours, intent) == Accepted(handle.job_id)

    other_id = new_submission_id()
    other = intent.model_copy(update={"submission_id": other_id})
    theirs = launcher.render(job.with_env({SUBMISSION_ID_ENV: other_id}), intent.attempt)
    with pytest.raises(
        JobError,
        match=rf"by submission {intent.submission_id} of job dir .*never deletes what is not its own.*"
        r"kubectl -n default delete hyperpodpytorchjobs",
    ):
        launcher.send(job, theirs, other)
    assert object_ids(launcher, record.name) == [handle.job_id]
    assert kube.calls[f"create {HYPERPOD_PLURAL}"] == 3
    handle.cancel()


def test_crash_between_create_and_record_is_resolved_by_name_and_annotation(
    kube: KubeApiStandIn, tmp_path: Path
) -> None:
    """Only the intent reached the job dir: ``recorded`` finds the object under the intent's name
    whose annotation holds the intent's submission id, completes the record, and creates nothing."""
    launcher = eks_launcher(kube, tmp_path)
    release = tmp_path / "release"
    job = eks_job(tmp_path / "job", "succeed.py", str(release))
    submitted = launcher.submit(job)
    record = read_submission(job.paths)
    assert record is not None
    intent = record.model_copy(update={"job_id": None, "submitted_at": None})

    # The object under the name is not the job of an intent with another submission id.
    write_submission(job.paths, intent.model_copy(update={"submission_id": new_submission_id()}))
    assert restarted(launcher).recorded(job.job_dir) is None

    write_submission(job.paths, intent)
    found = restarted(launcher).recorded(job.job_dir)
    assert found is not None and found.job_id == submitted.job_id
    completed = read_submission(job.paths)
    assert completed is not None and completed.job_id == submitted.job_id
    expected = {"kind": "HyperPodPyTorchJob", "namespace": "default", "pods": 1}
    assert completed.details == record.details == expected
    assert kube.calls[f"create {HYPERPOD_PLURAL}"] == 1
    release.touch()
    assert finish(found) is JobState.SUCCEEDED, found.logs()


def test_an_ended_object_of_an_earlier_attempt_under_the_same_name_is_replaced_not_adopted(
    kube: KubeApiStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 1 failed and its object stays (until its TTL); attempt 2's intent was recorded, then
    the orchestrator died before the create. Attempt 1's object holds the name attempt 2 needs, but
    not attempt 2's submission id: it is deleted and replaced, never taken for attempt 2's job."""
    launcher = eks_launcher(kube, tmp_path)
    job_dir = tmp_path / "job"
    first = launcher.submit(eks_job(job_dir, "fail.py", "attempt 1 failed"))
    assert finish(first) is JobState.FAILED
    job = eks_job(job_dir, "succeed.py")
    with monkeypatch.context() as patch:
        patch.setattr(launcher, "send", died)
        with pytest.raises(KeyboardInterrupt):
            launcher.submit(job)
    intent = read_submission(job.paths)
    assert intent is not None and intent.is_intent and intent.attempt == 2

    resumed = restarted(launcher)
    assert resumed.recorded(job_dir) is None
    second = resumed.submit(job)
    assert second.job_id != first.job_id
    assert resumed.object_ref(second).name == resumed.object_ref(first).name == intent.name
    record = read_submission(job.paths)
    assert record is not None
    assert (record.job_id, record.attempt, record.submission_id) == (second.job_id, 2, intent.submission_id)
    assert object_ids(resumed, intent.name) == [second.job_id]
    assert stored_object(resumed, second)["metadata"]["annotations"][SUBMISSION_ANNOTATION] == (
        intent.submission_id
    )
    assert finish(second) is JobState.SUCCEEDED, second.logs()
    assert first.state() is JobState.FAILED  # the old handle keeps its outcome
    with pytest.raises(JobError, match=f"names job {second.job_id}"):
        resumed.attach(first.job_id, job_dir)  # the job dir now names attempt 2


# ------------------------------------------------------------------------------------- secrets


ENV_TO_FILE = """import os, sys
from pathlib import Path

if os.environ.get("RANK", "0") == "0":
    Path(sys.argv[1]).write_text(os.environ.get(sys.argv[2], "<unset>"))
"""


def test_secret_env_values_never_appear_in_the_created_object(kube: KubeApiStandIn, tmp_path: Path) -> None:
    """The tracking URI (with its password) reaches the pods from the Secret; the object, which anyone
    who may list job objects can read, and manifest.json hold only the reference, even though the
    job's own environment set the variable too."""
    secret_uri = "https://tunepod:s3cr3t@mlflow.example.com"
    kube.add_secret("default", "mlflow", {"tracking-uri": secret_uri})
    secret_env = {"MLFLOW_TRACKING_URI": {"secret": "mlflow", "key": "tracking-uri"}}
    launcher = eks_launcher(kube, tmp_path, secret_env=secret_env)
    out = tmp_path / "seen-by-the-job"
    base = eks_job(tmp_path / "job", "echo_args.py")
    script = base.entrypoint.with_name("env_to_file.py")
    script.write_text(ENV_TO_FILE)
    job = dataclasses.replace(
        base.with_env({"MLFLOW_TRACKING_URI": "https://tunepod:old-password@mlflow.example.com"}),
        entrypoint=script,
        args=(str(out), "MLFLOW_TRACKING_URI"),
    )
    handle = launcher.submit(job)
    stored = stored_object(launcher, handle)
    manifest = json.loads((job.job_dir / MANIFEST_NAME).read_text())
    reference = {
        "name": "MLFLOW_TRACKING_URI",
        "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "tracking-uri"}},
    }
    for obj in (stored, manifest):
        assert "s3cr3t" not in json.dumps(obj) and "old-password" not in json.dumps(obj)
        env = obj["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["env"]
        assert [entry for entry in env if entry["name"] == "MLFLOW_TRACKING_URI"] == [reference]
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    assert out.read_text() == secret_uri


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
    pods = sorted(pod["metadata"]["name"] for pod in launcher.api.list_pods(launcher.object_ref(handle)))
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


def test_render_is_the_object_the_api_server_stored(kube: KubeApiStandIn, tmp_path: Path) -> None:
    """``tunepod render``'s manifest for a trial is the object the API server keeps (but for the fields
    the server sets, and the submission id, drawn anew by each submit), and it is shown as that YAML."""
    code = tmp_path / "shared" / "code"
    shutil.copytree(QUADRATIC.parent, code)
    block = {
        "kind": "hyperpod_eks",
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/tunepod-train:latest",
        "claim_name": "fsx-claim",
        "python": sys.executable,
        "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "poll_cache_s": 0.2,
    }
    preview, launcher = preview_first_trial(
        tmp_path, block, HyperPodEksLauncher, trainer=code / QUADRATIC.name
    )
    assert isinstance(launcher, HyperPodEksLauncher)
    handle = launcher.submit(preview.job)
    try:
        stored = stored_object(launcher, handle)
    finally:
        handle.cancel()
    stored.pop("status", None)
    for field in SERVER_FIELDS:
        stored["metadata"].pop(field)
    record = read_submission(preview.job.paths)
    assert record is not None
    shown = json.loads(as_submitted(json.dumps(preview.rendered.payload), preview, record.submission_id))
    assert stored == shown
    assert yaml.safe_load(preview.text()) == preview.rendered.payload


# ------------------------------------------------------------------------------------- HyperPod's hang rule


def log_rule_driver(launcher: HyperPodEksLauncher, job: JobSpec, what: str) -> JobDriver:
    """tunepod's driver with no hang detection of its own and no restart of its own: whatever restarts
    the job is the operator's log rule. A run-time limit ends the test if nothing does."""
    job = dataclasses.replace(job, limits=Limits(timeout_s=30.0))
    return JobDriver(launcher, job, DriveSettings(poll_s=0.2, max_restarts=0), what=what)


def condition_types(stored: dict[str, Any]) -> list[str]:
    return [condition["type"] for condition in stored["status"]["conditions"]]


def test_a_job_silent_past_its_log_rule_is_restarted_in_place_by_the_operator_and_resumes(
    kube: KubeApiStandIn, tmp_path: Path
) -> None:
    """A job prints the runtime's progress lines while it advances, checkpoints step 1, then hangs
    (alive, silent). The spec's ``hang_detection`` rule (a progress line at least every 2 s) fires;
    with a retry left (``max_retries: 1``, ``jobMaxRetryCount``) the operator restarts the pods in
    place, and the restarted run resumes from the checkpoint and finishes. tunepod restarted nothing:
    one attempt, the same object."""
    rule = {"name": "steps-advance", "log_pattern": ".*tunepod progress:.*", "recur_within_s": 2}
    launcher = eks_launcher(kube, tmp_path, max_retries=1, hang_detection=[rule])
    job = eks_job(tmp_path / "job", "count.py", "4", "1").with_env(
        {PROGRESS_LOG_S_ENV: "0.5", HEARTBEAT_S_ENV: "0.25"}
    )
    driven = log_rule_driver(launcher, job, "the hung job").run()
    assert driven.outcome is Outcome.COMPLETED, driven.message
    assert driven.result is not None and driven.result.metrics == {"resumed_from": 2, "count": 4}
    assert [report.step for report in runtime.read_reports(job.paths.metrics)] == [0, 1, 2, 3]
    record = read_submission(job.paths)
    assert record is not None and record.attempt == 1
    handle = driven.handle
    assert handle is not None and handle.job_id == record.job_id
    assert handle.describe().startswith(f"HyperPodPyTorchJob default/{record.name} SUCCEEDED")

    # The restart as the operator shows it: on the job, and on its pod's container.
    stored = stored_object(launcher, handle)
    assert stored["spec"]["runPolicy"]["logMonitoringConfiguration"] == [
        {
            "name": "steps-advance",
            "logPattern": ".*tunepod progress:.*",
            "expectedRecurringFrequencyInSeconds": 2,
        }
    ]
    assert stored["status"]["restartCount"] == 1
    assert condition_types(stored) == ["Created", "PodsRunning", "Restarting", "PodsRunning", "Completed"]
    [restarting] = [c for c in stored["status"]["conditions"] if c["type"] == "Restarting"]
    assert restarting["reason"] == "HangDetected"
    assert "log monitoring rule 'steps-advance'" in restarting["message"]
    assert "for 2s" in restarting["message"]
    [pod] = launcher.api.list_pods(launcher.object_ref(handle))
    [container] = pod["status"]["containerStatuses"]
    assert container["restartCount"] == 1
    assert container["state"]["terminated"]["exitCode"] == 0
    assert container["lastState"]["terminated"]["exitCode"] != 0  # stopped by the operator

    # The stopped run's log, as `kubectl logs --previous` reads it: its last progress line told of
    # step 1, the checkpoint the run after it resumed from.
    previous = launcher.api.core.read_namespaced_pod_log(
        pod["metadata"]["name"], "default", previous=True, _preload_content=False
    )
    progress = [line for line in previous.data.decode().splitlines() if "tunepod progress:" in line]
    assert progress and progress[-1].endswith("tunepod progress: rank 0 step 1"), progress


def test_a_job_whose_log_rule_fires_with_no_retry_left_fails_naming_the_rule(
    kube: KubeApiStandIn, tmp_path: Path
) -> None:
    """A job that never prints the line a start rule waits for: the operator restarts it once
    (``max_retries: 1``), the rule fires again, and with no retry left the job fails. The launcher's
    description of the failure, and so tunepod's failure message, names the rule."""
    rule = {"name": "first-batch", "log_pattern": "^first batch done$", "start_within_s": 2}
    launcher = eks_launcher(kube, tmp_path, max_retries=1, hang_detection=[rule])
    job = eks_job(tmp_path / "job", "hang.py", str(tmp_path / "pids"))
    driven = log_rule_driver(launcher, job, "the silent job").run()
    assert driven.outcome is Outcome.FAILED, driven.message
    handle = driven.handle
    assert handle is not None
    described = handle.describe()
    assert "FAILED, last condition Failed (HangDetected: " in described, described
    assert "log monitoring rule 'first-batch' found the job hanging" in described
    assert "matched '^first batch done$' within 2s of its start" in described
    assert described in driven.message

    stored = stored_object(launcher, handle)
    assert stored["status"]["restartCount"] == 1  # the one retry was used
    assert condition_types(stored) == ["Created", "PodsRunning", "Restarting", "PodsRunning", "Failed"]
    [pod] = launcher.api.list_pods(launcher.object_ref(handle))
    [container] = pod["status"]["containerStatuses"]
    assert container["restartCount"] == 1
    assert container["state"]["terminated"]["exitCode"] != 0
    assert pids_of(pod["metadata"]["uid"]) == []  # no process of the pod's container is left
    record = read_submission(job.paths)
    assert record is not None and record.attempt == 1
