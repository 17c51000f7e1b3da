"""Submit and follow HyperPod EKS jobs through the Kubernetes API (the launcher of ``kind: hyperpod_eks``).

Render, then execute: ``tunepod.launch.hyperpod_eks.render_manifest`` builds the custom object (a
``HyperPodPyTorchJob``, or a Kubeflow ``PyTorchJob`` with ``crd: kubeflow``); this module creates it
with the official ``kubernetes`` client (``CustomObjectsApi``), reads its ``status.conditions``, finds
its pods by the labels the renderer puts on them (``CoreV1Api``) and deletes it to cancel.

Identity: a job id is ``<namespace>/<object name>/<uid>``. The object name is a function of the job
name only (``object_name``), so ``kubectl get`` finds a trial's object without tunepod; the uid tells
one submission from a later one under the same name.

Resubmission into a used job dir (resume after a crash, a retried trial) deletes the previous object
once it has ended and waits until it is gone, then creates the new one under the SAME name. We chose
this over per-attempt names (``-rN``, as SageMaker needs because its names can never be reused):
Kubernetes frees a name on delete, a stable name is what an operator types into ``kubectl``, the
pods' ``tunepod.io/object`` label stays the rendered one, and the object in the cluster stays exactly
``render_manifest``'s output. What is lost is the ended object's status and pod logs, which the
orchestrator has already read when it decided to resubmit.

State: a launcher follows every job with ONE cache per namespace and CRD, refreshed at most once per
``spec.poll_cache_s`` by a single LIST (label ``app.kubernetes.io/managed-by=tunepod``), so K trials
polling twice a second cost one API call per period, not K. An object missing from a LIST is looked up
once by name before it counts as gone (the LIST may predate its creation). A gone object is CANCELLED
when tunepod's cancel marker is in the job dir, else FAILED: someone deleted it outside tunepod, or its
``ttlSecondsAfterFinished`` expired before anyone read the outcome.

Logs and exit codes come from the job's pods, which the renderer keeps after the job ends
(``cleanPodPolicy: None``) until its TTL or a cancel deletes the job.

The API calls, their error translation and the state cache are in ``kube_client.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from tunepod.errors import JobError, TunepodError
from tunepod.launch.base import JobSpec, JobState
from tunepod.launch.hyperpod_eks import (
    ignored_settings,
    render_manifest,
)
from tunepod.launch.kube_client import (
    CRDS,
    Crd,
    KubeApi,
    KubeStateCache,
    ObjectExists,
    ObjectRef,
    ObjectStatus,
    crd_of_kind,
    kube_api_client,
    parse_job_id,
    wait_until_gone,
)
from tunepod.launch.paths import JobPaths
from tunepod.runtime.files import write_bytes_atomic
from tunepod.spec.models import HyperPodEksLauncherSpec

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
JOB_DIR_ANNOTATION = "tunepod.io/job-dir"  # set by the renderer: which job dir an object belongs to
_T = TypeVar("_T")


# ------------------------------------------------------------------------------------------ jobs


class KubeJob:
    """One submitted job object, followed through its launcher's shared state cache.

    Thread safety: every method may be called from several threads; concurrent ``cancel`` calls are
    serialized and all return once the object and its pods are gone.
    """

    def __init__(
        self, ref: ObjectRef, job_dir: Path, *, api: KubeApi, cache: KubeStateCache, cancel_timeout_s: float
    ) -> None:
        self.ref = ref
        self.job_id = ref.job_id
        self.job_dir = job_dir
        self._api = api
        self._cache = cache
        self._cancel_timeout_s = cancel_timeout_s
        self._paths = JobPaths(job_dir)
        self._cancel_lock = threading.Lock()
        self._outcome: JobState | None = None

    def status(self) -> ObjectStatus | None:
        """The object's status from the launcher's cache; None when it is gone."""
        return self._cache.status(self.ref)

    def state(self) -> JobState:
        """From the conditions; a gone object, or one that failed after tunepod cancelled it, is
        CANCELLED when the job dir holds the cancel marker and FAILED otherwise."""
        if self._outcome is not None:
            return self._outcome
        status = self.status()
        cancelled = self._paths.cancelled.exists()
        if status is None:
            state = JobState.CANCELLED if cancelled else JobState.FAILED
        else:
            state = status.job_state
            state = JobState.CANCELLED if state is JobState.FAILED and cancelled else state
        if state.is_terminal:
            # Kept: a later submission into the job dir removes the cancel marker this read depends on.
            self._outcome = state
        return state

    def cancel(self) -> None:
        """Mark the job cancelled, delete its object (pods first) and wait until both are gone.

        Idempotent; a job that has already ended keeps its outcome. Raises ``JobError`` naming the
        object when it is still there after ``cancel_timeout_s`` (a finalizer or a node that hangs).
        """
        with self._cancel_lock:
            status = self._cache.status(self.ref, max_age_s=0)
            if status is None or status.job_state.is_terminal:
                return
            write_bytes_atomic(self._paths.cancelled, f"cancelled at {_now()}\n".encode())
            self._api.delete_object(self.ref)
            wait_until_gone(self._api, self.ref, self._cancel_timeout_s)
            self._cache.status(self.ref, max_age_s=0)  # so that every handle on it sees it gone

    def logs(self, tail: int = 50) -> str:
        """The last ``tail`` lines of each pod's log, rank 0's pod first; a header names each pod when
        there are several."""
        pods = sorted(self._api.list_pods(self.ref), key=_rank_order)
        if not pods:
            return f"(no pods of {self.ref.title} left to read logs from; see {self.ref.kubectl('describe')})"
        texts = [(pod["metadata"]["name"], self._pod_log(pod, tail)) for pod in pods]
        if len(texts) == 1:
            return texts[0][1]
        return "\n".join(f"==> pod {name} <==\n{text}" for name, text in texts)

    def describe(self) -> str:
        """One line: the object, its last condition, and its pods' exit codes."""
        status = self.status()
        if status is None:
            return f"{self.ref.title} is gone: {self._why_gone()}"
        line = f"{self.ref.title} {status.job_state.value}"
        if status.last_condition():
            line += f", last condition {status.last_condition()}"
        try:
            exits = [
                code for pod in sorted(self._api.list_pods(self.ref), key=_rank_order) if (code := _exit(pod))
            ]
        except TunepodError as exc:
            exits = [f"pods unavailable ({exc})"]
        return f"{line}; {'; '.join(exits)}" if exits else line

    def _why_gone(self) -> str:
        if self._paths.cancelled.exists():
            return "deleted by tunepod's cancel"
        try:
            record = json.loads(self._paths.submission.read_text())
        except (FileNotFoundError, ValueError):
            record = {}
        if isinstance(record, dict) and record.get("uid") not in (None, self.ref.uid):
            return f"replaced by a later submission into {self.job_dir} ({record.get('job_id')})"
        return (
            "deleted outside tunepod, or its ttlSecondsAfterFinished expired before its outcome was read; "
            f"its outcome is lost (the job's own files are in {self.job_dir})"
        )

    def _pod_log(self, pod: Mapping[str, Any], tail: int) -> str:
        containers = (pod.get("spec") or {}).get("containers") or [{}]
        try:
            return self._api.pod_log(
                self.ref.namespace, pod["metadata"]["name"], containers[0].get("name"), tail
            )
        except TunepodError as exc:
            return f"(log unavailable: {exc})"


