"""Submit and follow HyperPod EKS jobs through the Kubernetes API (the launcher of ``kind: hyperpod_eks``).

Render, then execute: ``render.render_manifest`` builds the custom object (a ``HyperPodPyTorchJob``,
or a Kubeflow ``PyTorchJob`` with ``crd: kubeflow``); this module fills in the hooks of
``LauncherBase``, which keeps the bookkeeping (the submission record written ahead of the create, the
cancel marker, refuse-if-running, warn-once, the status cache).

Identity: a job id is ``<namespace>/<object name>/<uid>``. The object name is a function of the job
name only (``object_name``), so ``kubectl get`` finds a trial's object without tunepod; the uid tells
one submission from a later one under the same name, and the ``tunepod.io/submission`` annotation
(the attempt's submission id) tells ``find`` which attempt created the object under the name. An
object that was created, ran and was deleted before its creation reached the submission record is
known only from its pods' exit records: its job id holds ``gone-<submission id>`` for the uid.

Resubmission into a used job dir (resume after a crash, a retried trial) deletes the previous object
once it has ended and waits until it is gone (``prepare``), then creates the new one under the SAME
name. We chose this over per-attempt names (``-rN``, as SageMaker needs because its names can never be
reused): Kubernetes frees a name on delete, a stable name is what an operator types into ``kubectl``,
the pods' ``tunepod.io/object`` label stays the rendered one, and the object in the cluster stays
exactly ``render_manifest``'s output. What is lost is the ended object's status and pod logs, which
the orchestrator has already read when it decided to resubmit.

State: ``poll`` answers every followed job with ONE LIST per CRD and namespace (label
``app.kubernetes.io/managed-by=tunepod``). An object missing from the LIST is looked up once by name
(the LIST may predate its creation); one that is gone gets a gone status with the reason (tunepod's
cancel, a later submission, or a delete outside tunepod / an expired TTL): SUCCEEDED when every pod of
its submission recorded exit 0 in the job dir (``exits``: the container's command records it), else
FAILED. So a job that exited 0 is never restarted, nor failed, because its TTL ran out before an
orchestrator read its state.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunepod.errors import JobError, TransientError
from tunepod.launch.base import SUBMISSION_ID_ENV, Accepted, Job, JobSpec, LauncherBase, Rendered
from tunepod.launch.hyperpod_eks import pods
from tunepod.launch.hyperpod_eks.api import (
    CRDS,
    Crd,
    KubeApi,
    ObjectExists,
    ObjectRef,
    annotation,
    crd_of_kind,
    delete_and_wait,
    kube_api_client,
    parse_job_id,
)
from tunepod.launch.hyperpod_eks.exits import recorded_codes, recorded_exit, stale_records
from tunepod.launch.hyperpod_eks.render import (
    JOB_DIR_ANNOTATION,
    SUBMISSION_ANNOTATION,
    ignored_settings,
    object_name,
    render_manifest,
)
from tunepod.launch.hyperpod_eks.states import ObjectStatus
from tunepod.launch.paths import JobPaths
from tunepod.launch.status_cache import TrackedJob
from tunepod.launch.submission import Submission, read_cancel_marker, read_submission
from tunepod.spec.models import HyperPodEksLauncherSpec

MANIFEST_NAME = "manifest.json"
_CANCEL_POLL_S = 0.2


class HyperPodEksLauncher(LauncherBase[ObjectStatus]):
    """Creates one job object per job and follows them all with one LIST per period (see the module
    docstring); handles are the template's ``Job``.

    ``api_client`` is a ``kubernetes.client.ApiClient`` (default: one from ``kube_api_client(spec)``,
    made here, or with ``connect=False`` at the first call that needs the cluster: ``render`` needs
    none);
    ``api``, when given, is used instead of a ``KubeApi`` over that client: any object with
    ``KubeApi``'s methods and their contract (the deterministic simulation passes its simulated API
    server this way). ``spec.root`` must be where this process sees the claim the pods mount at the
    same path.

    Thread safety: as ``LauncherBase`` (``KubeApi`` may be called from several threads at once).
    """

    kind = "hyperpod_eks"
    # Pods may write into the job dir as another user than the orchestrator's.
    private_job_dirs = False
    stop_hint = "delete it with kubectl"

    def __init__(
        self,
        spec: HyperPodEksLauncherSpec,
        api_client: Any | None = None,
        *,
        cancel_timeout_s: float = 300.0,
        api: KubeApi | None = None,
        connect: bool = True,
    ) -> None:
        super().__init__(
            poll_cache_s=spec.poll_cache_s, cancel_timeout_s=cancel_timeout_s, cancel_poll_s=_CANCEL_POLL_S
        )
        self.spec = spec
        self.crd = CRDS[spec.crd]
        self._api = api
        self._api_client = api_client
        self._api_lock = threading.Lock()
        if connect:
            self.api  # noqa: B018 -- the configuration is read now: a wrong one fails before anything starts

    @property
    def api(self) -> KubeApi:
        """The cluster's API, connected on first use: rendering a job (``tunepod render``) needs no
        cluster, nor a kubeconfig."""
        with self._api_lock:
            if self._api is None:
                client = self._api_client if self._api_client is not None else kube_api_client(self.spec)
                self._api = KubeApi(client)
            return self._api

    def object_ref(self, job: Job[ObjectStatus]) -> ObjectRef:
        """The object ``job`` names (its CRD from the submission record, else the spec's)."""
        return self._ref(job.job_id, job.record)

    # ------------------------------------------------------------------------------------ hooks

    def render(self, job: JobSpec, attempt: int, variant: int = 0) -> Rendered:
        # ``variant`` is never asked for: Kubernetes frees a name on delete, so send never raises NameTaken.
        manifest = render_manifest(job, self.spec)
        return Rendered(
            name=str(manifest["metadata"]["name"]),
            payload=manifest,
            files={MANIFEST_NAME: json.dumps(manifest, indent=2)},
            # pods: how many exit records a gone object's job must have left to count as exited 0.
            details={
                "kind": self.crd.kind,
                "namespace": self.spec.namespace,
                "pods": job.resources.num_nodes,
            },
        )

    def send(self, job: JobSpec, rendered: Rendered, intent: Submission) -> Accepted:
        """Create the object. A name taken by this attempt's own object (a retried create) adopts it;
        one taken by anything else is a ``JobError``: tunepod never deletes what is not its own."""
        crd, namespace = self._where(intent)
        try:
            created = self.api.create_object(crd, namespace, rendered.payload)
        except ObjectExists as exc:
            return self._adopt_or_refuse(crd, namespace, intent, job.job_dir, exc)
        return Accepted(ObjectRef.of(crd, created).job_id)

    def find(self, intent: Submission, job_dir: Path) -> Accepted | None:
        """The object under the intent's name, when its annotation holds the intent's submission id;
        else, when the intent's pods recorded how they ended, the object they ran in, which is gone
        (deleted by its TTL, say, before the create reached the record): its uid unknown, its job id
        holds ``gone_uid(submission id)`` in its place, and its status comes from those records."""
        crd, namespace = self._where(intent)
        obj = self.api.get_object(crd, namespace, intent.name)
        if obj is not None and annotation(obj, SUBMISSION_ANNOTATION) == intent.submission_id:
            return Accepted(ObjectRef.of(crd, obj).job_id)
        if _ended_unrecorded(intent, job_dir):
            return Accepted(ObjectRef(crd, namespace, intent.name, gone_uid(intent.submission_id)).job_id)
        return None

    def poll(self, jobs: Mapping[str, TrackedJob]) -> dict[str, ObjectStatus]:
        """One LIST per (CRD, namespace) of the jobs; a GET for each job the LISTs do not hold."""
        refs = {job_id: self._ref(job_id, job.record) for job_id, job in jobs.items()}
        listed: dict[str, ObjectStatus] = {}
        for crd, namespace in {(ref.crd, ref.namespace) for ref in refs.values()}:
            for obj in self.api.list_objects(crd, namespace):
                status = ObjectStatus.from_object(crd, obj)
                listed[status.ref.uid] = status
        return {
            job_id: listed.get(ref.uid) or self._look_up(ref, jobs[job_id]) for job_id, ref in refs.items()
        }

    def stop(self, job: Job[ObjectStatus]) -> None:
        """Delete the object, pods first (Foreground), and wait until both are gone; ``StopUnfinished``
        naming the object after ``cancel_timeout_s`` (a finalizer or a node that hangs)."""
        delete_and_wait(self.api, self.object_ref(job), self.cancel_timeout_s)

    def read_logs(self, job: Job[ObjectStatus], tail: int) -> str:
        return pods.read_logs(self.api, self.object_ref(job), tail)

    def run_mark(self, status: ObjectStatus) -> str | None:
        return status.run_mark

    def describe_status(self, job: Job[ObjectStatus], status: ObjectStatus) -> str:
        """The status's line and the pods' exit codes."""
        line = status.describe(job.job_id)
        if status.is_gone:
            return line
        exits = pods.exit_codes(self.api, status.ref)
        return f"{line}; {'; '.join(exits)}" if exits else line

    def stop_command(self, job_id: str, record: Submission | None) -> str:
        return f"delete it ({self._ref(job_id, record).kubectl('delete')})"

    def ignored_settings(self, job: JobSpec) -> dict[str, str]:
        return ignored_settings(self.spec)

    def prepare(self, job: JobSpec, previous: Submission | None) -> None:
        """Clear the name the new object needs: delete (and wait out) the ENDED objects of this job dir's
        earlier attempts, i.e. the recorded one (the spec's crd or namespace may have changed since) and
        whatever holds the name now (a record lost or deleted by hand leaves one behind).

        ``JobError`` for an object another job dir or something other than tunepod holds, and for one
        that has not ended. This attempt's own object (its create's reply was lost) is left to ``send``.
        """
        recorded = [] if previous is None else [(*self._where(previous), previous.name)]
        wanted = (self.crd, self.spec.namespace, object_name(job.name))
        for crd, namespace, name in dict.fromkeys([*recorded, wanted]):  # in order, without repeats
            obj = self.api.get_object(crd, namespace, name)
            if obj is not None:
                self._clear(crd, obj, job)

    def stale_outcome_files(self, paths: JobPaths) -> list[Path]:
        return stale_records(paths.job_dir)

    def check_job_id(self, job_id: str) -> None:
        parse_job_id(job_id)

    # ------------------------------------------------------------------------------------ internals

    def _where(self, record: Submission) -> tuple[Crd, str]:
        """The CRD and namespace ``record``'s object was created in (they follow the spec of its day)."""
        crd = crd_of_kind(str(record.details.get("kind", ""))) or self.crd
        return crd, str(record.details.get("namespace", self.spec.namespace))

    def _ref(self, job_id: str, record: Submission | None) -> ObjectRef:
        namespace, name, uid = parse_job_id(job_id)
        crd = self._where(record)[0] if record is not None else self.crd
        return ObjectRef(crd, namespace, name, uid)

    def _look_up(self, ref: ObjectRef, job: TrackedJob) -> ObjectStatus:
        obj = self.api.get_referenced(ref)
        if obj is not None:
            return ObjectStatus.from_object(ref.crd, obj)
        code = _recorded_exit(job)
        return ObjectStatus.gone(ref, _why_gone(ref.job_id, job.job_dir, code), recorded_exit=code)

    def _adopt_or_refuse(
        self, crd: Crd, namespace: str, intent: Submission, job_dir: Path, exc: ObjectExists
    ) -> Accepted:
        obj = self.api.get_object(crd, namespace, intent.name)
        if obj is None:
            # Deleted since the 409: the outcome is unknown, and the next submit tries again.
            raise TransientError(f"{exc}, but it was gone a moment later; submit again") from exc
        ref = ObjectRef.of(crd, obj)
        theirs = annotation(obj, SUBMISSION_ANNOTATION)
        if theirs == intent.submission_id:
            return Accepted(ref.job_id)
        owner = annotation(obj, JOB_DIR_ANNOTATION) or "<none: not made by tunepod>"
        raise JobError(
            f"cannot create {ref.title} for job dir {job_dir}: the name was taken after tunepod cleared "
            f"it, by submission {theirs or '<none>'} of job dir {owner} (another orchestrator running the "
            f"same job?); tunepod never deletes what is not its own; fix: look at it "
            f"({ref.kubectl('get')} -o yaml) and delete it if nothing needs it ({ref.kubectl('delete')})"
        ) from exc

    def _clear(self, crd: Crd, obj: Mapping[str, Any], job: JobSpec) -> None:
        """Refuse when ``obj`` is not this job dir's or has not ended; else delete it and wait."""
        status = ObjectStatus.from_object(crd, obj)
        ref, job_dir = status.ref, job.job_dir
        owner = annotation(obj, JOB_DIR_ANNOTATION)
        if owner != job_dir.as_posix():
            # Never delete what another job dir (or something other than tunepod) owns.
            raise JobError(
                f"cannot submit into {job_dir}: {ref.title} exists for job dir "
                f"{owner or '<none: not made by tunepod>'}; fix: give the jobs distinct names, or delete "
                f"it ({ref.kubectl('delete')})"
            )
        if annotation(obj, SUBMISSION_ANNOTATION) == job.env[SUBMISSION_ID_ENV]:
            return
        if not status.deleting and not status.job_state.is_terminal:
            raise JobError(
                f"job dir {job_dir} belongs to {ref.title}, which has not ended "
                f"({status.job_state.value}) and is not in its submission record; stop it "
                f"({ref.kubectl('delete')}) or wait for it before submitting again into the same job dir"
            )
        delete_and_wait(self.api, ref, self.cancel_timeout_s)


def gone_uid(submission_id: str) -> str:
    """What stands for the uid of an object known only from its pods' exit records (see ``find``):
    no object has it, so the job reads as gone, and its records say how it ended."""
    return f"gone-{submission_id}"


def _ended_unrecorded(intent: Submission, job_dir: Path) -> bool:
    """Whether pods of ``intent``'s submission recorded how they ended: its object existed, ran and
    (the caller found no object of it) is gone. Never another attempt's records: they name theirs."""
    return bool(recorded_codes(job_dir, intent.submission_id))


def _recorded_exit(job: TrackedJob) -> int | None:
    """The exit code the pods of ``job``'s submission recorded in its job dir (None: not known, or a
    record from before tunepod rendered the pod count into it)."""
    record = job.record
    pods = record.details.get("pods") if record is not None else None
    if record is None or not isinstance(pods, int):
        return None
    return recorded_exit(job.job_dir, record.submission_id, pods)


def _why_gone(job_id: str, job_dir: Path, recorded: int | None = None) -> str:
    """Why the object of ``job_id`` no longer exists, from what its job dir holds (``recorded``: the
    exit code its pods recorded there)."""
    paths = JobPaths(job_dir)
    marker = read_cancel_marker(paths)
    if marker is not None and marker.job_id in (job_id, ""):
        return f"deleted by tunepod's cancel ({marker.reason})"
    try:
        record = read_submission(paths)
    except JobError:
        record = None
    if record is not None and record.job_id not in (None, job_id):
        return f"replaced by a later submission into {job_dir} ({record.job_id})"
    if recorded is not None:
        return (
            "deleted outside tunepod, or its ttlSecondsAfterFinished expired before its outcome was read; "
            f"its pods recorded exit code {recorded} in {job_dir}"
        )
    return (
        "deleted outside tunepod, or its ttlSecondsAfterFinished expired before its outcome was read; "
        f"its outcome is lost (the job's own files are in {job_dir})"
    )
