"""The custom object a HyperPod EKS job runs as (pure): a ``HyperPodPyTorchJob``, or a Kubeflow
``PyTorchJob`` with ``crd: kubeflow``. Golden-tested, and validated against the HyperPod CRD's JSON
schema in the tests; this module never imports ``kubernetes``.

How the workers start differs per operator, and the manifest follows each one's convention:

- HyperPod: the operator talks to the HyperPod elastic agent inside every pod; AWS requires the image
  to install ``hyperpod-elastic-agent`` and to start training with ``hyperpodrun`` (torchrun's
  arguments plus the agent's). The operator supplies the rendezvous, so the command names only the
  node count, the processes per node (also ``spec.nprocPerNode``) and the script.
- Kubeflow: the training operator injects ``PET_MASTER_ADDR``/``PET_MASTER_PORT``/``PET_NODE_RANK``
  (or ``PET_RDZV_ENDPOINT`` under an ``elasticPolicy``), which ``torch.distributed.run`` reads as the
  defaults of its own flags; the command is plain ``python -m torch.distributed.run``.

Every pod mounts the shared filesystem's PersistentVolumeClaim at ``spec.root``, so the job dir,
checkpoints and result file of a job live on FSx where the orchestrator reads them. The job's output
goes to the pod log (HyperPod's hang detection reads it there), not to files under the job dir.

The container's command is the training command under ``exits.exit_recorder``, a shell that records
each pod's exit code in the job dir, so that a job whose object ``ttlSecondsAfterFinished`` deleted
is still told from a failed one.

The variables of ``spec.secret_env`` are rendered as ``secretKeyRef``: their values stay in the
Kubernetes Secret and never enter the object (which anyone who may read the job objects can read),
nor ``manifest.json``.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from tunepod.launch.base import SUBMISSION_ID_ENV, JobSpec, Resources
from tunepod.launch.hyperpod_eks.exits import exit_recorder, pod_name_env
from tunepod.launch.refusals import refuse
from tunepod.launch.watchdog import Limits
from tunepod.runtime.progress import PROGRESS_LOG_PREFIX, PROGRESS_LOG_S_ENV
from tunepod.spec.models import HyperPodEksLauncherSpec

HYPERPOD_GROUP = "sagemaker.amazonaws.com"
HYPERPOD_VERSION = "v1"
HYPERPOD_PLURAL = "hyperpodpytorchjobs"
HYPERPOD_KIND = "HyperPodPyTorchJob"
KUBEFLOW_GROUP = "kubeflow.org"
KUBEFLOW_VERSION = "v1"
KUBEFLOW_PLURAL = "pytorchjobs"
KUBEFLOW_KIND = "PyTorchJob"

CONTAINER_NAME = "pytorch"  # Kubeflow's operator finds the training container by this name.
SHARED_VOLUME = "shared"
SHM_VOLUME = "dshm"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
OBJECT_LABEL = "tunepod.io/object"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
JOB_NAME_ANNOTATION = "tunepod.io/job-name"
JOB_DIR_ANNOTATION = "tunepod.io/job-dir"
SUBMISSION_ANNOTATION = "tunepod.io/submission"
PROGRESS_RULE_NAME = "tunepod-progress"
# Not re.escape: the operator compiles a Go regexp, which refuses an escaped space; the prefix has
# no metacharacters.
PROGRESS_LOG_PATTERN = f".*{PROGRESS_LOG_PREFIX}.*"
PROGRESS_LOG_MAX_S = 60.0
"""The submission id of the attempt that created the object: how ``find`` tells it from an object an
earlier attempt left under the same name."""

# Room left under the 63-character DNS label limit for what the operators append to make pod and
# service names (``-worker-12``, ``-pod-12``).
MAX_NAME_LENGTH = 50
_NAME_HASH_LENGTH = 8
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ------------------------------------------------------------------------------------------ names


def object_name(job_name: str) -> str:
    """A DNS-1035 label for ``job_name``: stable (the same job name always gives the same object),
    unique (two names that clean up alike differ in their hash suffix), at most ``MAX_NAME_LENGTH``.

    DNS-1035 rather than DNS-1123: Kubeflow names Services after the job, and those must start with
    a letter.
    """
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:_NAME_HASH_LENGTH]
    cleaned = re.sub(r"[^a-z0-9]+", "-", job_name.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"j-{cleaned}".rstrip("-")
    stem = cleaned[: MAX_NAME_LENGTH - _NAME_HASH_LENGTH - 1].rstrip("-")
    return f"{stem}-{digest}"


# ------------------------------------------------------------------------------------------ env


def literal(text: str) -> str:
    """``text`` safe from Kubernetes' ``$(VAR)`` expansion in command, args and env values.

    Kubernetes turns ``$$`` into ``$`` and ``$(NAME)`` into a variable's value; doubling every ``$``
    therefore always yields the original text.
    """
    return text.replace("$", "$$")


def container_env(job: JobSpec, spec: HyperPodEksLauncherSpec) -> list[dict[str, Any]]:
    """The launcher's ``env``, then the job's training contract (which wins), as inline EnvVar entries;
    then ``spec.secret_env`` as ``secretKeyRef`` entries, which win over both: a variable named there
    is never inline, even when the job's own environment sets it (tracking credentials in
    ``MLFLOW_TRACKING_URI``, say)."""
    inline = {name: value for name, value in {**spec.env, **job.env}.items() if name not in spec.secret_env}
    for name in [*inline, *spec.secret_env]:
        if not _ENV_NAME.fullmatch(name):
            refuse(
                f"environment variable name {name!r} of job {job.name!r} is not a C identifier, which "
                "Kubernetes requires; fix: rename it"
            )
    from_secrets = [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
        for name, ref in spec.secret_env.items()
    ]
    return [*({"name": name, "value": literal(value)} for name, value in inline.items()), *from_secrets]


# ------------------------------------------------------------------------------------------ resources


def format_memory(mem_gb: float) -> str:
    """A memory quantity: whole GiB as ``NGi``, anything else rounded up to MiB."""
    return f"{int(mem_gb)}Gi" if float(mem_gb).is_integer() else f"{math.ceil(mem_gb * 1024)}Mi"


def format_cpu(cpus: float) -> str:
    """A CPU quantity: whole CPUs as ``N``, fractions in millicores (``1500m``)."""
    return str(int(cpus)) if float(cpus).is_integer() else f"{math.ceil(cpus * 1000)}m"


def pod_resources(resources: Resources, spec: HyperPodEksLauncherSpec) -> dict[str, dict[str, str]]:
    """Requests equal to limits: extended resources (GPUs, EFA) must be, and equal cpu/memory give the
    pods Guaranteed QoS, the last to be evicted under node pressure."""
    amounts: dict[str, str] = {}
    if spec.cpus_per_node is not None:
        amounts["cpu"] = format_cpu(spec.cpus_per_node)
    if spec.mem_gb is not None:
        amounts["memory"] = format_memory(spec.mem_gb)
    if resources.gpus_per_node > 0:
        amounts["nvidia.com/gpu"] = str(resources.gpus_per_node)
    if spec.efa_per_node > 0:
        amounts["vpc.amazonaws.com/efa"] = str(spec.efa_per_node)
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def active_deadline_s(resources: Resources) -> int | None:
    """``timeout_min`` as whole seconds, rounded up, for the run policy's ``activeDeadlineSeconds``."""
    return None if resources.timeout_min is None else math.ceil(resources.timeout_min * 60)