def _rank_order(pod: Mapping[str, Any]) -> tuple[bool, int, str]:
    """Rank 0's pod first: Kubeflow's master, then replicas by their trailing index."""
    name = str(pod["metadata"]["name"])
    labels = pod["metadata"].get("labels") or {}
    is_master = labels.get("training.kubeflow.org/replica-type", "").lower() == "master" or "-master-" in name
    index = re.search(r"(\d+)$", name)
    return (not is_master, int(index.group(1)) if index else 0, name)


def _exit(pod: Mapping[str, Any]) -> str:
    """``pod NAME exit code N`` for a pod whose container has terminated, else ""."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for container in statuses:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode") is not None:
            reason = f" ({terminated['reason']})" if terminated.get("reason") else ""
            return f"pod {pod['metadata']['name']} exit code {terminated['exitCode']}{reason}"
    return ""


# ------------------------------------------------------------------------------------------ launcher


class HyperPodEksLauncher:
    """Creates one job object per job and follows them with one cache (see the module docstring).

    ``api_client`` is a ``kubernetes.client.ApiClient`` (default: one from ``kube_api_client(spec)``).
    ``spec.root`` must be where this process sees the claim the pods mount at the same path.

    Thread safety: ``submit`` and ``attach`` may be called from several threads for different job
    dirs; two concurrent submissions into the SAME job dir are not supported (the tuner never makes
    them). See ``KubeJob`` and ``KubeStateCache`` for the handles.
    """

    kind = "hyperpod_eks"

    def __init__(
        self, spec: HyperPodEksLauncherSpec, api_client: Any | None = None, *, cancel_timeout_s: float = 300.0
    ) -> None:
        self.spec = spec
        self.api = KubeApi(api_client if api_client is not None else kube_api_client(spec))
        self.cancel_timeout_s = cancel_timeout_s
        self.cache = KubeStateCache(self.api, spec.poll_cache_s)
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()

    def submit(self, job: JobSpec) -> KubeJob:
        """Create the job's object; record ``submission.json`` and ``manifest.json`` in the job dir.

        A job dir whose previous object has not ended is refused (``JobError`` with the kubectl command
        that stops it); an ended one is deleted first, and the new object takes the same name.
        """
        self._warn_ignored()
        manifest = render_manifest(job, self.spec)  # refuses bad input before anything is written
        crd, namespace = CRDS[self.spec.crd], self.spec.namespace
        name = str(manifest["metadata"]["name"])
        paths = job.paths
        paths.job_dir.mkdir(parents=True, exist_ok=True)
        previous = read_submission(paths)
        for candidate in self._previous_refs(previous, crd, namespace, name):
            self._clear(candidate, paths)
        for stale in (paths.submission, paths.cancelled):
            stale.unlink(missing_ok=True)
        write_bytes_atomic(paths.job_dir / MANIFEST_NAME, json.dumps(manifest, indent=2).encode())
        try:
            created = self.api.create_object(crd, namespace, manifest)
        except ObjectExists as exc:
            raise JobError(
                f"{exc}; another submission took the name meanwhile: {_ref_hint(crd, namespace, name)}"
            ) from exc
        ref = ObjectRef(crd, namespace, name, str(created["metadata"]["uid"]))
        self._record(ref, job, paths, attempt=int(previous.get("attempt", 0)) + 1)
        return self._handle(ref, paths.job_dir)

    def attach(self, job_id: str, job_dir: Path) -> KubeJob:
        """A handle on a job submitted earlier, by this process or another (no API call here)."""
        namespace, name, uid = parse_job_id(job_id)
        record = read_submission(JobPaths(job_dir))
        if record.get("uid") not in (None, uid):
            raise JobError(
                f"cannot attach to {job_id}: {JobPaths(job_dir).submission} names {record.get('job_id')} "
                "(the job dir was reused by a later submission); attach to that one instead"
            )
        crd = crd_of_kind(str(record.get("kind", ""))) or CRDS[self.spec.crd]
        return self._handle(ObjectRef(crd, namespace, name, uid), job_dir)

    def _handle(self, ref: ObjectRef, job_dir: Path) -> KubeJob:
        return KubeJob(ref, job_dir, api=self.api, cache=self.cache, cancel_timeout_s=self.cancel_timeout_s)

    def _previous_refs(
        self, previous: Mapping[str, Any], crd: Crd, namespace: str, name: str
    ) -> Iterator[tuple[Crd, str, str]]:
        """The objects that may hold this job dir's previous run: the recorded one (the spec's crd or
        namespace may have changed since), and any object under the name the new one needs (a crash
        between create and record leaves no record)."""
        recorded_crd = crd_of_kind(str(previous.get("kind", "")))
        recorded = (recorded_crd, previous.get("namespace"), previous.get("object"))
        if recorded_crd is not None and all(recorded):
            yield recorded_crd, str(recorded[1]), str(recorded[2])
        if recorded != (crd, namespace, name):
            yield crd, namespace, name

    def _clear(self, candidate: tuple[Crd, str, str], paths: JobPaths) -> None:
        """Refuse when ``candidate`` runs, or belongs to another job dir; else delete it and wait."""
        crd, namespace, name = candidate
        obj = self.api.get_object(crd, namespace, name)
        if obj is None:
            return
        status = ObjectStatus.from_object(obj)
        ref = ObjectRef(crd, namespace, name, status.uid)
        owner = ((obj.get("metadata") or {}).get("annotations") or {}).get(JOB_DIR_ANNOTATION)
        if owner != paths.job_dir.as_posix():
            # Never delete what another job dir (or something other than tunepod) owns.
            raise JobError(
                f"cannot submit into {paths.job_dir}: {ref.title} exists for job dir "
                f"{owner or '<none: not made by tunepod>'}; fix: give the jobs distinct names, or delete "
                f"it ({ref.kubectl('delete')})"
            )
        if not status.deleting and not status.job_state.is_terminal:
            raise JobError(
                f"job dir {paths.job_dir} belongs to {ref.title}, which has not ended "
                f"({status.job_state.value}); stop it ({ref.kubectl('delete')}) or wait for it before "
                "submitting again into the same job dir"
            )
        self.api.delete_object(ref)
        wait_until_gone(self.api, ref, self.cancel_timeout_s)

    def _record(self, ref: ObjectRef, job: JobSpec, paths: JobPaths, *, attempt: int) -> None:
        record = {
            "job_id": ref.job_id,
            "name": job.name,
            "kind": ref.crd.kind,
            "namespace": ref.namespace,
            "object": ref.name,
            "uid": ref.uid,
            "attempt": attempt,
            "submitted_at": _now(),
        }
        try:
            write_bytes_atomic(paths.submission, json.dumps(record, indent=2).encode())
        except BaseException:
            # Without submission.json nobody could attach to this object again: do not leave it running.
            with contextlib.suppress(TunepodError):
                self.api.delete_object(ref)
            raise

    def _warn_ignored(self) -> None:
        for key, message in ignored_settings(self.spec).items():
            with self._warn_lock:
                if key in self._warned:
                    continue
                self._warned.add(key)
            logger.warning("hyperpod_eks launcher: %s", message)


def read_submission(paths: JobPaths) -> dict[str, Any]:
    """``submission.json`` as a dict ({} when there is none, or it is unreadable)."""
    try:
        record = json.loads(paths.submission.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _ref_hint(crd: Crd, namespace: str, name: str) -> str:
    return f"kubectl -n {namespace} get {crd.resource} {name} -o yaml"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
