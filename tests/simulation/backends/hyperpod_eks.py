"""A simulated Kubernetes API server and training operator behind the real ``HyperPodEksLauncher``:
the launcher's ``KubeApi`` calls (``SimKubeApi``, the same methods, errors raised as ``KubeApi``
translates the API's answers) reach one control plane, which runs the job objects the launcher
renders (``HyperPodPyTorchJob``, or Kubeflow's ``PyTorchJob``: the seed draws the spec's ``crd``).

Modelled, as Kubernetes and the operators do it:

- create: 409 AlreadyExists on a taken name; the object gets a uid, a creationTimestamp and a
  resourceVersion, and keeps the labels and annotations as rendered; ``status.conditions`` starts
  with Created;
- the operator: after a moment (scheduling, image pull) the object's pods start (``<name>-pod-N``,
  or ``<name>-master-0`` / ``-worker-N``, owned by the object's uid, with the template's labels), a
  pod name still held by a terminating pod of an earlier object waits for it; the container's command
  runs as ONE program run (``Cluster.start``) for all the job's pods, with the container's env (as
  the kubelet expands ``$(VAR)`` and ``$$``); Running (Kubeflow) / PodsRunning (HyperPod), then
  Succeeded / Completed when the program exits 0, or Failed;
- the tunepod exit wrapper, when the rendered command has one (``/bin/sh -c SCRIPT``): each pod
  records ``<code> <submission id>`` where the script's ``mv`` puts it (its variables, the container
  env and the downward API's pod name expanded, as the shell and the kubelet do), on the program's own
  exit, with 143 when a SIGTERM (a delete, the deadline, a hang restart) ends it and 137 when the
  container is OOM-killed (the shell survives the child);
- restarts in place: ``jobMaxRetryCount`` (HyperPod) and ``restartPolicy: OnFailure`` with
  ``backoffLimit`` (Kubeflow): a failed run starts again (Restarting, then running) under the same
  object while retries are left, else the object is Failed;
- ``activeDeadlineSeconds`` from the first start: past it the run is killed, Failed
  (DeadlineExceeded);
- HyperPod's log monitoring, for the rules whose ``logPattern`` matches the line tunepod's runtime
  prints, as the runtime prints it (``tunepod.runtime.progress``: from the heartbeat thread, every
  heartbeat, the first time and then only after the loop advanced, at most every
  ``TUNEPOD_PROGRESS_LOG_S``; never without that variable): no matching line for
  ``expectedRecurringFrequencyInSeconds`` since the last (or since the start) and the job is
  restarted in place (or Failed without retries left), as for a failure;
- ``ttlSecondsAfterFinished``: a finished object is deleted that long after it finished (Background:
  the object at once, its pods a moment later); after that a GET answers 404;
- delete with ``preconditions.uid`` (409 Conflict on another uid, 404 on none): Foreground keeps the
  object, with a ``deletionTimestamp`` and the ``foregroundDeletion`` finalizer, until its pods are
  gone (they get SIGTERM, which the program does not trap, and terminate for a few seconds);
- list per namespace with an equality label selector; get; pod lists by label selector (the pods of
  an earlier object under the same name included, as the API lists them by label: the launcher's
  ``KubeApi`` keeps those its uid owns); pod logs, a few lines per run;
- faults while ``faults_on``: 429/500/503 (or no answer at all) before a call takes effect; a create
  or delete that takes effect and whose reply is lost, at once (a dropped connection) or after the
  client's read timeout (``REQUEST_TIMEOUT_S``, while the job runs on); a pod's container killed
  (OOMKilled, 137) while it runs.

Not modelled: watches and resourceVersion semantics (a LIST is a consistent read, as the launcher's
LIST without ``resourceVersion`` is), Kueue (``Suspended``), several programs for several pods (a
job of N pods is one run), process-level restarts of the HyperPod agent, ``restartPolicy``'s
evaluation window (``maxFullJobRestarts``), ``expectedStartCutOffInSeconds`` (the scenarios set no
startup timeout), RBAC, schema validation, other namespaces' objects.

The study's entrypoint lies in the simulation's working directory, outside the seed's root, and the
launcher refuses a job whose code the pods could not see: the claim's mount path (``spec.root``) is
the folder both lie under.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from simulation.backends import Machine, Outage, ServiceFaults, rate, service_faults
from simulation.cluster import HEARTBEAT_S, Cluster, JobRun
from simulation.invariants import Referee
from simulation.scheduler import Host, Scheduler
from tunepod import world
from tunepod.errors import TransientError
from tunepod.launch.base import SUBMISSION_ID_ENV, Launcher
from tunepod.launch.hyperpod_eks.api import (
    MANAGED_SELECTOR,
    REQUEST_TIMEOUT_S,
    Crd,
    KubeApi,
    ObjectRef,
    api_error,
)
from tunepod.launch.hyperpod_eks.launcher import HyperPodEksLauncher
from tunepod.launch.hyperpod_eks.render import OBJECT_LABEL
from tunepod.launch.paths import JobPaths
from tunepod.runtime.checkpoints import latest_checkpoint
from tunepod.runtime.contract import read_contract
from tunepod.runtime.progress import PROGRESS_LOG_PREFIX, PROGRESS_LOG_S_ENV
from tunepod.spec.models import HyperPodEksLauncherSpec

T = TypeVar("T")
NAMESPACE = "tunepod"
_BUSY = (
    (429, "TooManyRequests", "the server has received too many requests and has asked us to try again later"),
    (500, "InternalError", "Internal error occurred: etcdserver: request timed out"),
    (503, "ServiceUnavailable", "the server is currently unable to handle the request"),
)


@dataclass(frozen=True)
class EksFaults(ServiceFaults):
    """The API server's (429/5xx or no answer; a create's or delete's reply lost), and killed pods."""

    pod_killed_per_s: float = 0.0
    """Per running job and second: its container is killed (OOMKilled, exit 137)."""