def ignored_settings(spec: HyperPodEksLauncherSpec) -> dict[str, str]:
    """Settings of ``spec`` that its ``crd`` cannot honour, keyed by field (the launcher warns once)."""
    if spec.crd == "hyperpod":
        return {"elastic": "elastic=true ignored: it applies to crd: kubeflow only"} if spec.elastic else {}
    hyperpod_only = {
        "hang_detection": bool(spec.hang_detection),
        "restart_eval_period_s": spec.restart_eval_period_s is not None,
        "max_full_job_restarts": spec.max_full_job_restarts is not None,
    }
    return {
        field: f"{field} ignored: it is a HyperPod training operator setting and crd is kubeflow"
        for field, is_set in hyperpod_only.items()
        if is_set
    }


# ------------------------------------------------------------------------------------------ pod


def _check_under_root(job: JobSpec, spec: HyperPodEksLauncherSpec) -> None:
    root = PurePosixPath(spec.root)
    if not root.is_absolute():
        refuse(f"launcher root {spec.root!r} must be an absolute path (the claim's mount path)")
        return
    for what, path, fix in (
        ("job dir", job.job_dir, "put job dirs under root"),
        ("entrypoint", job.entrypoint, f"run tunepod from a checkout under {root} (e.g. {root}/src)"),
    ):
        posix = PurePosixPath(path.as_posix())
        if not posix.is_relative_to(root):
            refuse(
                f"{what} {posix} of job {job.name!r} is outside the launcher root {root}, so the pods "
                f"(which mount claim {spec.claim_name!r} at {root}) would not see it; fix: {fix}"
            )


