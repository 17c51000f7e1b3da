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

Errors: ``ApiException`` 401/403 become ``JobError`` with a hint about the kubeconfig and RBAC; 429 and
5xx, and connection failures (urllib3), become ``TransientError``; anything else ``JobError``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from tunepod.errors import JobError, TransientError, TunepodError
from tunepod.launch.base import JobSpec, JobState
from tunepod.launch.hyperpod_eks import (
    HYPERPOD_GROUP,
    HYPERPOD_KIND,
    HYPERPOD_PLURAL,
    HYPERPOD_VERSION,
    KUBEFLOW_GROUP,
    KUBEFLOW_KIND,
    KUBEFLOW_PLURAL,
    KUBEFLOW_VERSION,
    MANAGED_BY_LABEL,
    OBJECT_LABEL,
    ignored_settings,
    render_manifest,
    state_from_conditions,
)
from tunepod.launch.paths import JobPaths
from tunepod.runtime.files import write_bytes_atomic
from tunepod.spec.models import HyperPodEksLauncherSpec

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tunepod[eks]'"
MANIFEST_NAME = "manifest.json"
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}=tunepod"
JOB_DIR_ANNOTATION = "tunepod.io/job-dir"  # set by the renderer: which job dir an object belongs to
# (connect, read) seconds: a request never hangs a trial thread for long.
REQUEST_TIMEOUT_S = (10.0, 60.0)
_POLL_S = 0.2
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
_T = TypeVar("_T")


@dataclass(frozen=True)
class Crd:
    """Where the API serves one kind of job object."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def resource(self) -> str:
        """``plural.group``, as kubectl and RBAC rules name it."""
        return f"{self.plural}.{self.group}"


CRDS: Mapping[str, Crd] = {
    "hyperpod": Crd(HYPERPOD_GROUP, HYPERPOD_VERSION, HYPERPOD_PLURAL, HYPERPOD_KIND),
    "kubeflow": Crd(KUBEFLOW_GROUP, KUBEFLOW_VERSION, KUBEFLOW_PLURAL, KUBEFLOW_KIND),
}


def crd_of_kind(kind: str) -> Crd | None:
    return next((crd for crd in CRDS.values() if crd.kind == kind), None)


@dataclass(frozen=True)
class ObjectRef:
    """One submission: a job object in the cluster, down to its uid."""

    crd: Crd
    namespace: str
    name: str
    uid: str

    @property
    def job_id(self) -> str:
        return f"{self.namespace}/{self.name}/{self.uid}"

    @property
    def title(self) -> str:
        return f"{self.crd.kind} {self.namespace}/{self.name}"

    def kubectl(self, verb: str) -> str:
        return f"kubectl -n {self.namespace} {verb} {self.crd.resource} {self.name}"


def parse_job_id(job_id: str) -> tuple[str, str, str]:
    """``namespace/name/uid`` -> its three parts; ``JobError`` for anything else."""
    parts = job_id.split("/")
    if len(parts) != 3 or not all(parts):
        raise JobError(
            f"{job_id!r} is not a hyperpod_eks job id (expected namespace/object-name/uid, as submit returns)"
        )
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class ObjectStatus:
    """What the API says about one job object: its uid, conditions, and whether it is being deleted."""

    uid: str
    conditions: tuple[Mapping[str, Any], ...]
    deleting: bool = False

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> ObjectStatus:
        metadata = obj.get("metadata") or {}
        conditions = (obj.get("status") or {}).get("conditions") or []
        return cls(
            uid=str(metadata.get("uid", "")),
            conditions=tuple(conditions),
            deleting=bool(metadata.get("deletionTimestamp")),
        )

    @property
    def job_state(self) -> JobState:
        return state_from_conditions(self.conditions)

    def last_condition(self) -> str:
        """The newest condition as ``Type (Reason: message)``, or "" when there is none."""
        if not self.conditions:
            return ""
        # Stable sort: conditions without a timestamp keep their order, the API's newest last.
        newest = sorted(self.conditions, key=lambda c: str(c.get("lastTransitionTime") or ""))[-1]
        detail = ": ".join(str(newest[k]) for k in ("reason", "message") if newest.get(k))
        return f"{newest.get('type', '?')} ({detail})" if detail else str(newest.get("type", "?"))


# ------------------------------------------------------------------------------------------ client


def _import_kubernetes() -> Any:
    try:
        import kubernetes  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TunepodError(
            f"the hyperpod_eks launcher needs the kubernetes client; fix: {INSTALL_HINT}"
        ) from exc
    return kubernetes


def kube_api_client(spec: HyperPodEksLauncherSpec) -> Any:
    """A ``kubernetes.client.ApiClient`` for ``spec``: its ``kubeconfig``/``context`` when set, else the
    pod's service account when running in a cluster, else the default kubeconfig."""
    kubernetes = _import_kubernetes()
    if spec.kubeconfig is not None and not Path(spec.kubeconfig).expanduser().is_file():
        raise TunepodError(
            f"launcher.kubeconfig {spec.kubeconfig!r} does not exist; fix: point kubeconfig at the "
            "cluster's file (aws eks update-kubeconfig --name CLUSTER --kubeconfig PATH writes one), or "
            "unset it to use $KUBECONFIG, ~/.kube/config or the pod's service account"
        )
    try:
        if spec.kubeconfig is None and spec.context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            configuration = kubernetes.client.Configuration()
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            return kubernetes.client.ApiClient(configuration)
        # $KUBECONFIG read now, not when the client was imported (it reads it once, at import).
        config_file = (
            str(Path(spec.kubeconfig).expanduser()) if spec.kubeconfig else os.environ.get("KUBECONFIG")
        )
        return kubernetes.config.new_client_from_config(
            config_file=config_file, context=spec.context, persist_config=False
        )
    except kubernetes.config.ConfigException as exc:
        where = spec.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise TunepodError(
            f"cannot load the Kubernetes configuration ({where}, context {spec.context or '<current>'}): "
            f"{exc}; fix: set launcher.kubeconfig (and launcher.context) to a working kubeconfig"
        ) from exc