@dataclass(frozen=True)
class EksSettings:
    """The simulated cluster's operator (the spec's ``crd``), the launcher settings it honours, and
    its faults."""

    faults: EksFaults
    crd: str
    max_retries: int
    ttl_after_finished_s: int
    kind: str = "hyperpod_eks"

    def describe(self) -> str:
        return (
            f"hyperpod_eks: crd {self.crd}, max_retries {self.max_retries}, ttlSecondsAfterFinished "
            f"{self.ttl_after_finished_s}, faults {self.faults}"
        )

    def quiet(self) -> EksSettings:
        return replace(self, faults=EksFaults())

    def make(self, machine: Machine) -> EksBackend:
        return EksBackend(KubeServer(machine, self))


def draw(random_: random.Random) -> EksSettings:
    return EksSettings(
        faults=EksFaults(
            **service_faults(random_),
            pod_killed_per_s=rate(random_, 0.002),
        ),
        crd=random_.choice(["hyperpod", "kubeflow"]),
        max_retries=random_.choice([0, 0, 1, 2]),
        ttl_after_finished_s=random_.choice([1, 20, 300, 3600]),
    )


class EksBackend:
    """The real ``HyperPodEksLauncher`` of each orchestrator, all reaching one simulated API server."""

    def __init__(self, server: KubeServer) -> None:
        self.server = server

    def launcher(self) -> Launcher:
        server = self.server
        settings = server.settings
        spec = HyperPodEksLauncherSpec.model_validate(
            {
                "kind": "hyperpod_eks",
                "crd": settings.crd,
                "namespace": NAMESPACE,
                "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/tunepod-train:sim",
                "root": os.path.commonpath([str(server.root), str(Path.cwd())]),
                "claim_name": "fsx-claim",
                "max_retries": settings.max_retries,
                "ttl_after_finished_s": settings.ttl_after_finished_s,
                "poll_cache_s": server.sim.choices.pick([0.0, 2.0]),
            }
        )
        return HyperPodEksLauncher(spec, api=SimKubeApi(server), cancel_timeout_s=120.0)

    def faults_stop(self) -> None:
        self.server.faults_on = False


# ---------------------------------------------------------------------------------- the cluster's state


@dataclass
class Pod:
    """One pod of a job object (all a job's pods share its one program run)."""

    name: str
    uid: str
    owner: dict[str, Any]
    labels: dict[str, str]
    node: Host
    created_at: float
    restarts: int = 0
    exit_code: int | None = None
    reason: str = ""
    deleted_at: float | None = None
    gone_at: float | None = None
    """When a terminating pod is removed (None: not terminating)."""
    log: list[str] = field(default_factory=list)

    @property
    def phase(self) -> str:
        if self.exit_code is None:
            return "Running"
        return "Succeeded" if self.exit_code == 0 else "Failed"


