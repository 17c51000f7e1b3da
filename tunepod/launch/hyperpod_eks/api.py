"""The Kubernetes side of the hyperpod_eks launcher: where the job objects live (``Crd``, ``ObjectRef``)
and the few API calls the launcher makes, with their errors translated.

``KubeApi`` wraps the official ``kubernetes`` client (``CustomObjectsApi`` for the job objects,
``CoreV1Api`` for their pods and logs): ``ApiException`` 401/403 become ``JobError`` with a hint about
the kubeconfig and RBAC; 429 and 5xx, and connection failures (urllib3), become ``TransientError`` (the
call may or may not have taken effect); 409 on create becomes ``ObjectExists``; anything else
``JobError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunepod import world
from tunepod.errors import JobError, StopUnfinished, TransientError, TunepodError
from tunepod.launch.hyperpod_eks.render import (
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
)
from tunepod.spec.models import HyperPodEksLauncherSpec

INSTALL_HINT = "pip install 'tunepod[eks]'"
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}=tunepod"
# (connect, read) seconds: a request never hangs a trial thread for long.
REQUEST_TIMEOUT_S = (10.0, 60.0)
_GONE_POLL_S = 0.2
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


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

    @classmethod
    def of(cls, crd: Crd, obj: Mapping[str, Any]) -> ObjectRef:
        """The reference to ``obj``, an object as the API returns it."""
        metadata = obj.get("metadata") or {}
        return cls(
            crd, str(metadata.get("namespace", "")), str(metadata["name"]), str(metadata.get("uid", ""))
        )


def parse_job_id(job_id: str) -> tuple[str, str, str]:
    """``namespace/name/uid`` -> its three parts; ``JobError`` for anything else."""
    parts = job_id.split("/")
    if len(parts) != 3 or not all(parts):
        raise JobError(
            f"{job_id!r} is not a hyperpod_eks job id (expected namespace/object-name/uid, as submit returns)"
        )
    return parts[0], parts[1], parts[2]


def annotation(obj: Mapping[str, Any], key: str) -> str | None:
    """The value of annotation ``key`` on ``obj``; None when it has none."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(key)
    return None if value is None else str(value)


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

    Its public methods' signatures and docstrings are the contract between the launcher and the
    Kubernetes side: the launcher, ``delete_and_wait`` and ``pods`` call nothing else, so another
    implementation of them (the deterministic simulation's API server, a subclass that overrides every
    call) can stand in for the cluster, raising the same errors for the same answers.

    Thread safety: the kubernetes ``ApiClient`` sends through a thread-safe urllib3 pool and keeps no
    per-call state, so every method may be called from several threads at once.
    """

    def __init__(self, api_client: Any) -> None:
        kubernetes = _import_kubernetes()
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.core = kubernetes.client.CoreV1Api(api_client)
        self._api_exception: type[Exception] = kubernetes.client.exceptions.ApiException

    def list_objects(self, crd: Crd, namespace: str) -> list[dict[str, Any]]:
        """Every object of ``crd`` in ``namespace`` that tunepod manages (by label)."""
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
        """The created object; ``ObjectExists`` when its name is taken; ``TransientError`` when the
        outcome is unknown (the object may exist)."""
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

    def get_referenced(self, ref: ObjectRef) -> dict[str, Any] | None:
        """The object ``ref`` names (this uid, not a later one under the name); None when it is gone."""
        obj = self.get_object(ref.crd, ref.namespace, ref.name)
        return obj if obj is not None and ObjectRef.of(ref.crd, obj).uid == ref.uid else None

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


def delete_and_wait(api: KubeApi, ref: ObjectRef, timeout_s: float) -> None:
    """Delete ``ref`` (pods first) and block until it and its pods are gone; ``StopUnfinished`` naming
    the object and the commands to look at it after ``timeout_s`` (deleting again is harmless).

    Asks the API directly, past the launcher's status cache: a long ``poll_cache_s`` must not slow a
    cancel down.
    """
    api.delete_object(ref)
    deadline = world.monotonic() + timeout_s
    while api.get_referenced(ref) is not None or api.list_pods(ref):
        if world.monotonic() > deadline:
            state = f"{ref.title} (uid {ref.uid}) or its pods are still there"
            raise StopUnfinished(
                f"{state} {timeout_s:g}s after tunepod deleted it; look for stuck finalizers or "
                f"nodes: {ref.kubectl('describe')}; "
                f"kubectl -n {ref.namespace} get pods -l {OBJECT_LABEL}={ref.name}",
                job_id=ref.job_id,
                state=state,
            )
        world.sleep(_GONE_POLL_S)