def training_command(job: JobSpec, spec: HyperPodEksLauncherSpec) -> list[str]:
    """The container command (see the module docstring for why it differs per operator)."""
    res = job.resources
    script = [literal(str(job.entrypoint)), *(literal(arg) for arg in job.args)]
    if spec.crd == "hyperpod":
        return [
            "hyperpodrun",
            f"--nnodes={res.nnodes}",
            f"--nproc-per-node={res.procs_per_node}",
            *script,
        ]
    low, high = elastic_replicas(res)
    nnodes = f"{low}:{high}" if _kubeflow_elastic(res, spec) else str(res.num_nodes)
    return [
        literal(spec.python),
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={res.procs_per_node}",
        *script,
    ]


def elastic_replicas(resources: Resources) -> tuple[int, int]:
    """(min, max) pods of an elastic job: ``min_nodes`` (else ``num_nodes``) to ``num_nodes``."""
    return resources.min_nodes or resources.num_nodes, resources.num_nodes


def _kubeflow_elastic(resources: Resources, spec: HyperPodEksLauncherSpec) -> bool:
    """Kubeflow renders an ``elasticPolicy`` for an elastic job, or whenever the launcher asks."""
    return spec.elastic or resources.elastic


def _container(job: JobSpec, spec: HyperPodEksLauncherSpec) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": [*exit_recorder(job.job_dir), *training_command(job, spec)],
        "env": [*container_env(job, spec), pod_name_env()],
        "volumeMounts": [
            {"name": SHARED_VOLUME, "mountPath": spec.root},
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
        ],
    }
    if spec.working_dir is not None:
        container["workingDir"] = spec.working_dir
    resources = pod_resources(job.resources, spec)
    if resources:
        container["resources"] = resources
    return container


def pod_template(job: JobSpec, spec: HyperPodEksLauncherSpec, labels: Mapping[str, str]) -> dict[str, Any]:
    """The pod template shared by every replica of ``job``."""
    pod: dict[str, Any] = {
        "containers": [_container(job, spec)],
        "volumes": [
            {"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": spec.claim_name}},
            # The default 64 MB /dev/shm of a container is too small for DataLoader workers and NCCL.
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
        ],
    }
    if job.resources.stop_grace_s is not None:
        # SIGTERM on a stop, an eviction or a node drain, then this long to checkpoint before SIGKILL.
        pod["terminationGracePeriodSeconds"] = job.resources.stop_grace_s
    node_selector = dict(spec.node_selector)
    if job.resources.instance_type is not None:
        node_selector[INSTANCE_TYPE_LABEL] = job.resources.instance_type
    if node_selector:
        pod["nodeSelector"] = node_selector
    if spec.service_account is not None:
        pod["serviceAccountName"] = spec.service_account
    return {"metadata": {"labels": dict(labels)}, "spec": pod}


def pod_labels(job: JobSpec) -> dict[str, str]:
    """Labels of the pods: ours only, so that ``logs`` finds a job's pods by label."""
    return {MANAGED_BY_LABEL: "tunepod", OBJECT_LABEL: object_name(job.name)}


def object_labels(job: JobSpec, spec: HyperPodEksLauncherSpec) -> dict[str, str]:
    """Labels of the job object: the pods' labels, and Kueue's queue and priority when set.

    Kueue's labels stay off the pod template: where Kueue's plain-pod integration is on, it would
    queue every pod as a workload of its own on top of the job's.
    """
    labels = pod_labels(job)
    if spec.queue_name is not None:
        labels[QUEUE_LABEL] = spec.queue_name
    if spec.priority_class is not None:
        labels[PRIORITY_LABEL] = spec.priority_class
    return labels