@dataclass
class JobObject:
    """One job object and what its operator keeps about it."""

    crd: Crd
    body: dict[str, Any]
    job_dir: Path
    """Where its program writes (its contract's job dir): the referee's key, never the operator's."""
    env: dict[str, str]
    wrapper: ExitWrapper | None
    """The command's tunepod exit wrapper (None: the command has none)."""
    retries_left: int
    start_after: float
    conditions: list[dict[str, Any]] = field(default_factory=list)
    pods: list[Pod] = field(default_factory=list)
    run: JobRun | None = field(default=None, repr=False)
    started_at: float | None = None
    finished_at: float | None = None
    deleting_since: float | None = None
    restart_at: float | None = None
    printed: tuple[float, float] | None = None
    """When the run's runtime last printed its progress line, and the advance it told of."""
    next_beat: float = 0.0
    """The run's next heartbeat, when the runtime may print its progress line."""
    served: str | None = field(default=None, repr=False)
    """The object as the API serves it, as JSON; None once it changed (``KubeServer._bump``)."""

    @property
    def meta(self) -> dict[str, Any]:
        metadata: dict[str, Any] = self.body["metadata"]
        return metadata

    @property
    def name(self) -> str:
        return str(self.meta["name"])

    @property
    def uid(self) -> str:
        return str(self.meta["uid"])

    @property
    def run_id(self) -> str:
        """The id of its runs in the cluster's ground truth (and the trace)."""
        return f"{self.name}/{self.uid[:8]}"

    @property
    def run_policy(self) -> dict[str, Any]:
        policy: dict[str, Any] = self.body["spec"].get("runPolicy") or {}
        return policy

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