class KubeApi:
    """The few API calls the launcher makes, with the client's errors translated into tunepod's.

    Thread safety: the kubernetes ``ApiClient`` sends through a thread-safe urllib3 pool and keeps no
    per-call state, so every method may be called from several threads at once.
    """

    def __init__(self, api_client: Any) -> None:
        kubernetes = _import_kubernetes()
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.core = kubernetes.client.CoreV1Api(api_client)
        self._api_exception: type[Exception] = kubernetes.client.exceptions.ApiException

    def list_objects(self, crd: Crd, namespace: str) -> list[dict[str, Any]]:
        custom = self.custom.list_namespaced_custom_object
        doing = f"list {crd.resource} in namespace {namespace}"
        listed = self._call(
            doing, custom, crd.group, crd.version, namespace, crd.plural, label_selector=MANAGED_SELECTOR
        )
        return list(listed.get("items") or [])

    def get_object(self, crd: Crd, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none by that name."""
        get = self.custom.get_namespaced_custom_object
        doing = f"get {crd.resource} {namespace}/{name}"
        found: dict[str, Any] | None = self._call(
            doing, get, crd.group, crd.version, namespace, crd.plural, name, missing_ok=True
        )
        return found

    def create_object(self, crd: Crd, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The created object; ``ObjectExists`` when its name is taken."""
        create = self.custom.create_namespaced_custom_object
        doing = f"create {crd.resource} {namespace}/{body['metadata']['name']}"
        created: dict[str, Any] = self._call(
            doing, create, crd.group, crd.version, namespace, crd.plural, body
        )
        return created

    def delete_object(self, ref: ObjectRef) -> None:
        """Delete ``ref`` and, before it goes, its pods (Foreground). Only this uid is deleted: a later
        object under the same name answers 409, and that (like a 404) means ``ref`` is already gone."""
        options = {"propagationPolicy": "Foreground", "preconditions": {"uid": ref.uid}}
        delete = self.custom.delete_namespaced_custom_object
        crd = ref.crd
        doing = f"delete {crd.resource} {ref.namespace}/{ref.name}"
        args = (crd.group, crd.version, ref.namespace, crd.plural, ref.name)
        self._call(doing, delete, *args, body=options, missing_ok=True, conflict_ok=True)

    def list_pods(self, ref: ObjectRef) -> list[dict[str, Any]]:
        """The pods of ``ref``: by the labels the renderer sets, and by owner uid where the operator
        set an owner reference (pods of an earlier object under the same name are left out)."""
        selector = f"{MANAGED_SELECTOR},{OBJECT_LABEL}={ref.name}"
        # Raw JSON rather than the client's models: plain dicts, like the custom objects.
        doing = f"list the pods of {ref.title}"
        response = self._call(
            doing,
            self.core.list_namespaced_pod,
            ref.namespace,
            label_selector=selector,
            _preload_content=False,
        )
        pods = json.loads(response.data).get("items") or []
        return [pod for pod in pods if _owned_by(pod, ref.uid)]

    def pod_log(self, namespace: str, pod: str, container: str | None, tail: int) -> str:
        # Raw bytes: the client's own decoding turns a log that happens to be valid JSON into a repr.
        doing = f"read the log of pod {namespace}/{pod}"
        read = self.core.read_namespaced_pod_log
        response = self._call(
            doing, read, pod, namespace, container=container, tail_lines=tail, _preload_content=False
        )
        return bytes(response.data).decode("utf-8", errors="replace")

    def _call(
        self,
        doing: str,
        method: Callable[..., Any],
        *args: Any,
        missing_ok: bool = False,
        conflict_ok: bool = False,
        **kwargs: Any,
    ) -> Any:
        """``method(*args, **kwargs)`` with a timeout; None for a tolerated 404/409; errors translated."""
        import urllib3

        try:
            return method(*args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except self._api_exception as exc:
            status = int(getattr(exc, "status", 0) or 0)
            if (status == 404 and missing_ok) or (status == 409 and conflict_ok):
                return None
            raise api_error(exc, doing) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise TransientError(f"could not {doing}: the Kubernetes API did not answer ({exc})") from exc


class ObjectExists(JobError):
    """Create answered 409: an object of that name exists already."""


def api_error(exc: Exception, doing: str) -> TunepodError:
    """An ``ApiException`` as a runbook: the call, the status, the API's own message, and the fix."""
    status = int(getattr(exc, "status", 0) or 0)
    text = f"could not {doing}: HTTP {status} {getattr(exc, 'reason', '')}: {_status_message(exc)}"
    if status in (401, 403):
        return JobError(
            f"{text}; fix: check the kubeconfig's credentials (launcher.kubeconfig/context; for EKS "
            "`aws eks update-kubeconfig` and an access entry) and that its user or service account has "
            "RBAC permission to get, list, create and delete the job objects and to list pods and get "
            "pods/log in the namespace (kubectl auth can-i --list -n NAMESPACE)"
        )
    if status == 409:
        return ObjectExists(text)
    if status in _TRANSIENT_STATUSES:
        return TransientError(text)
    if status == 404:
        return JobError(f"{text}; fix: check that the CRD is installed (kubectl get crd) and the namespace")
    return JobError(text)


def _status_message(exc: Exception) -> str:
    """The ``message`` of the Status object in the error body (the whole body when it is not one)."""
    body = getattr(exc, "body", None)
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else str(body or "")
    try:
        return str(json.loads(text)["message"])
    except (TypeError, ValueError, KeyError):
        return text.strip()[:500]


def _owned_by(pod: Mapping[str, Any], uid: str) -> bool:
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    return not owners or any(owner.get("uid") == uid for owner in owners)


# ------------------------------------------------------------------------------------------ state cache


@dataclass
class _Snapshot:
    fetched_at: float
    objects: dict[str, ObjectStatus]


class KubeStateCache:
    """The API's view of every job object one launcher follows, one LIST per namespace and CRD at most
    once per ``max_age_s``. ``status`` returns None for an object that is gone.

    Thread safety: every method may be called from several threads; one lock serializes the API calls,
    so concurrent callers share one LIST. An ended or gone object's status is kept for good (by uid).
    A LIST that fails transiently is logged and the last known status served instead, for up to
    ``stale_limit_s``; after that the ``TransientError`` reaches the caller.
    """

    def __init__(self, api: KubeApi, max_age_s: float, stale_limit_s: float = 300.0) -> None:
        self.api = api
        self.max_age_s = max_age_s
        self.stale_limit_s = stale_limit_s
        self._lock = threading.Lock()
        self._snapshots: dict[tuple[str, str], _Snapshot] = {}
        self._final: dict[str, ObjectStatus | None] = {}

    def status(self, ref: ObjectRef, *, max_age_s: float | None = None) -> ObjectStatus | None:
        """The status of ``ref``, at most ``max_age_s`` (default: the cache's) seconds old."""
        limit = self.max_age_s if max_age_s is None else max_age_s
        with self._lock:
            if ref.uid in self._final:
                return self._final[ref.uid]
            snapshot = self._snapshot(ref, limit)
            found = snapshot.objects.get(ref.name)
            if found is None or found.uid != ref.uid:
                found = self._look_up(ref)
                if found is not None:
                    snapshot.objects[ref.name] = found
            if found is None or found.job_state.is_terminal:
                self._final[ref.uid] = found
            return found

    def _snapshot(self, ref: ObjectRef, max_age_s: float) -> _Snapshot:
        key = (ref.crd.resource, ref.namespace)
        snapshot = self._snapshots.get(key)
        if snapshot is not None and time.monotonic() - snapshot.fetched_at < max_age_s:
            return snapshot
        try:
            objects = self.api.list_objects(ref.crd, ref.namespace)
        except TransientError as exc:
            if snapshot is None or time.monotonic() - snapshot.fetched_at > self.stale_limit_s:
                raise
            logger.warning("listing %s failed, serving the last known states: %s", ref.crd.resource, exc)
            return snapshot
        statuses = {str(obj["metadata"]["name"]): ObjectStatus.from_object(obj) for obj in objects}
        self._snapshots[key] = _Snapshot(time.monotonic(), statuses)
        return self._snapshots[key]

    def _look_up(self, ref: ObjectRef) -> ObjectStatus | None:
        obj = self.api.get_object(ref.crd, ref.namespace, ref.name)
        status = None if obj is None else ObjectStatus.from_object(obj)
        return status if status is not None and status.uid == ref.uid else None


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


def wait_until_gone(api: KubeApi, ref: ObjectRef, timeout_s: float) -> None:
    """Block until ``ref`` and its pods are gone; ``JobError`` naming the object after ``timeout_s``.

    Asks the API directly, past the launcher's cache: a long ``poll_cache_s`` must not slow a cancel
    down, and the cache keeps an ended object's last status for good.
    """
    deadline = time.monotonic() + timeout_s
    while _still_there(api, ref) or api.list_pods(ref):
        if time.monotonic() > deadline:
            raise JobError(
                f"{ref.title} (uid {ref.uid}) or its pods are still there {timeout_s:.0f}s after tunepod "
                f"deleted it; look for stuck finalizers or nodes: {ref.kubectl('describe')}; "
                f"kubectl -n {ref.namespace} get pods -l {OBJECT_LABEL}={ref.name}"
            )
        time.sleep(_POLL_S)


def _still_there(api: KubeApi, ref: ObjectRef) -> bool:
    obj = api.get_object(ref.crd, ref.namespace, ref.name)
    return obj is not None and ObjectStatus.from_object(obj).uid == ref.uid


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