def object_annotations(job: JobSpec) -> dict[str, str]:
    """The full job name and job dir, unabridged: a restarted orchestrator matches objects to job dirs
    by these, and an operator reading ``kubectl describe`` sees where the files are. Plus the attempt's
    submission id when the job carries one (a job rendered outside a launcher has none)."""
    annotations = {JOB_NAME_ANNOTATION: job.name, JOB_DIR_ANNOTATION: job.job_dir.as_posix()}
    if SUBMISSION_ID_ENV in job.env:
        annotations[SUBMISSION_ANNOTATION] = job.env[SUBMISSION_ID_ENV]
    return annotations


def _metadata(job: JobSpec, spec: HyperPodEksLauncherSpec) -> dict[str, Any]:
    return {
        "name": object_name(job.name),
        "namespace": spec.namespace,
        "labels": object_labels(job, spec),
        "annotations": object_annotations(job),
    }


# ------------------------------------------------------------------------------------------ HyperPod

# Finished pods are kept (they hold no accelerators once their containers have exited) until the job's
# TTL or a cancel deletes the job: the launcher reads a failed job's log and exit codes from them.
CLEAN_POD_POLICY = "None"


def progress_rule(limits: Limits) -> dict[str, Any] | None:
    """The operator's own hang rule, from the same settings as tunepod's watchdog: the runtime prints
    a progress line at start and while the loop advances (``TUNEPOD_PROGRESS_LOG_S``), so the operator
    restarts a silent job in place without waiting for tunepod."""
    if limits.hang_timeout_s is None and limits.startup_timeout_s is None:
        return None
    rule: dict[str, Any] = {"name": PROGRESS_RULE_NAME, "logPattern": PROGRESS_LOG_PATTERN}
    if limits.startup_timeout_s is not None:
        rule["expectedStartCutOffInSeconds"] = math.ceil(limits.startup_timeout_s)
    if limits.hang_timeout_s is not None:
        rule["expectedRecurringFrequencyInSeconds"] = math.ceil(limits.hang_timeout_s)
    return rule


def progress_log_every_s(limits: Limits) -> float:
    """How often the runtime prints progress: well inside the recurring window, at most once a minute."""
    hang_s = limits.hang_timeout_s
    return PROGRESS_LOG_MAX_S if hang_s is None else max(1.0, min(PROGRESS_LOG_MAX_S, hang_s / 4))


def _log_monitoring(job: JobSpec, spec: HyperPodEksLauncherSpec) -> list[dict[str, Any]]:
    rules = []
    for rule in spec.hang_detection:
        entry: dict[str, Any] = {"name": rule.name, "logPattern": rule.log_pattern}
        if rule.stop_pattern is not None:
            entry["stopPattern"] = rule.stop_pattern
        if rule.start_within_s is not None:
            entry["expectedStartCutOffInSeconds"] = rule.start_within_s
        if rule.recur_within_s is not None:
            entry["expectedRecurringFrequencyInSeconds"] = rule.recur_within_s
        rules.append(entry)
    progress = progress_rule(job.limits)
    return rules if progress is None else [*rules, progress]


def hyperpod_run_policy(job: JobSpec, spec: HyperPodEksLauncherSpec) -> dict[str, Any]:
    """``runPolicy``: retries, the TTL that keeps a finished job readable, limits, hang detection."""
    # The operator's default TTL of 0 deletes a finished job at once, and its final state with it.
    policy: dict[str, Any] = {
        "cleanPodPolicy": CLEAN_POD_POLICY,
        "jobMaxRetryCount": spec.max_retries,
        "ttlSecondsAfterFinished": spec.ttl_after_finished_s,
    }
    deadline = active_deadline_s(job.resources)
    if deadline is not None:
        policy["activeDeadlineSeconds"] = deadline
    if spec.restart_eval_period_s is not None:
        restart: dict[str, Any] = {"evalPeriodSeconds": spec.restart_eval_period_s}
        if spec.max_full_job_restarts is not None:
            restart["maxFullJobRestarts"] = spec.max_full_job_restarts
        policy["restartPolicy"] = restart
    rules = _log_monitoring(job, spec)
    if rules:
        policy["logMonitoringConfiguration"] = rules
    return policy