class KubeServer:
    """The API server, the operator, the garbage collector and the TTL controller; see the module
    docstring."""

    def __init__(self, machine: Machine, settings: EksSettings) -> None:
        self.sim: Scheduler = machine.sim
        self.cluster: Cluster = machine.cluster
        self.referee: Referee = machine.referee
        self.root = machine.root
        self.nodes: list[Host] = list(machine.nodes)
        self.settings = settings
        self.faults = settings.faults
        self.faults_on = True
        self.outage = Outage()
        self.objects: dict[tuple[str, str, str], JobObject] = {}
        """(plural, namespace, name) -> the object, in creation order."""
        self.orphans: list[Pod] = []
        """Pods of objects deleted in the Background, until the garbage collector removes them."""
        self._version = 1000
        plane = self.sim.start_process("kube-controller", Host("eks", "boot-eks", "pid:[eks]"))
        plane.spawn("control", self._control)

    # ------------------------------------------------------------------------------ the controllers

    def _control(self) -> None:
        while True:
            self.sim.sleep(1.0)
            for key, obj in list(self.objects.items()):
                self._tick(key, obj)
            self.orphans = [pod for pod in self.orphans if not self._pod_removed(pod)]

    def _tick(self, key: tuple[str, str, str], obj: JobObject) -> None:
        now = self.sim.now
        if obj.deleting_since is not None:
            obj.pods = [pod for pod in obj.pods if not self._pod_removed(pod)]
            if not obj.pods:
                del self.objects[key]
                self._trace(f"{obj.name} ({obj.uid[:8]}) is gone: its pods are")
        elif obj.finished_at is not None:
            if now - obj.finished_at >= float(obj.run_policy.get("ttlSecondsAfterFinished", 0)):
                self._expire(key, obj)
        elif obj.run is None:
            if self._due(obj):
                self._start(obj)
        else:
            self._watch(obj)

    def _due(self, obj: JobObject) -> bool:
        """Whether a job waiting to run starts now: a restart once its backoff is over, a first start
        once scheduled, when no earlier object's terminating pod holds its pods' names."""
        now = self.sim.now
        if obj.restart_at is not None:
            return now >= obj.restart_at
        return now >= obj.start_after and self._pod_names_free(obj)

    def _watch(self, obj: JobObject) -> None:
        """A running object: its deadline, the log rule, and (while faults are on) a killed container."""
        run, now = obj.run, self.sim.now
        assert run is not None and obj.started_at is not None
        self._print_progress(obj, run)
        deadline = obj.run_policy.get("activeDeadlineSeconds")
        recur = self._recurring_s(obj)
        if obj.printed is None:  # no progress line yet: the rule's start cut-off, where it has one
            recur = self._start_cutoff_s(obj) or recur
        silent_since = obj.printed[0] if obj.printed is not None else run.started_at
        if deadline is not None and now - obj.started_at >= float(deadline):
            self._kill(obj, "activeDeadlineSeconds", code=143)
            self._fail(obj, "DeadlineExceeded", f"{obj.name} has run past its activeDeadlineSeconds")
        elif recur is not None and now - silent_since > recur:
            self._kill(obj, "hang detected", code=143)
            self._failed(obj, "HangDetected", f"no log line matched in {recur:.0f}s")
        elif self.faults_on and self.sim.choices.chance(self.faults.pod_killed_per_s):
            self.sim.trace.event(now, "fault", f"kubelet: {obj.name}'s container is OOMKilled")
            self._kill(obj, "OOMKilled", code=137)
            # The program's own death (the kernel's OOM killer), not a stop anyone asked for: the
            # ground truth has it exit 137, as a crash exits 1.
            run.exit_code = 137
            self._failed(obj, "OOMKilled", f"pod {obj.pods[0].name} exited with code 137")

    def _print_progress(self, obj: JobObject, run: JobRun) -> None:
        """The runtime's progress line, at a heartbeat, as ``tunepod.runtime.progress`` prints it."""
        now = self.sim.now
        every = obj.env.get(PROGRESS_LOG_S_ENV)
        if every is None or now < obj.next_beat or run.beating_at is None:  # printed from runtime.init
            return
        obj.next_beat += HEARTBEAT_S
        told = obj.printed
        if told is not None and (run.last_progress_at == told[1] or now - told[0] < float(every)):
            return
        obj.printed = (now, run.last_progress_at)
        latest = latest_checkpoint(JobPaths(obj.job_dir).checkpoints)
        line = f"{PROGRESS_LOG_PREFIX} rank 0 step {latest.step if latest is not None else '-'}"
        for pod in obj.pods:
            pod.log.append(line)

    def _recurring_s(self, obj: JobObject) -> float | None:
        """The shortest ``expectedRecurringFrequencyInSeconds`` of HyperPod's log rules that tunepod's
        progress lines feed (None: no such rule; Kubeflow has none)."""
        if obj.crd.kind != "HyperPodPyTorchJob":
            return None
        line = f"{PROGRESS_LOG_PREFIX} rank 0 step 1"
        rules = obj.run_policy.get("logMonitoringConfiguration") or []
        recurring = [
            float(rule["expectedRecurringFrequencyInSeconds"])
            for rule in rules
            if "expectedRecurringFrequencyInSeconds" in rule and re.fullmatch(str(rule["logPattern"]), line)
        ]
        return min(recurring, default=None)

    def _start_cutoff_s(self, obj: JobObject) -> float | None:
        """The ``expectedStartCutOffInSeconds`` of HyperPod's progress rule: how long a started job
        may go without its first progress line (None: no such rule)."""
        if obj.crd.kind != "HyperPodPyTorchJob":
            return None
        rules = obj.run_policy.get("logMonitoringConfiguration") or []
        cutoffs = [
            float(rule["expectedStartCutOffInSeconds"])
            for rule in rules
            if "expectedStartCutOffInSeconds" in rule
        ]
        return min(cutoffs, default=None)

    def _start(self, obj: JobObject) -> None:
        """The pods run (created the first time, their containers restarted after that)."""
        sim = self.sim
        obj.restart_at = None
        if not obj.pods:
            node = sim.choices.pick(self.nodes)
            obj.pods = [self._pod(obj, name, labels, node) for name, labels in _replicas(obj)]
        for pod in obj.pods:
            if pod.exit_code is not None:
                pod.restarts += 1
            pod.exit_code, pod.reason = None, ""
            pod.log.append(f"[{_iso(sim.now)}] torchrun: starting 1 worker (attempt {pod.restarts + 1})")
        obj.started_at = obj.started_at if obj.started_at is not None else sim.now
        obj.printed, obj.next_beat = None, sim.now + HEARTBEAT_S
        running = "PodsRunning" if obj.crd.kind == "HyperPodPyTorchJob" else "Running"
        self._condition(obj, running, "JobRunning", f"{obj.crd.kind} {obj.name} is running")
        obj.run = self.cluster.start(
            obj.job_dir, obj.run_id, obj.env, obj.pods[0].node, lambda run: self._exited(obj, run)
        )
        self.referee.job_started(obj.job_dir)

    def _pod(self, obj: JobObject, name: str, labels: dict[str, str], node: Host) -> Pod:
        owner = {
            "apiVersion": obj.body["apiVersion"],
            "kind": obj.crd.kind,
            "name": obj.name,
            "uid": obj.uid,
            "controller": True,
        }
        return Pod(name, _uid(), owner, labels, node, self.sim.now)

    def _exited(self, obj: JobObject, run: JobRun) -> None:
        """The program ended by itself: its pods' containers exit with its code."""
        if obj.run is not run:
            return
        code = run.exit_code or 0
        obj.run = None
        self._record(obj, code, "Completed" if code == 0 else "Error")
        if code == 0:
            done = "Completed" if obj.crd.kind == "HyperPodPyTorchJob" else "Succeeded"
            self._finish(obj, done, "JobSucceeded", f"{obj.crd.kind} {obj.name} successfully completed")
        else:
            self._failed(obj, "Error", f"pod {obj.pods[0].name} exited with code {code}")

    def _failed(self, obj: JobObject, reason: str, message: str) -> None:
        """A failed run: restarted in place while retries are left, else the object fails."""
        if obj.retries_left > 0:
            obj.retries_left -= 1
            obj.restart_at = self.sim.now + self.sim.choices.uniform(5.0, 30.0)
            self._condition(obj, "Restarting", reason, f"{obj.name} is restarting: {message}")
            self._trace(f"the operator restarts {obj.name} in place ({message})")
        else:
            self._fail(obj, reason, message)

    def _fail(self, obj: JobObject, reason: str, message: str) -> None:
        self._finish(obj, "Failed", reason, f"{obj.crd.kind} {obj.name} is failed: {message}")

    def _finish(self, obj: JobObject, kind: str, reason: str, message: str) -> None:
        obj.finished_at = self.sim.now
        self._condition(obj, kind, reason, message)
        self._trace(f"{obj.name} ({obj.uid[:8]}) {kind}: {message}")

    def _kill(self, obj: JobObject, why: str, *, code: int) -> None:
        """Stop the run's containers (SIGTERM, which the program does not trap): the exit wrapper,
        which forwards the signal, records ``code``."""
        run = obj.run
        if run is None:
            return
        obj.run = None
        self.cluster.kill(run, f"kubernetes: {why}")
        self._record(obj, code, why)

    def _record(self, obj: JobObject, code: int, reason: str) -> None:
        """Each pod's container ends with ``code``; its exit wrapper, if any, records it first (the
        shell writes before the container exits). Written here without a yield point: the pod's
        shell, not an orchestrator, and nothing may see the object between its run and its end."""
        for pod in obj.pods:
            pod.exit_code, pod.reason = code, reason
            pod.log.append(f"[{_iso(self.sim.now)}] training exited with code {code}")
            if obj.wrapper is not None:
                record = obj.wrapper.record(obj.env, pod.name)
                temporary = record.with_name(record.name + ".tmp")
                temporary.write_text(f"{code} {obj.env.get(SUBMISSION_ID_ENV, '')}\n")
                temporary.replace(record)

    def _condition(self, obj: JobObject, kind: str, reason: str, message: str) -> None:
        stamp = _iso(self.sim.now)
        for condition in obj.conditions:
            if (
                condition["type"] in ("Running", "PodsRunning", "Restarting")
                and condition["status"] == "True"
            ):
                condition.update(status="False", lastTransitionTime=stamp)
        obj.conditions.append(
            {
                "type": kind,
                "status": "True",
                "reason": reason,
                "message": message,
                "lastUpdateTime": stamp,
                "lastTransitionTime": stamp,
            }
        )
        self._bump(obj)

    def _expire(self, key: tuple[str, str, str], obj: JobObject) -> None:
        """ttlSecondsAfterFinished: the object is deleted (Background), its pods follow."""
        del self.objects[key]
        for pod in obj.pods:
            self._terminate(pod)
        self.orphans += obj.pods
        self._trace(f"{obj.name} ({obj.uid[:8]}) deleted by its ttlSecondsAfterFinished")

    def _terminate(self, pod: Pod) -> None:
        if pod.gone_at is None:
            pod.deleted_at = self.sim.now
            pod.gone_at = self.sim.now + self.sim.choices.uniform(0.5, 5.0)

    def _pod_removed(self, pod: Pod) -> bool:
        return pod.gone_at is not None and self.sim.now >= pod.gone_at

    def _pod_names_free(self, obj: JobObject) -> bool:
        """Whether no pod of an earlier object still holds a name this object's pods need."""
        names = [name for name, _ in _replicas(obj)]
        return not any(pod.name in names for pod in self._all_pods() if pod.owner["uid"] != obj.uid)

    def _all_pods(self) -> list[Pod]:
        return [pod for obj in self.objects.values() for pod in obj.pods] + self.orphans

    def _bump(self, obj: JobObject) -> None:
        """Every change of an object goes through here: a new resourceVersion, a new answer."""
        self._version += 1
        obj.meta["resourceVersion"] = str(self._version)
        obj.served = None

    def _trace(self, text: str) -> None:
        self.sim.trace.event(self.sim.now, "job", f"kube: {text}")

    # ------------------------------------------------------------------------------ the API

    def create(self, crd: Crd, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = str(body["metadata"]["name"])
        key = (crd.plural, namespace, name)
        if key in self.objects:
            raise _Answered(409, "AlreadyExists", f'{crd.resource} "{name}" already exists')
        created = copy.deepcopy(dict(body))
        created["metadata"].update(
            namespace=namespace, uid=_uid(), creationTimestamp=_iso(self.sim.now), generation=1
        )
        env = _container_env(created)
        job_dir = _job_dir(env)
        live = [obj.run_id for obj in self.objects.values() if obj.job_dir == job_dir and not obj.finished]
        self.referee.job_created(job_dir, live)
        obj = JobObject(
            crd,
            created,
            job_dir,
            env,
            _exit_wrapper(created),
            retries_left=_retries(crd, created),
            start_after=self.sim.now + self.sim.choices.uniform(0.0, 20.0),
        )
        self._condition(obj, "Created", "JobCreated", f"{crd.kind} {name} is created")
        self.objects[key] = obj
        self.cluster.created[job_dir] = self.cluster.created.get(job_dir, 0) + 1
        self._trace(f"{name} ({obj.uid[:8]}, {job_dir.name}) created by {self.sim.process}")
        return self.answer(obj)

    def get(self, crd: Crd, namespace: str, name: str) -> dict[str, Any]:
        return self.answer(self._named(crd, namespace, name))

    def listed(self, crd: Crd, namespace: str, selector: str) -> list[dict[str, Any]]:
        wanted = _selector(selector)
        return [
            self.answer(obj)
            for (plural, ns, _), obj in self.objects.items()
            if (plural, ns) == (crd.plural, namespace) and wanted.items() <= _labels(obj.meta).items()
        ]

    def delete(self, ref: ObjectRef) -> bool:
        """Foreground: the object stays, marked, until its pods are gone; its run is stopped now.
        True: the call took effect (the API answers with the object, marked)."""
        obj = self._named(ref.crd, ref.namespace, ref.name)
        if obj.uid != ref.uid:
            message = f"Precondition failed: UID in precondition: {ref.uid}, UID in object meta: {obj.uid}"
            raise _Answered(409, "Conflict", message)
        if obj.deleting_since is not None:
            return True
        if not obj.finished:
            self.referee.stop_requested(obj.job_dir, obj.run_id)
        self._trace(f"delete {obj.name} ({obj.uid[:8]}) by {self.sim.process}")
        obj.deleting_since = self.sim.now
        obj.meta["deletionTimestamp"] = _iso(self.sim.now)
        obj.meta["finalizers"] = ["foregroundDeletion"]
        self._bump(obj)
        self._kill(obj, "deleted", code=143)
        for pod in obj.pods:
            self._terminate(pod)
        return True

    def pods_labelled(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        wanted = _selector(selector)
        return [
            _pod_answer(pod, namespace) for pod in self._all_pods() if wanted.items() <= pod.labels.items()
        ]

    def pod_log(self, name: str, tail: int) -> str:
        found = [pod for pod in self._all_pods() if pod.name == name]
        if not found:
            raise _Answered(404, "NotFound", f'pods "{name}" not found')
        return "".join(line + "\n" for line in found[-1].log[-tail:])

    def answer(self, obj: JobObject) -> dict[str, Any]:
        """The object as a GET returns it: a copy of its own (decoded from the JSON kept since its last
        change, several times faster than a deep copy, which every poll would pay)."""
        if obj.served is None:
            obj.served = json.dumps({**obj.body, "status": {"conditions": obj.conditions}})
        answer: dict[str, Any] = json.loads(obj.served)
        return answer

    def _named(self, crd: Crd, namespace: str, name: str) -> JobObject:
        obj = self.objects.get((crd.plural, namespace, name))
        if obj is None:
            raise _Answered(404, "NotFound", f'{crd.resource} "{name}" not found')
        return obj

    # ------------------------------------------------------------------------------ a call

    def call(self, doing: str) -> None:
        """What every call meets before it takes effect: the network, and a busy API server."""
        sim = self.sim
        sim.takes(f"kube {doing}", sim.latency.api)
        if not (self.faults_on and (self.outage.on(sim) or sim.choices.chance(self.faults.transient))):
            return
        sim.trace.event(sim.now, "fault", f"{sim.process}: kube {doing.split(' ')[0]} is refused")
        if self.outage.on(sim) or sim.choices.chance(0.25):  # the API server restarting: nothing listens
            raise TransientError(
                f"could not {doing}: the Kubernetes API did not answer (NewConnectionError: Failed to "
                "establish a new connection: [Errno 111] Connection refused)"
            )
        raise _Answered(*sim.choices.pick(list(_BUSY)))

    def reply(self, doing: str) -> None:
        """After a create or delete took effect: its reply may be lost, the connection dropped at once
        or the client's read timeout spent waiting for it (the job may run meanwhile)."""
        sim = self.sim
        if not (self.faults_on and sim.choices.chance(self.faults.lost_reply)):
            return
        verb = doing.split(" ")[0]
        sim.trace.event(sim.now, "fault", f"{sim.process}: kube {verb} took effect; its reply is lost")
        self.outage.begins(sim, self.faults)
        if sim.choices.chance(0.5):
            raise TransientError(
                f"could not {doing}: the Kubernetes API did not answer (('Connection aborted.', "
                "RemoteDisconnected('Remote end closed connection without response')))"
            )
        sim.sleep(REQUEST_TIMEOUT_S[1])
        raise TransientError(
            f"could not {doing}: the Kubernetes API did not answer (HTTPSConnectionPool: Read timed out. "
            f"(read timeout={REQUEST_TIMEOUT_S[1]:g}))"
        )


class SimKubeApi(KubeApi):
    """The launcher's ``KubeApi`` over the simulated API server: each call returns or raises what
    ``KubeApi`` does for the server's answer (``get_referenced`` is ``KubeApi``'s own)."""

    def __init__(self, server: KubeServer) -> None:  # no kubernetes client: nothing of KubeApi's own
        self.server = server

    def list_objects(self, crd: Crd, namespace: str) -> list[dict[str, Any]]:
        doing = f"list {crd.resource} in namespace {namespace}"
        return self._sent(doing, lambda: self.server.listed(crd, namespace, MANAGED_SELECTOR)) or []

    def get_object(self, crd: Crd, namespace: str, name: str) -> dict[str, Any] | None:
        doing = f"get {crd.resource} {namespace}/{name}"
        return self._sent(doing, lambda: self.server.get(crd, namespace, name), missing_ok=True)

    def create_object(self, crd: Crd, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        doing = f"create {crd.resource} {namespace}/{body['metadata']['name']}"
        created = self._sent(doing, lambda: self.server.create(crd, namespace, body))
        assert created is not None
        self.server.reply(doing)
        return created

    def delete_object(self, ref: ObjectRef) -> None:
        doing = f"delete {ref.crd.resource} {ref.namespace}/{ref.name}"
        if self._sent(doing, lambda: self.server.delete(ref), missing_ok=True, conflict_ok=True):
            self.server.reply(doing)

    def list_pods(self, ref: ObjectRef) -> list[dict[str, Any]]:
        doing = f"list the pods of {ref.title}"
        selector = f"{MANAGED_SELECTOR},{OBJECT_LABEL}={ref.name}"
        pods = self._sent(doing, lambda: self.server.pods_labelled(ref.namespace, selector)) or []
        # As KubeApi keeps them: the pods this uid owns (an earlier object's may carry the same labels).
        return [
            pod for pod in pods if any(o.get("uid") == ref.uid for o in pod["metadata"]["ownerReferences"])
        ]

    def pod_log(self, namespace: str, pod: str, container: str | None, tail: int) -> str:
        doing = f"read the log of pod {namespace}/{pod}"
        return self._sent(doing, lambda: self.server.pod_log(pod, tail)) or ""

    def _sent(
        self, doing: str, action: Callable[[], T], *, missing_ok: bool = False, conflict_ok: bool = False
    ) -> T | None:
        """``action()`` on the server after the call's trip; None for a 404/409 the call tolerates;
        an error answer as ``KubeApi._call`` translates it."""
        try:
            self.server.call(doing)
            return action()
        except _Answered as answered:
            if (answered.status == 404 and missing_ok) or (answered.status == 409 and conflict_ok):
                return None
            raise api_error(answered, doing) from None


# ---------------------------------------------------------------------------------- errors


class _Answered(Exception):
    """An error answer, with what ``api_error`` reads of the kubernetes client's ``ApiException``:
    its status, reason and ``Status`` body."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"({status}) Reason: {reason}")
        self.status = status
        self.reason = reason
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": status}
        self.body = json.dumps(body).encode()


# ---------------------------------------------------------------------------------- the objects


def _uid() -> str:
    """A uid as Kubernetes makes them (a random UUID), from the seed."""
    # Part by part: the seed's ids vary in their low digits.
    parts = [world.token_hex(nbytes) for nbytes in (4, 2, 2, 2, 6)]
    return f"{parts[0]}-{parts[1]}-4{parts[2][1:]}-a{parts[3][1:]}-{parts[4]}"


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _labels(meta: Mapping[str, Any]) -> dict[str, str]:
    return dict(meta.get("labels") or {})


def _selector(text: str) -> dict[str, str]:
    """An equality label selector (``a=b,c=d``), the only kind the launcher sends."""
    wanted = {}
    for term in filter(None, text.split(",")):
        key, sep, value = term.partition("=")
        assert sep, f"the simulated API server understands key=value selectors only, not {term!r}"
        wanted[key] = value
    return wanted


def _template(body: Mapping[str, Any]) -> dict[str, Any]:
    spec = body["spec"]
    if "replicaSpecs" in spec:
        template: dict[str, Any] = spec["replicaSpecs"][0]["template"]
    else:
        template = next(iter(spec["pytorchReplicaSpecs"].values()))["template"]
    return template


def _container(body: Mapping[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = _template(body)["spec"]["containers"][0]
    return container


def _container_env(body: Mapping[str, Any]) -> dict[str, str]:
    """The container's inline env as the kubelet sets it (``$(VAR)`` and ``$$`` expanded); a
    ``valueFrom`` entry is left out (none of the training contract is one)."""
    env: dict[str, str] = {}
    for var in _container(body).get("env") or []:
        if "value" in var:
            env[var["name"]] = _expand(str(var["value"]), env)
    return env


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion: ``$$`` -> ``$``, ``$(NAME)`` -> its value when defined, else kept."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def _job_dir(env: Mapping[str, str]) -> Path:
    """The job dir the program writes: its contract's folders must be one job dir's."""
    contract = read_contract(env, cwd=Path("/nonexistent"))
    job_dir = contract.checkpoint_dir.parent
    paths = JobPaths(job_dir)
    wanted = (paths.checkpoints, paths.metrics, paths.result)
    assert (contract.checkpoint_dir, contract.metrics_file, contract.result_file) == wanted, contract
    return job_dir


@dataclass(frozen=True)
class ExitWrapper:
    """What the shell of a ``/bin/sh -c SCRIPT`` command needs to record an exit code: the script's
    variable assignments, the path its ``mv`` writes, and the env variable holding the pod's name."""

    assignments: tuple[tuple[str, str], ...]
    target: str
    pod_name_env: str | None

    def record(self, env: Mapping[str, str], pod: str) -> Path:
        """The record file of ``pod``, its variables expanded as the shell does."""
        values = dict(env)
        if self.pod_name_env is not None:
            values[self.pod_name_env] = pod
        for name, value in self.assignments:
            values[name] = _shell_expand(value, values)
        return Path(_shell_expand(self.target, values))


def _exit_wrapper(body: Mapping[str, Any]) -> ExitWrapper | None:
    """The command's exit wrapper, read from its script (None: the command is not ``sh -c``)."""
    container = _container(body)
    command = [_expand(str(part), {}) for part in container.get("command") or []]
    if command[:2] != ["/bin/sh", "-c"]:
        return None
    lines = command[2].splitlines()
    assignments = tuple(
        (name, shlex.split(value)[0])
        for name, _, value in (line.partition("=") for line in lines)
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
    )
    moves = [part for line in lines for part in line.split("&&") if part.strip().startswith("mv ")]
    assert len(moves) == 1, f"the twin reads one mv in an exit wrapper, not {moves}"
    downward = [
        str(var["name"])
        for var in container.get("env") or []
        if (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "metadata.name"
    ]
    return ExitWrapper(assignments, shlex.split(moves[0])[-1], downward[-1] if downward else None)


def _shell_expand(text: str, values: Mapping[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` as a shell expands them (an unset one is empty)."""
    return re.sub(
        r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)",
        lambda m: values.get(m.group(1) or m.group(2), ""),
        text,
    )


def _retries(crd: Crd, body: Mapping[str, Any]) -> int:
    """How often the operator restarts a failed job in place."""
    spec = body["spec"]
    policy = spec.get("runPolicy") or {}
    if crd.kind == "HyperPodPyTorchJob":
        return int(policy.get("jobMaxRetryCount", 0))
    replicas = spec["pytorchReplicaSpecs"].values()
    on_failure = all(replica.get("restartPolicy") == "OnFailure" for replica in replicas)
    return int(policy.get("backoffLimit", 0)) if on_failure else 0


def _replicas(obj: JobObject) -> list[tuple[str, dict[str, str]]]:
    """(pod name, labels) of every pod the operator makes for ``obj``."""
    spec = obj.body["spec"]
    if "replicaSpecs" in spec:
        return [
            (f"{obj.name}-pod-{index}", _labels(replica["template"]["metadata"]))
            for replica in spec["replicaSpecs"]
            for index in range(int(replica.get("replicas", 1)))
        ]
    pods = []
    for kind, replica in spec["pytorchReplicaSpecs"].items():
        for index in range(int(replica.get("replicas", 1))):
            labels = _labels(replica["template"]["metadata"]) | {
                "training.kubeflow.org/job-name": obj.name,
                "training.kubeflow.org/replica-type": kind.lower(),
                "training.kubeflow.org/replica-index": str(index),
            }
            pods.append((f"{obj.name}-{kind.lower()}-{index}", labels))
    return pods


def _pod_answer(pod: Pod, namespace: str) -> dict[str, Any]:
    """A pod as the API lists it."""
    if pod.exit_code is None:
        state: dict[str, Any] = {"running": {"startedAt": _iso(pod.created_at)}}
    else:
        state = {"terminated": {"exitCode": pod.exit_code, "reason": pod.reason}}
    metadata: dict[str, Any] = {
        "name": pod.name,
        "namespace": namespace,
        "uid": pod.uid,
        "labels": dict(pod.labels),
        "ownerReferences": [dict(pod.owner)],
        "creationTimestamp": _iso(pod.created_at),
    }
    if pod.deleted_at is not None:
        metadata["deletionTimestamp"] = _iso(pod.deleted_at)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "pytorch"}], "nodeName": pod.node.name},
        "status": {
            "phase": pod.phase,
            "containerStatuses": [{"name": "pytorch", "restartCount": pod.restarts, "state": state}],
        },
    }