def render_hyperpod(job: JobSpec, spec: HyperPodEksLauncherSpec) -> dict[str, Any]:
    """The ``HyperPodPyTorchJob`` for ``job`` (pure). An elastic job (``resources.min_nodes``) gets
    the operator's ``elasticPolicy`` with the same bounds as ``hyperpodrun --nnodes=min:max``: the
    operator, not tunepod, shrinks the job to the pods that are left."""
    if progress_rule(job.limits) is not None:
        job = job.with_env({PROGRESS_LOG_S_ENV: f"{progress_log_every_s(job.limits):g}"})
    elastic: dict[str, Any] = {}
    if job.resources.elastic:
        low, high = elastic_replicas(job.resources)
        elastic["elasticPolicy"] = {"minReplicas": low, "maxReplicas": high}
    return {
        "apiVersion": f"{HYPERPOD_GROUP}/{HYPERPOD_VERSION}",
        "kind": HYPERPOD_KIND,
        "metadata": _metadata(job, spec),
        "spec": {
            **elastic,
            # A string in the CRD: it also takes "auto", "cpu" and "gpu".
            "nprocPerNode": str(job.resources.procs_per_node),
            "replicaSpecs": [
                {
                    "name": "pods",
                    "replicas": job.resources.num_nodes,
                    "template": pod_template(job, spec, pod_labels(job)),
                }
            ],
            "runPolicy": hyperpod_run_policy(job, spec),
        },
    }


# ------------------------------------------------------------------------------------------ Kubeflow


def _kubeflow_replica(replicas: int, template: dict[str, Any], max_retries: int) -> dict[str, Any]:
    # OnFailure restarts a failed pod in place (counted against backoffLimit); Never fails the job.
    restart = "OnFailure" if max_retries > 0 else "Never"
    return {"replicas": replicas, "restartPolicy": restart, "template": template}


def render_kubeflow(job: JobSpec, spec: HyperPodEksLauncherSpec) -> dict[str, Any]:
    """The Kubeflow ``PyTorchJob`` for ``job`` (pure): Master + Workers, or Workers under an
    ``elasticPolicy`` whose c10d rendezvous the operator points every pod at (for an elastic job, or
    with the launcher's ``elastic``), from ``min_nodes`` (else ``num_nodes``) to ``num_nodes`` pods."""
    res = job.resources
    template = pod_template(job, spec, pod_labels(job))
    run_policy: dict[str, Any] = {
        "cleanPodPolicy": CLEAN_POD_POLICY,
        "backoffLimit": spec.max_retries,
        "ttlSecondsAfterFinished": spec.ttl_after_finished_s,
    }
    deadline = active_deadline_s(res)
    if deadline is not None:
        run_policy["activeDeadlineSeconds"] = deadline
    body: dict[str, Any] = {"nprocPerNode": str(res.procs_per_node), "runPolicy": run_policy}
    if _kubeflow_elastic(res, spec):
        low, high = elastic_replicas(res)
        body["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "minReplicas": low,
            "maxReplicas": high,
            # torchrun's --max-restarts: at least one re-forming per pod the job may lose.
            "maxRestarts": max(spec.max_retries, res.elastic_restarts),
        }
        body["pytorchReplicaSpecs"] = {"Worker": _kubeflow_replica(res.num_nodes, template, spec.max_retries)}
    else:
        replicas = {"Master": _kubeflow_replica(1, template, spec.max_retries)}
        if res.num_nodes > 1:
            replicas["Worker"] = _kubeflow_replica(res.num_nodes - 1, template, spec.max_retries)
        body["pytorchReplicaSpecs"] = replicas
    return {
        "apiVersion": f"{KUBEFLOW_GROUP}/{KUBEFLOW_VERSION}",
        "kind": KUBEFLOW_KIND,
        "metadata": _metadata(job, spec),
        "spec": body,
    }


def render_manifest(job: JobSpec, spec: HyperPodEksLauncherSpec) -> dict[str, Any]:
    """The custom object that runs ``job`` under ``spec.crd`` (pure). Refuses (``refuse``) a job the
    pods could not run (a job dir outside the shared root, an invalid variable name)."""
    _check_under_root(job, spec)
    return render_hyperpod(job, spec) if spec.crd == "hyperpod" else render_kubeflow(job, spec)
