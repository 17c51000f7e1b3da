"""Pydantic models of the pipeline spec: one YAML file declares the steps and how they connect.

Every model forbids unknown keys, so a typo is an error that lists the valid keys instead of a setting
that silently does nothing. Cross-field checks say how to fix what they reject.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tunepod.runtime.tiers import DEFAULT_MEMORY_DIR, CheckpointTiers
from tunepod.spec.parallelism import ParallelismSpec, check_space, job_layout
from tunepod.spec.resources import Resources
from tunepod.stores import browsable, is_postgres, redacted, secret_values


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        # A spec's repr lands in logs and tracebacks: its store URIs show as tunepod shows them anywhere.
        for name, value in super().__repr_args__():
            yield name, redacted(value) if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------------- names

#: The characters of a pipeline's and a study's name.
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
NAME_CHARACTERS = "letters, digits, '_', '-' and '.', and not '.' or '..' alone"


def folder_problem(name: str) -> str | None:
    """Why ``name`` cannot be one folder under ``<root>/jobs`` (the job dirs are ``<root>/jobs/<study>/``
    and ``<root>/jobs/<pipeline>/<step>/``): ``.``, ``..``, empty, or holding a ``/``, a ``\\`` or a
    NUL, it would name another folder (``..`` the one above), or none; None when it can."""
    if name in ("", ".", "..") or any(separator in name for separator in "/\\\0"):
        return f"{name!r} cannot name a folder of job dirs: it would not be one folder under <root>/jobs"
    return None


def _one_folder(name: str) -> str:
    problem = folder_problem(name)
    if problem is not None:
        raise ValueError(f"{problem}; fix: use only {NAME_CHARACTERS}")
    return name


FolderName = Annotated[str, Field(min_length=1, pattern=NAME_PATTERN), AfterValidator(_one_folder)]
"""A pipeline's or a study's name: it names a folder of job dirs (``folder_problem``)."""


# ---------------------------------------------------------------------------------------------- tracking


class TrackingSpec(Strict):
    """Where MLflow records the pipeline run, its trials and the registered model."""

    uri: str = Field(
        "sqlite:///.tunepod/mlflow.db", description="MLflow tracking URI (sqlite:///..., http://...)."
    )
    experiment: str = Field(..., min_length=1, description="MLflow experiment that holds the pipeline runs.")
    ui_url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="Base URL of the MLflow UI that links point at (e.g. https://mlflow.example.com). "
        "Default: the tracking URI when it is an http(s) server (it serves the UI too), else "
        "http://127.0.0.1:5000, where `mlflow ui` listens.",
    )
    flush_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a step waits at its end for MLflow to take what jobs reported while it was "
        "unreachable (jobs never wait for MLflow); a later run brings over what is still missing.",
    )
    runs_ahead: int | None = Field(
        None,
        ge=0,
        description="MLflow runs a tune step makes ahead of its trials, so that a trial's job starts without "
        "waiting for its run to be created (each is named when a trial takes it, one more MLflow write; "
        "those left are deleted at the step's end). Default: as many as trials in flight on a tracking "
        "server or a database that takes concurrent writes, 0 on SQLite (one writer at a time); 0: each "
        "run is made as its trial starts.",
    )

    @property
    def browse_url(self) -> str:
        """The MLflow UI's base URL (``ui_url``, or its default), without a login in it: links are
        printed, and stored in MLflow tags and Prefect artifacts (a browser asks for the login)."""
        if self.ui_url:
            return browsable(self.ui_url)
        return browsable(self.uri) if self.uri.startswith(("http://", "https://")) else LOCAL_MLFLOW_UI

    @model_validator(mode="after")
    def _check_artifact_folder(self) -> TrackingSpec:
        # A local store keeps each experiment's artifacts in <store's folder>/mlartifacts/<experiment>.
        experiment = PurePosixPath(self.experiment)
        if self.uri.startswith("sqlite:///") and (experiment.is_absolute() or ".." in experiment.parts):
            raise ValueError(
                f"experiment {self.experiment!r} would put its artifacts outside the mlartifacts folder "
                "beside the SQLite store; fix: give the experiment a name without '..' that does not "
                "start with '/'"
            )
        return self


#: Where ``mlflow ui`` listens by default.
LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"


# ---------------------------------------------------------------------------------------------- launchers


class LocalLauncherSpec(Strict):
    """Run every job as local ``torchrun`` processes; a folder stands in for the shared filesystem."""

    kind: Literal["local"] = "local"
    root: str = Field(
        ".tunepod/shared", description="Folder that fsx:/// paths and job directories live under."
    )
    cancel_grace_s: float = Field(10.0, ge=0, description="Seconds between SIGTERM and SIGKILL on cancel.")
    direct_single_process: bool = Field(
        True,
        description="Start a job of one process with the interpreter itself, torchrun's variables set "
        "(RANK=0, WORLD_SIZE=1, ...), saving torchrun's start-up and teardown; false: always torchrun.",
    )


class SlurmLauncherSpec(Strict):
    """Run every job as an sbatch job on a Slurm cluster (SageMaker HyperPod's Slurm orchestrator too).

    The orchestrator reads what jobs write under ``root``, so ``root`` must be the same path on the
    cluster and where tunepod runs: run tunepod on the head/login node (FSx for Lustre mounted there),
    or submit over ``ssh`` from a machine that mounts the same filesystem at the same path.
    """

    kind: Literal["slurm"]
    root: str = Field(..., description="Shared filesystem root (e.g. /fsx/tunepod) seen by every node.")
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    qos: str | None = Field(None, description="sbatch --qos.")
    exclusive: bool = Field(False, description="sbatch --exclusive: whole nodes for each job.")
    cpus_per_node: int | None = Field(
        None, ge=1, description="CPUs per node (--cpus-per-task, one task per node)."
    )
    mem_gb: float | None = Field(None, gt=0, description="Memory per node in GB (--mem).")
    time_limit_min: int | None = Field(
        None, ge=1, description="Default --time when a job's resources set no timeout_min."
    )
    hyperpod: bool | None = Field(
        None, description="Add srun --auto-resume=1. Default: detected from /opt/sagemaker_cluster."
    )
    python: str = Field("python3", description="Python on the compute nodes (after the setup lines).")
    setup: list[str] = Field(
        default_factory=list, description="Shell lines run before training: module loads, venv activation."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every job.")
    ssh: str | None = Field(None, description="user@host of the head node; unset runs sbatch locally.")
    ssh_options: list[str] = Field(
        default_factory=list, description="Extra ssh arguments, e.g. ['-o', 'ProxyCommand=aws ssm ...']."
    )
    poll_cache_s: float = Field(
        1.0, ge=0, description="One squeue/scontrol call answers every job's state for this long."
    )
    direct_single_process: bool = Field(
        True,
        description="A job of one process on one node runs `srun python script` with the variables "
        "torchrun would set, without torchrun's start-up; false keeps torchrun for every job.",
    )


class LogMonitoringRuleSpec(Strict):
    """One HyperPod hang-detection rule over the job's log lines (the operator's
    ``logMonitoringConfiguration``). The training script must print the lines the pattern matches."""

    name: str = Field(..., min_length=1, description="Name of the rule, shown in the job's status.")
    log_pattern: str = Field(..., min_length=1, description="Regex of the log lines the rule watches.")
    stop_pattern: str | None = Field(None, description="Regex of the line after which the rule stops.")
    start_within_s: int | None = Field(
        None, ge=1, description="The first match must come this soon after start, else the job is HANGING."
    )
    recur_within_s: int | None = Field(
        None, ge=1, description="Seconds allowed between two matches before the job is HANGING."
    )

    @model_validator(mode="after")
    def _check_limit(self) -> LogMonitoringRuleSpec:
        if self.start_within_s is None and self.recur_within_s is None:
            raise ValueError(
                f"rule {self.name!r} can never fire; fix: set start_within_s, recur_within_s or both"
            )
        return self


class SecretRef(Strict):
    """One key of a Kubernetes Secret in the jobs' namespace, read into an environment variable by the
    kubelet (``valueFrom.secretKeyRef``): the value never enters the job object."""

    secret: str = Field(
        ...,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description="Name of the Secret (kubectl -n NAMESPACE create secret generic NAME ...).",
    )
    key: str = Field(..., pattern=r"^[-._a-zA-Z0-9]+$", description="Key in the Secret's data.")


class HyperPodEksLauncherSpec(Strict):
    """Run every job as a ``HyperPodPyTorchJob`` (or a Kubeflow ``PyTorchJob``) on an EKS cluster.

    Jobs write their checkpoints, metrics and results under ``root``, a PersistentVolumeClaim (FSx for
    Lustre) mounted at ``root`` in every pod; the orchestrator reads them there, so it must mount the
    same filesystem at the same path (run tunepod in the cluster or on a machine that mounts FSx).
    """

    kind: Literal["hyperpod_eks"]
    crd: Literal["hyperpod", "kubeflow"] = Field(
        "hyperpod",
        description="hyperpod: HyperPodPyTorchJob (the image needs hyperpod-elastic-agent); "
        "kubeflow: the Kubeflow training operator's PyTorchJob.",
    )
    namespace: str = Field("default", min_length=1, description="Namespace of the jobs and the claim.")
    image: str = Field(..., min_length=1, description="Training image (with torch and tunepod.runtime).")
    root: str = Field(..., description="Shared root (e.g. /fsx/tunepod): mount path of the claim in pods.")
    claim_name: str = Field(..., min_length=1, description="PersistentVolumeClaim of the shared filesystem.")
    queue_name: str | None = Field(None, description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name).")
    priority_class: str | None = Field(
        None, description="Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class)."
    )
    cpus_per_node: float | None = Field(None, gt=0, description="CPU request and limit of each pod.")
    mem_gb: float | None = Field(None, gt=0, description="Memory request and limit of each pod, in GiB.")
    efa_per_node: int = Field(0, ge=0, description="EFA devices per pod (vpc.amazonaws.com/efa).")
    python: str = Field("python", description="Python in the image (the Kubeflow command runs torchrun).")
    working_dir: str | None = Field(None, description="Container working directory for relative paths.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every job.")
    secret_env: dict[str, SecretRef] = Field(
        default_factory=dict,
        description="Variables read from Secrets (valueFrom.secretKeyRef), for credentials: their values "
        "never enter the job object or manifest.json. A variable named here is never set inline, even "
        "when the job's own environment sets it (e.g. MLFLOW_TRACKING_URI with a password in it).",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Extra pod nodeSelector.")
    service_account: str | None = Field(None, description="Service account of the pods.")
    max_retries: int = Field(0, ge=0, description="Times the operator restarts a failed job.")
    restart_eval_period_s: int | None = Field(
        None, ge=1, description="HyperPod: window in which the restart limits below are counted."
    )
    max_full_job_restarts: int | None = Field(None, ge=0, description="HyperPod: full restarts allowed.")
    ttl_after_finished_s: int = Field(
        3600, ge=1, description="Seconds a finished job is kept so that its final state can be read."
    )
    hang_detection: list[LogMonitoringRuleSpec] = Field(
        default_factory=list, description="HyperPod log rules that mark a silent job HANGING."
    )
    elastic: bool = Field(False, description="Kubeflow: render an elasticPolicy (c10d rendezvous).")
    poll_cache_s: float = Field(2.0, ge=0, description="One list call answers every job's state this long.")
    kubeconfig: str | None = Field(
        None,
        description="kubeconfig file of the cluster (aws eks update-kubeconfig writes one); unset: the "
        "pod's service account when KUBERNETES_SERVICE_HOST is set, else $KUBECONFIG or ~/.kube/config.",
    )
    context: str | None = Field(
        None, description="Context of the kubeconfig to use; unset: the file's current-context."
    )

    @model_validator(mode="after")
    def _check_restarts(self) -> HyperPodEksLauncherSpec:
        if self.max_full_job_restarts is not None and self.restart_eval_period_s is None:
            raise ValueError(
                "max_full_job_restarts needs a window; fix: set restart_eval_period_s (e.g. 3600)"
            )
        return self

    @model_validator(mode="after")
    def _check_secret_env(self) -> HyperPodEksLauncherSpec:
        both = [name for name in self.secret_env if name in self.env]
        if both:
            names = ", ".join(both)
            raise ValueError(
                f"{names} set in both env and secret_env; fix: remove {names} from env (secret_env "
                "reads the value from its Secret, where env would write it into the job object)"
            )
        reserved = [name for name in self.secret_env if name.startswith("TUNEPOD_")]
        if reserved:
            raise ValueError(
                f"secret_env sets {', '.join(reserved)}, which tunepod sets per job (the runtime "
                f"contract); fix: remove {', '.join(reserved)} from secret_env"
            )
        return self


class SageMakerFsxSpec(Strict):
    """FSx for Lustre file system mounted into every training job as the ``train`` channel."""

    file_system_id: str = Field(..., pattern=r"^fs-[0-9a-f]+$", description="e.g. fs-0123456789abcdef0.")
    directory_path: str = Field(
        ..., pattern=r"^/", description="Path inside the file system, starting with its mount name."
    )
    access_mode: Literal["rw", "ro"] = Field(
        "rw", description="rw lets jobs write metrics and results under root; ro only reads data."
    )


class SageMakerLauncherSpec(Strict):
    """Run every job as a SageMaker training job (CreateTrainingJob through boto3).

    ``root`` is where tunepod sees the FSx file system whose ``fsx.directory_path`` the jobs mount:
    paths under it are rewritten to the job's mount point, so jobs write their metrics and results
    where the orchestrator reads them.
    """

    kind: Literal["sagemaker"]
    root: str = Field(..., description="Local mount of fsx.directory_path (e.g. /fsx/tunepod).")
    role_arn: str = Field(..., pattern=r"^arn:aws[a-z-]*:iam::\d{12}:role/", description="Execution role.")
    image_uri: str | None = Field(
        None, description="Training image (a SageMaker PyTorch container or derived); or framework_version."
    )
    framework_version: str | None = Field(
        None,
        pattern=r"^\d+\.\d+(\.\d+)?$",
        description="PyTorch version (e.g. 2.5) whose SageMaker training image the jobs run, looked up by "
        "the SageMaker Python SDK for the region and each job's instance type (CPU or GPU); instead "
        "of image_uri.",
    )
    py_version: str | None = Field(
        None,
        pattern=r"^py3\d*$",
        description="Python of that image (e.g. py311); default: the newest the version ships.",
    )
    output_s3_uri: str = Field(..., pattern=r"^s3://", description="OutputDataConfig.S3OutputPath.")
    checkpoint_s3_uri: str | None = Field(
        None,
        pattern=r"^s3://",
        description="Where /opt/ml/checkpoints syncs (<prefix>/<checkpoint dir under root>) when jobs "
        "have no read-write fsx; with one, checkpoints stay on FSx (export them with an export step).",
    )
    code_uri: str | None = Field(
        None, description="s3://.../sourcedir.tar.gz holding the entrypoint; unset: its folder under root."
    )
    instance_type: str | None = Field(None, description="Default when a job's resources set none.")
    volume_size_gb: int = Field(50, ge=1, description="EBS volume per instance.")
    input_mode: Literal["File", "FastFile", "Pipe"] = "File"
    fsx: SageMakerFsxSpec | None = None
    subnets: list[str] = Field(default_factory=list, description="VpcConfig subnets (FSx needs them).")
    security_group_ids: list[str] = Field(default_factory=list, description="VpcConfig security groups.")
    max_retry_attempts: int = Field(1, ge=1, le=30, description="RetryStrategy: attempts on internal errors.")
    max_runtime_s: int = Field(
        86400, ge=1, description="StoppingCondition when a job's resources set no timeout_min."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every job.")
    region: str | None = Field(None, description="AWS region; default: boto3's configuration.")
    poll_cache_s: float = Field(
        5.0,
        ge=0,
        description="One DescribeTrainingJob answers a job's state this long (per job: no cheap call "
        "lists every job's state); a final state is kept for good.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_parallelism(cls, data: Any) -> Any:
        # Parallelism is every launcher's now; a clear error beats merging two places that could differ.
        if isinstance(data, dict) and "parallelism" in data:
            raise ValueError(
                "parallelism moved from the sagemaker launcher to the train job, for every launcher; "
                "fix: remove it here and set it on each tune or train step's train, e.g. train: "
                f"{{entrypoint: ..., parallelism: {json.dumps(data['parallelism'], default=str)}}} "
                "(SMP v2's tensor_parallel_degree and hybrid_shard_degree are rendered from it)"
            )
        return data

    @model_validator(mode="after")
    def _one_image(self) -> SageMakerLauncherSpec:
        if (self.image_uri is None) == (self.framework_version is None):
            raise ValueError(
                "name the training image once; fix: set image_uri (an ECR URI) or framework_version "
                '(e.g. "2.5": the SageMaker PyTorch training image is looked up), not both'
                if self.image_uri
                else 'the jobs need a training image; fix: set framework_version (e.g. "2.5") or '
                "image_uri (an ECR URI)"
            )
        if self.py_version is not None and self.framework_version is None:
            raise ValueError("py_version picks among framework_version's images; fix: set framework_version")
        return self

    @model_validator(mode="after")
    def _check_vpc(self) -> SageMakerLauncherSpec:
        if self.fsx is not None and not (self.subnets and self.security_group_ids):
            raise ValueError(
                "fsx needs the jobs in its VPC; fix: set subnets and security_group_ids next to fsx"
            )
        if bool(self.subnets) != bool(self.security_group_ids):
            raise ValueError("VpcConfig needs both; fix: set subnets and security_group_ids together")
        if self.checkpoint_s3_uri is None and (self.fsx is None or self.fsx.access_mode != "rw"):
            raise ValueError(
                "without a read-write fsx, checkpoints sync with S3; fix: set checkpoint_s3_uri "
                "(s3://bucket/prefix/), or mount fsx with access_mode: rw"
            )
        return self


# Discriminated by ``kind``; HyperPod EKS and SageMaker join this union.
LauncherSpec = Annotated[
    LocalLauncherSpec | SlurmLauncherSpec | HyperPodEksLauncherSpec | SageMakerLauncherSpec,
    Field(discriminator="kind"),
]


# ---------------------------------------------------------------------------------------------- jobs


class CheckpointTiersSpec(Strict):
    """Checkpoint tiers: frequent saves to each node's memory, replicated to peer nodes' memory, and
    rarer ones to the shared file system. A lost node then costs the steps since the last memory save,
    not since the last shared one. Only shared steps are seen by the orchestrator (MLflow, PBT, ASHA
    resumes, evaluation); the job flushes its newest memory step there at ctx.finish()."""

    memory_every_steps: int = Field(
        ...,
        ge=1,
        description="At least every this many steps, ctx.save_checkpoint goes to node memory (saves in "
        "between do nothing).",
    )
    shared_every_steps: int = Field(
        ...,
        ge=1,
        description="At least every this many steps a save also goes to the shared file system (the "
        "checkpoint folder, as without tiers); so does the first save after ctx.should_stop() said stop. "
        "At least memory_every_steps.",
    )
    memory_replicas: int = Field(
        1,
        ge=0,
        description="Copies of each memory save in other nodes' memory (the same local rank on the next "
        "nodes); 0 keeps it on its own node only. A one-node job has no peer and keeps none.",
    )
    memory_dir: str = Field(
        DEFAULT_MEMORY_DIR,
        description="Absolute path of a memory-backed folder on every node (a tmpfs such as /dev/shm); "
        "the job writes under <memory_dir>/tunepod/ and removes its folder at ctx.finish().",
    )

    @model_validator(mode="after")
    def _check_tiers(self) -> CheckpointTiersSpec:
        if self.shared_every_steps < self.memory_every_steps:
            raise ValueError(
                f"checkpoints.shared_every_steps {self.shared_every_steps} is below memory_every_steps "
                f"{self.memory_every_steps}: every save that goes to the shared file system also goes to "
                f"memory, so the shared tier is the rarer one; fix: set shared_every_steps to at least "
                f"{self.memory_every_steps}, or memory_every_steps to at most {self.shared_every_steps}"
            )
        if not PurePosixPath(self.memory_dir).is_absolute():
            raise ValueError(
                f"checkpoints.memory_dir {self.memory_dir!r} is not an absolute path: each node resolves "
                "it on its own, from wherever the job starts; fix: give an absolute path such as /dev/shm"
            )
        return self

    def tiers(self) -> CheckpointTiers:
        """What the job reads back from ``TUNEPOD_CHECKPOINT_TIERS``."""
        return CheckpointTiers(**self.model_dump())


class TrainJob(Strict):
    """The training command a trial runs: a Python entrypoint started under torchrun."""

    entrypoint: str = Field(..., description="Path of the training script, relative to where tunepod runs.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Fixed parameters, merged under the tuned ones."
    )
    resources: Resources = Field(default_factory=Resources)
    parallelism: ParallelismSpec | None = Field(
        None,
        description="data x tensor x pipeline layout of the job's processes and its sharding, checked "
        "against resources; unset: data parallelism over every process.",
    )
    checkpoints: CheckpointTiersSpec | None = Field(
        None,
        description="Checkpoint tiers: saves to node memory every memory_every_steps, replicated to peer "
        "nodes, and to the shared file system every shared_every_steps. Unset: every "
        "ctx.save_checkpoint goes to the shared file system.",
    )
    max_restarts: int = Field(
        1,
        ge=0,
        description="Times a failed job (a killed process, a lost node) is started again in place, "
        "resuming from its last checkpoint; 0 fails the trial at the first failure.",
    )
    hang_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description="Seconds a rank's training loop may go without advancing (a report, a checkpoint, "
        "ctx.heartbeat()) before the job counts as hung: it is stopped and restarted from its checkpoint "
        "(counted against max_restarts), or fails with which ranks stopped. null: never.",
    )
    startup_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description="Seconds from the job running to its first heartbeat (runtime.init): image pull, "
        "imports, a slow mount. Past it the job counts as hung. null: no limit.",
    )

    @model_validator(mode="after")
    def _check_parallelism(self) -> TrainJob:
        # args may fix parallelism.<field> values too, as a trial's parameters do: check them together.
        job_layout(self.parallelism, self.resources, self.args)
        fixed = self.parallelism is not None or any(key.startswith("parallelism.") for key in self.args)
        if self.resources.elastic and fixed:
            # The layout is handed to the job as fixed degrees, which a smaller world no longer fits:
            # every re-formed worker would refuse it at runtime.init().
            raise ValueError(
                "resources.min_nodes makes an elastic job, whose world shrinks when a node is lost, and "
                "a parallelism layout is fixed at submission; fix: remove min_nodes, or the parallelism "
                "block (an elastic job is data parallel over whatever processes it has)"
            )
        return self


# ---------------------------------------------------------------------------------------------- search space


class FloatParam(Strict):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        _check_bounds(self.low, self.high)
        if self.log and self.low <= 0:
            raise ValueError(f"log=true needs low > 0 (got low={self.low}); fix: raise low or set log: false")
        if self.log and self.step is not None:
            raise ValueError("step and log=true cannot be combined; fix: remove one of them")
        return self

    def misfit(self, value: Any) -> str | None:
        """Why ``value`` is not in this range (None when it is)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{value!r} is not a number"
        return None if self.low <= value <= self.high else f"{value} is outside [{self.low}, {self.high}]"


class IntParam(Strict):
    type: Literal["int"]
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_bounds(self.low, self.high)
        if self.log and self.low <= 0:
            raise ValueError(f"log=true needs low > 0 (got low={self.low}); fix: raise low or set log: false")
        if self.log and self.step != 1:
            raise ValueError("step and log=true cannot be combined; fix: remove one of them")
        return self

    def misfit(self, value: Any) -> str | None:
        """Why ``value`` is not in this range (None when it is)."""
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{value!r} is not an integer"
        if not self.low <= value <= self.high:
            return f"{value} is outside [{self.low}, {self.high}]"
        return (
            None
            if (value - self.low) % self.step == 0
            else f"{value} is off the step {self.step} from {self.low}"
        )


class CategoricalParam(Strict):
    type: Literal["categorical"]
    choices: list[str | int | float | bool | None] = Field(..., min_length=1)

    def misfit(self, value: Any) -> str | None:
        """Why ``value`` is not one of the choices (None when it is)."""
        return None if value in self.choices else f"{value!r} is not one of {self.choices}"


def _check_bounds(low: float, high: float) -> None:
    if low > high:
        raise ValueError(f"bounds inverted: low={low} > high={high}; fix: swap low and high")


SearchParam = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


# ---------------------------------------------------------------------------------------------- tuning


Direction = Literal["maximize", "minimize"]


class Objective(Strict):
    """One value the study optimizes: a metric the training script reports, and which way is better."""

    metric: str = Field(..., min_length=1)
    direction: Direction


class StudySpec(Strict):
    """The Optuna study: its name is its identity, so running again with the same name resumes it.

    One objective (``metric`` and ``direction``), or several (``objectives``, a list of both): a
    multi-objective study keeps the Pareto front, and the first objective is the primary one, which
    orders the front for the steps downstream (evaluate the front's trials best-primary first). After
    validation ``objectives`` always holds every objective and ``metric``/``direction`` the primary.
    """

    name: FolderName = Field(..., description="The study's name; its trials' job dirs: <root>/jobs/<name>/.")
    storage: str = Field(
        "journal://.tunepod/optuna.log",
        description="journal://<file> (default, safe on a shared filesystem), sqlite:///<file>, or "
        "postgresql://user:password@host:5432/db (several orchestrators on several machines).",
    )
    direction: Direction = "maximize"
    metric: str | None = Field(
        None, min_length=1, description="The reported metric the study optimizes (one objective)."
    )
    objectives: list[Objective] | None = Field(
        None,
        min_length=1,
        description="Several objectives, primary first (instead of metric and direction).",
    )

    @model_validator(mode="after")
    def _check_storage(self) -> StudySpec:
        if not (self.storage.startswith(("journal://", "sqlite:///")) or is_postgres(self.storage)):
            raise ValueError(
                f"storage {redacted(self.storage)!r} is not supported; fix: use journal://<file>, "
                "sqlite:///<file> or postgresql://user:password@host:5432/db"
            )
        return self

    @model_validator(mode="after")
    def _one_form_of_objectives(self) -> StudySpec:
        if self.objectives is None:
            if self.metric is None:
                raise ValueError(
                    "the study has no objective; fix: set metric (and direction), or objectives: "
                    "[{metric: ..., direction: ...}, ...]"
                )
            self.objectives = [Objective(metric=self.metric, direction=self.direction)]
            return self
        metrics = [o.metric for o in self.objectives]
        twice = sorted({m for m in metrics if metrics.count(m) > 1})
        if twice:
            raise ValueError(f"objectives name {', '.join(twice)} more than once; fix: list each metric once")
        primary = self.objectives[0]
        # A dumped and re-read spec holds both forms; they must agree.
        given = self.model_fields_set & {"metric", "direction"}
        if any(getattr(self, f) != getattr(primary, f) for f in given):
            raise ValueError(
                "set either metric/direction (one objective) or objectives (several), not both; "
                f"fix: remove {' and '.join(sorted(given))} (objectives[0] is the primary objective)"
            )
        self.metric, self.direction = primary.metric, primary.direction
        return self

    @property
    def primary(self) -> Objective:
        assert self.objectives is not None  # filled by validation
        return self.objectives[0]

    @property
    def goals(self) -> list[Objective]:
        """Every objective, primary first."""
        assert self.objectives is not None  # filled by validation
        return self.objectives

    @property
    def multi_objective(self) -> bool:
        return len(self.goals) > 1


def _options_fit_kind(spec: BaseModel, kind: str, applies: dict[str, tuple[str, ...]], what: str) -> None:
    """Refuse an option set for a kind it does not apply to (it would silently do nothing). An option
    left at its default passes: a dumped spec (``dump_spec``) writes every option out."""
    for option in sorted(spec.model_fields_set - {"kind"}):
        kinds = applies.get(option, ())
        default = type(spec).model_fields[option].get_default(call_default_factory=True)
        if kind not in kinds and getattr(spec, option) != default:
            raise ValueError(
                f"{what}.{option} applies to {what} kind {' or '.join(kinds)}, not {kind}; fix: remove "
                f"{option}, or set kind: {kinds[0]}"
            )


SamplerKind = Literal["tpe", "random", "gp", "cmaes", "qmc", "nsga2"]


#: Which sampler kinds each option of ``SamplerSpec`` applies to.
SAMPLER_OPTIONS: dict[str, tuple[str, ...]] = {
    "n_startup_trials": ("tpe", "gp", "cmaes"),
    "multivariate": ("tpe",),
    "deterministic_objective": ("gp",),
    "popsize": ("cmaes",),
    "use_separable_cma": ("cmaes",),
    "with_margin": ("cmaes",),
    "lr_adapt": ("cmaes",),
    "qmc_type": ("qmc",),
    "scramble": ("qmc",),
    "population_size": ("nsga2",),
    "crossover_prob": ("nsga2",),
    "mutation_prob": ("nsga2",),
}


class SamplerSpec(Strict):
    """How the study suggests parameters. ``sampler: tpe`` is short for ``sampler: {kind: tpe}``.

    tpe: multivariate TPE with the constant liar (one or several objectives); random; gp: Gaussian
    process with expected improvement (good for few, expensive trials); cmaes: CMA-ES (one objective,
    numeric parameters; categorical ones are drawn at random); qmc: quasi-Monte Carlo (Sobol or Halton,
    an even spread, no model); nsga2: NSGA-II (several objectives).
    """

    kind: SamplerKind = "tpe"
    n_startup_trials: int | None = Field(
        None,
        ge=0,
        description=(
            "tpe, gp, cmaes: trials drawn at random before the model is used (default: tpe num_parallel, "
            "at least 2; gp 10; cmaes 1)."
        ),
    )
    multivariate: bool = Field(True, description="tpe: model the parameters jointly.")
    deterministic_objective: bool = Field(
        False, description="gp: the metric has no noise (same parameters, same value)."
    )
    popsize: int | None = Field(
        None, ge=2, description="cmaes: population size (default from the dimension)."
    )
    use_separable_cma: bool = Field(False, description="cmaes: diagonal covariance (many parameters).")
    with_margin: bool = Field(False, description="cmaes: keep integer parameters from getting stuck.")
    lr_adapt: bool = Field(False, description="cmaes: adapt the learning rate (noisy or multimodal metrics).")
    qmc_type: Literal["sobol", "halton"] = Field("sobol", description="qmc: the low-discrepancy sequence.")
    scramble: bool = Field(False, description="qmc: scramble the sequence (seeded by seed).")
    population_size: int = Field(50, ge=2, description="nsga2: trials per generation.")
    crossover_prob: float = Field(0.9, ge=0, le=1, description="nsga2: chance of a crossover.")
    mutation_prob: float | None = Field(None, ge=0, le=1, description="nsga2: chance to mutate a parameter.")

    @model_validator(mode="after")
    def _options_fit(self) -> SamplerSpec:
        _options_fit_kind(self, self.kind, SAMPLER_OPTIONS, "sampler")
        return self


def _sampler_shorthand(value: Any) -> Any:
    return {"kind": value} if isinstance(value, str) else value


PrunerKind = Literal["asha", "hyperband", "successive_halving", "median", "threshold", "wilcoxon", "none"]


#: Which pruner kinds each option of ``PrunerSpec`` applies to.
PRUNER_OPTIONS: dict[str, tuple[str, ...]] = {
    "min_resource": ("hyperband", "asha", "successive_halving"),
    "max_resource": ("hyperband", "asha"),
    "reduction_factor": ("hyperband", "asha", "successive_halving"),
    "warmup_steps": ("median", "threshold", "wilcoxon"),
    "lower": ("threshold",),
    "upper": ("threshold",),
    "p_threshold": ("wilcoxon",),
    "rank_by": ("asha",),
}


class PrunerSpec(Strict):
    """When a running trial is stopped early (its job cancelled), from the values it reports.

    asha: asynchronous successive halving that pauses instead of killing: a trial outside the top
    1/reduction_factor of the trials at a rung of min_resource x reduction_factor^k units (a unit is a
    reported step + 1) is stopped after its checkpoint and later promoted (resumed from it) once it
    ranks in the top, or when a slot would idle (``tunepod.hpo.asha``); needs max_resource.
    hyperband and successive_halving: keep the top 1/reduction_factor at each rung of min_resource x
    reduction_factor^k steps, killing the others; median: below the median of earlier trials at the
    same step; threshold: outside [lower, upper]; wilcoxon: a Wilcoxon signed-rank test against the
    best trial over the steps both reported (meant for steps that are folds or instances, not epochs)."""

    kind: PrunerKind = "none"
    min_resource: int = Field(
        1,
        ge=1,
        description="asha, hyperband, successive_halving: steps a trial runs before it can be pruned "
        "or paused. Default 1; asha: max_resource // reduction_factor, one rung at a third of a trial "
        "with the default factor (measured: benchmarks/README.md, quality/).",
    )
    max_resource: int | None = Field(
        None,
        ge=1,
        description="asha, hyperband: a full trial's resource, the step of its last report + 1 (its epochs, "
        "for a job that reports epochs 0, 1, ...), which sizes the brackets. Unset, Hyperband learns it "
        "from the first trial that completes and prunes nothing before; set, it prunes from the first "
        "trials on.",
    )
    reduction_factor: int = Field(
        3, ge=2, description="asha, hyperband, successive_halving: reduction factor."
    )
    warmup_steps: int = Field(
        0, ge=0, description="median, threshold, wilcoxon: steps reported before pruning starts."
    )
    lower: float | None = Field(None, description="threshold: prune a trial whose value falls below.")
    upper: float | None = Field(None, description="threshold: prune a trial whose value rises above.")
    p_threshold: float = Field(0.1, gt=0, lt=1, description="wilcoxon: prune below this p-value.")
    rank_by: Literal["value", "forecast"] = Field(
        "forecast",
        description="asha: what trials are ranked by at a rung (and paused trials for promotion): the "
        "value its learning curve up to there forecasts at max_resource (a line in log units through "
        "its newest points, never gaining more than it gained so far), which a paused trial can be "
        "resumed on where a killed one could not; or the value each reported there (value).",
    )

    @model_validator(mode="after")
    def _options_fit(self) -> PrunerSpec:
        _options_fit_kind(self, self.kind, PRUNER_OPTIONS, "pruner")
        if self.kind == "asha" and self.max_resource and "min_resource" not in self.model_fields_set:
            # A first rung at a sixth of a trial (rf 3, two rungs) paused trials that would have won
            # and paid a restart for each; a third did better (benchmarks.quality.simulate, digits).
            self.min_resource = max(1, self.max_resource // self.reduction_factor)
        if self.kind == "asha" and self.max_resource is None:
            raise ValueError(
                "pruner kind asha needs max_resource (its rungs stop below it); fix: set max_resource to "
                "a full trial's units of training, the step of its last report + 1 (its epochs)"
            )
        if self.kind == "threshold" and self.lower is None and self.upper is None:
            raise ValueError("pruner kind threshold needs a bound; fix: set lower, upper or both")
        if self.kind == "asha" and self.max_resource is not None and self.max_resource <= self.min_resource:
            raise ValueError(
                f"pruner kind asha with min_resource {self.min_resource} and max_resource "
                f"{self.max_resource} has no rung (its rungs are at min_resource x reduction_factor^k units, "
                "below max_resource), so it would never pause a trial; fix: set min_resource below "
                "max_resource (or leave it out: max_resource // reduction_factor), and max_resource to a "
                "full trial's units of training"
            )
        if self.max_resource is not None and self.max_resource < self.min_resource:
            raise ValueError(
                f"pruner.max_resource {self.max_resource} is below min_resource {self.min_resource}; "
                "fix: set max_resource to the step of a full trial's last report + 1, or leave it out"
            )
        return self


class PerturbSpec(Strict):
    """How PBT explores a donor's parameters for the member that copies it."""

    factors: tuple[float, float] = Field(
        (0.8, 1.2),
        description="A number is multiplied by one of these, drawn at random (then clipped to its range "
        "and put on its step grid), moving at least one step of its grid that way (a float at 0 without "
        "one: |factor - 1| of its range) unless at that bound; a choice moves to a neighbouring one.",
    )
    resample_probability: float = Field(
        0.25, ge=0, le=1, description="Chance that a parameter is drawn afresh from the space instead."
    )
    params: list[str] | None = Field(
        None,
        description="The parameters to explore (default: all of space); the others are the donor's, "
        "unchanged. Leave out those that shape the model or its optimizer's state (layer sizes, the "
        "optimizer's kind): the donor's checkpoint must load under the new parameters.",
    )

    @field_validator("factors")
    @classmethod
    def _factors_move(cls, factors: tuple[float, float]) -> tuple[float, float]:
        if not all(math.isfinite(f) for f in factors):
            # YAML reads .nan and .inf as numbers; a parameter times either is no number of its range.
            raise ValueError(
                f"pbt.perturb.factors {list(factors)} holds a factor that is not a finite number, which "
                "would fail the first trial it explores; fix: two positive finite factors, e.g. [0.8, 1.2]"
            )
        if any(f <= 0 for f in factors) or factors[0] == factors[1] == 1:
            raise ValueError(
                f"{list(factors)} would not move a parameter; fix: two positive factors, e.g. [0.8, 1.2]"
            )
        return factors


class PbtSpec(Strict):
    """Population-based training (``tunepod.hpo.pbt``): ``population`` members train side by side; at
    every ``interval`` units of training (a unit is a reported step + 1) a member in the bottom
    ``quantile`` of the ``n`` members at that point (``ceil(n x quantile)`` of them, at most ``n // 2``)
    stops, and goes on from a copy of the latest checkpoint of a member in the top as many, with that
    member's parameters explored. Each continuation is a new trial of the member (its MLflow run tags
    the lineage)."""

    population: int = Field(..., ge=2, description="Members trained side by side; num_trials defaults to it.")
    interval: int = Field(..., ge=1, description="Units of training between a member's exploit decisions.")
    quantile: float = Field(
        0.25,
        gt=0,
        le=0.5,
        description="Fraction of the n members at a decision that copy from the top as many: "
        "ceil(n x quantile), at most n // 2 (a population of 2 or 3 exploits one member).",
    )
    max_resource: int | None = Field(
        None,
        ge=1,
        description="A member's full training in units (its epochs): no decision at or past it (the member "
        "is finishing). Unset: decisions at every interval.",
    )
    perturb: PerturbSpec = Field(default_factory=PerturbSpec)

    @model_validator(mode="after")
    def _decides_before_the_end(self) -> PbtSpec:
        if self.max_resource is not None and self.interval >= self.max_resource:
            raise ValueError(
                f"pbt.interval {self.interval} is not below pbt.max_resource {self.max_resource}: members "
                "are judged every interval units before max_resource, so none would ever be and PBT would "
                "run as random search; fix: set interval below max_resource, max_resource to a member's full "
                "training in units (its epochs), or leave max_resource out"
            )
        return self


_CONSTRAINT = re.compile(r"^\s*(?P<metric>[A-Za-z_][\w./-]*)\s*(?P<op><=|>=)\s*(?P<bound>\S+)\s*$")


class Constraint(BaseModel):
    """``<metric> <= <number>`` or ``<metric> >= <number>``: a trial is feasible when the value its job
    reported last (or passed to ``finish``) holds it."""

    model_config = ConfigDict(frozen=True)

    metric: str
    op: Literal["<=", ">="]
    bound: float

    @classmethod
    def parse(cls, text: str) -> Constraint:
        match = _CONSTRAINT.match(text)
        bound = _as_float(match.group("bound")) if match else None
        if match is None or bound is None:
            raise ValueError(
                f"constraint {text!r} is not '<metric> <= <number>' or '<metric> >= <number>'; fix: "
                "write it like 'peak_memory_gb <= 60'"
            )
        return cls(metric=match.group("metric"), op=match.group("op"), bound=bound)

    def violation(self, value: float) -> float:
        """Optuna's convention: at most 0 when the constraint holds, by how much it is broken otherwise."""
        return value - self.bound if self.op == "<=" else self.bound - value

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.bound:g}"


def _as_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None


class WarmStart(Strict):
    """An earlier study whose best trials this one runs first (their parameters, measured again here)."""

    study: str = Field(..., min_length=1, description="The earlier study's name.")
    storage: str | None = Field(None, description="Its storage; default: this study's storage.")
    top_k: int = Field(5, ge=1, description="How many of its best completed trials to run first.")


_AN_INT = TypeAdapter(int)
"""How a field typed ``int`` reads a value (``'4'`` and ``4.0`` as 4)."""


def _num_trials_optional_under_pbt(schema: dict[str, Any]) -> None:
    """In the JSON schema as in validation: num_trials is required unless pbt sets the population."""
    schema["required"] = [name for name in schema.get("required", []) if name != "num_trials"]
    schema["anyOf"] = [{"required": ["num_trials"]}, {"required": ["pbt"]}]


AUTO = "auto"
"""``num_parallel: auto``: as many trials as the cluster runs at once, read when the tune step starts."""
#: The launchers that can tell how many trials their cluster runs at once (``tunepod.launch.slots``).
AUTO_PARALLEL_LAUNCHERS = ("local", "slurm")
#: The launchers that keep a job alive across a node loss (``resources.min_nodes``): the local launcher
#: runs every process of a job on one machine, and a SageMaker training job ends when an instance fails.
ELASTIC_LAUNCHERS = ("slurm", "hyperpod_eks")


def _num_parallel_value(value: Any) -> Any:
    """The two usual mistakes, worded as rules about ``num_parallel``: left to the union below, pydantic
    would report each of its members ("expected an integer or ...") instead of the bound."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        raise ValueError(
            f"must be greater than or equal to 1, got {value}; fix: set num_parallel to 1 or more, or auto"
        )
    if isinstance(value, str) and value != AUTO and not value.strip().isdigit():
        raise ValueError(
            f"expected a number of trials or auto, got {value!r}; fix: set num_parallel to a number, or auto"
        )
    return value


NumParallel = Annotated[Annotated[int, Field(ge=1)] | Literal["auto"], BeforeValidator(_num_parallel_value)]

NUM_PARALLEL_DOC = (
    "Trials in flight at once in the whole study, however many orchestrators (tunepod runs) share it: "
    "a trial counts from its ask until it ends or ASHA pauses it, its job queued or running. auto: as "
    "many as the cluster runs at once, read when the tune step starts (Slurm: the idle nodes of the "
    "launcher's partition / resources.num_nodes; local: this machine's CPUs / resources.procs_per_node; "
    "at least 1; sagemaker and hyperpod_eks cannot tell, give a number)."
)


def _parallel_below_population(num_parallel: int, pbt: PbtSpec) -> str | None:
    if num_parallel >= pbt.population:
        return None
    return (
        f"num_parallel {num_parallel} is below pbt.population {pbt.population}: PBT compares members at "
        "the same point of training, so they train side by side; fix: set num_parallel to "
        f"{pbt.population} or lower the population"
    )


class TuneSettings(Strict):
    """An Optuna study whose trials are distributed training jobs run ``num_parallel`` at a time."""

    model_config = ConfigDict(**Strict.model_config, json_schema_extra=_num_trials_optional_under_pbt)

    train: TrainJob
    study: StudySpec
    space: dict[str, SearchParam] = Field(..., min_length=1)
    num_trials: int = Field(
        ...,
        ge=1,
        description="Finished trials the study should hold, counting earlier runs; under pbt, the "
        "population (the default there).",
    )
    num_parallel: NumParallel = Field(1, description=NUM_PARALLEL_DOC)
    sampler: Annotated[
        SamplerSpec, BeforeValidator(_sampler_shorthand, json_schema_input_type=SamplerKind | SamplerSpec)
    ] = Field(
        default_factory=SamplerSpec,
        description="tpe, random, gp, cmaes, qmc or nsga2; or {kind: ..., options} (see SamplerSpec).",
    )
    seed: int | None = Field(None, description="Sampler seed, for reproducible suggestions.")
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    pbt: PbtSpec | None = Field(
        None, description="Population-based training instead of independent trials (see PbtSpec)."
    )
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Known-good parameters to run first, in order (a parameter left out is sampled); "
        "a configuration the study already holds is not run again.",
    )
    warm_start: list[WarmStart] = Field(
        default_factory=list,
        description="Earlier studies whose best trials' parameters run first (after enqueue), where "
        "they fit this space; their values are measured again on this study's data.",
    )
    constraints: list[str] = Field(
        default_factory=list,
        description="Feasibility from reported metrics, e.g. 'peak_memory_gb <= 60': an infeasible "
        "trial is marked, steered away from (tpe, gp, nsga2) and never evaluated or registered.",
    )
    poll_s: float = Field(0.5, gt=0, description="Seconds between polls of running jobs.")

    @model_validator(mode="before")
    @classmethod
    def _num_trials_from_population(cls, data: Any) -> Any:
        """Under PBT each trial of ``num_trials`` is a member: it defaults to the population, read as
        ``pbt.population`` reads it (``'4'`` too)."""
        if isinstance(data, dict) and "num_trials" not in data and isinstance(data.get("pbt"), dict):
            try:
                population = _AN_INT.validate_python(data["pbt"].get("population"))
            except ValidationError:
                # pbt.population's own error says what is wrong with it; num_trials only follows from
                # it, so it gets a stand-in that no check ever sees (the model fails on the population).
                population = 1
            return {**data, "num_trials": population}
        return data

    @model_validator(mode="after")
    def _check_pbt(self) -> TuneSettings:
        pbt = self.pbt
        if pbt is None:
            return self
        problems = []
        if self.num_trials != pbt.population:
            problems.append(
                f"num_trials {self.num_trials} is not pbt.population {pbt.population} (under PBT each trial "
                "counted is a member); fix: leave num_trials out or set it to the population"
            )
        # auto is checked once resolved (with_num_parallel): the cluster says then how many run at once.
        parallel = self.num_parallel
        below = _parallel_below_population(parallel, pbt) if isinstance(parallel, int) else None
        if below is not None:
            problems.append(below)
        if self.pruner.kind != "none":
            problems.append(
                f"pbt and pruner {self.pruner.kind} both stop trials; fix: remove the pruner (PBT's exploit "
                "is its pruning)"
            )
        if self.study.multi_objective:
            problems.append("pbt ranks members by one objective, the study has several; fix: keep one")
        unknown = sorted(set(pbt.perturb.params or []) - set(self.space))
        if unknown:
            problems.append(
                f"pbt.perturb.params names {', '.join(unknown)}, not in space ({', '.join(self.space)}); "
                "fix: name parameters of the search space"
            )
        if len(self.enqueue) > pbt.population:
            problems.append(
                f"enqueue has {len(self.enqueue)} configurations for a population of {pbt.population}; "
                "fix: enqueue at most one per member"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_space(self) -> TuneSettings:
        clash = sorted(set(self.space) & set(self.train.args))
        if clash:
            raise ValueError(
                f"{', '.join(clash)} is both tuned (space) and fixed (train.args); fix: remove it from one"
            )
        check_space(self.train.parallelism, self.train.resources, self.space, self.train.args)
        return self

    @model_validator(mode="after")
    def _check_enqueue_fits_space(self) -> TuneSettings:
        problems = []
        for index, params in enumerate(self.enqueue):
            for name, value in params.items():
                param = self.space.get(name)
                why = (
                    f"{name} is not in space ({', '.join(self.space)})"
                    if param is None
                    else param.misfit(value)
                )
                if why is not None:
                    problems.append(f"enqueue[{index}].{name}: {why}")
        if problems:
            raise ValueError("; ".join(problems) + "; fix: enqueue values of the search space only")
        return self

    @field_validator("constraints")
    @classmethod
    def _parse_constraints(cls, constraints: list[str]) -> list[str]:
        for text in constraints:
            Constraint.parse(text)
        return constraints

    @functools.cached_property
    def parsed_constraints(self) -> list[Constraint]:
        """``constraints`` parsed (once: each trial's report reads them)."""
        return [Constraint.parse(text) for text in self.constraints]

    @property
    def max_parallel(self) -> int:
        """``num_parallel`` as a number: the spec's, or what ``auto`` became when the tune step started
        (``with_num_parallel``). Read before that, ``auto`` is a bug of the caller."""
        if not isinstance(self.num_parallel, int):
            raise AssertionError("num_parallel auto is resolved when the tune step starts, before it is read")
        return self.num_parallel

    def with_num_parallel(self, num_parallel: int) -> TuneSettings:
        """A copy with ``num_parallel`` set (``auto`` resolved), checked as the spec's number would be:
        ValueError (``<problem>; fix: ...``) where PBT's population would not train side by side."""
        below = None if self.pbt is None else _parallel_below_population(num_parallel, self.pbt)
        if below is not None:
            raise ValueError(below)
        return self.model_copy(update={"num_parallel": num_parallel})

    @model_validator(mode="after")
    def _check_sampler_fits(self) -> TuneSettings:
        kind = self.sampler.kind
        if kind == "cmaes" and self.study.multi_objective:
            raise ValueError(
                f"sampler cmaes optimizes one objective, the study has {len(self.study.goals)}; fix: "
                "use sampler nsga2, tpe or gp, or keep one objective"
            )
        numeric = [name for name, param in self.space.items() if not isinstance(param, CategoricalParam)]
        if kind == "cmaes" and not numeric:
            raise ValueError(
                "sampler cmaes searches numeric parameters and every parameter of space is categorical "
                "(each would be drawn at random); fix: use sampler tpe or gp"
            )
        return self

    @field_validator("pruner")
    @classmethod
    def _check_pruner_fits_objectives(cls, pruner: PrunerSpec, info: ValidationInfo) -> PrunerSpec:
        # A field validator (study is validated before pruner), so the error points at the pruner.
        study = info.data.get("study")
        if study is not None and study.multi_objective and pruner.kind != "none":
            raise ValueError(
                f"pruner.kind {pruner.kind} cannot prune a study with {len(study.goals)} objectives "
                "(Optuna's pruners compare one value per step); fix: set pruner: {kind: none}, or keep "
                "one objective"
            )
        return pruner


class TrainSettings(Strict):
    """One training job with fixed parameters, or with the best parameters of the tune step it needs."""

    train: TrainJob
    params: dict[str, Any] = Field(
        default_factory=dict, description="Parameters; override a needed study's best."
    )
    metric: str | None = Field(None, description="Metric to read from the job's result, if any.")

    @model_validator(mode="after")
    def _check_parallelism(self) -> TrainSettings:
        # parallelism.<field> params override the block (and a needed study's best layout).
        job_layout(self.train.parallelism, self.train.resources, {**self.train.args, **self.params})
        return self


FsxAutoEvent = Literal["NEW", "CHANGED", "DELETED"]
FSX_AUTO_EVENTS: tuple[FsxAutoEvent, ...] = ("NEW", "CHANGED", "DELETED")


class FsxStageSpec(Strict):
    """FSx for Lustre settings of a stage step whose target is ``fsx://<file-system-id>/<path>``.

    The step links ``<path>`` to the S3 source with a data repository association (created once,
    then reused), imports the S3 metadata, and optionally preloads the file contents.
    """

    mount: str | None = Field(
        None,
        description="Where the file system is mounted, here and on the nodes (e.g. /fsx); "
        "default: the launcher's root. The dataset lands at <mount>/<path>.",
    )
    region: str | None = Field(None, description="AWS region of the file system; default: boto3's.")
    auto_import: list[FsxAutoEvent] = Field(
        default_factory=lambda: list(FSX_AUTO_EVENTS),
        description="S3 events a NEW association imports by itself; [] turns auto import off.",
    )
    preload: bool = Field(
        False, description="Load the file contents after the import (`lfs hsm_restore`, as a launcher job)."
    )
    num_files_per_batch: int = Field(
        256, ge=1, description="Files per `lfs hsm_restore` call of the preload job."
    )
    report_path: str | None = Field(
        None, pattern=r"^s3://", description="s3:// prefix where FSx writes a CSV of the files that failed."
    )
    poll_s: float = Field(10.0, gt=0, description="Seconds between polls of the association and task.")
    timeout_s: float = Field(3600.0, gt=0, description="Longest wait for the association, then the task.")


FSX_FILE_SYSTEM_ID = r"fs-[0-9a-f]{8,17}"
_FSX_TARGET = re.compile(r"fsx://(?P<id>[^/]+)(?P<path>/.*)?")


def fsx_target_id(target: str) -> str | None:
    """The file system id of an ``fsx://<id>/<path>`` target; None for ``fsx:///path`` and folders."""
    match = _FSX_TARGET.fullmatch(target)
    return match["id"] if match else None


class StageSettings(Strict):
    """Copy a dataset onto the shared filesystem, skipping files that have not changed; or, for an
    ``fsx://<file-system-id>/<path>`` target, link the S3 source into FSx for Lustre."""

    source: str = Field(..., description="builtin://digits, s3://bucket/prefix/, or a local folder.")
    target: str = Field(
        ...,
        description="fsx:///<path> (under the launcher's shared root), fsx://<file-system-id>/<path> "
        "(FSx for Lustre linked to an s3:// source), or a local folder.",
    )
    fsx: FsxStageSpec | None = Field(None, description="Settings of an fsx://<file-system-id>/ target.")
    verify: bool = Field(
        False,
        description="Compare sha256 checksums instead of trusting an unchanged size and mtime, so a file "
        "changed in place (same size, mtime kept) is copied again; reads every file on both sides.",
    )

    @model_validator(mode="after")
    def _check_fsx(self) -> StageSettings:
        file_system_id = fsx_target_id(self.target)
        if file_system_id is not None and self.verify:
            raise ValueError(
                f"verify has no effect on an fsx://{file_system_id}/ target: FSx imports the objects "
                "itself, tunepod copies nothing to check; fix: remove verify, or stage to fsx:///<path>"
            )
        if file_system_id is None:
            if self.target.startswith("fsx://") and ".." in self.target.split("/"):
                raise ValueError(
                    f"target {self.target!r} leaves the launcher's root: fsx:///<path> is a folder under "
                    "it; fix: write the path without '..', e.g. fsx:///datasets/x"
                )
            if self.fsx is not None:
                raise ValueError(
                    "fsx settings apply only to an fsx://<file-system-id>/<path> target, not "
                    f"{self.target!r}; fix: remove fsx, or set the target to e.g. "
                    "fsx://fs-0123456789abcdef0/datasets/x"
                )
            return self
        path = self.target[len("fsx://") + len(file_system_id) :].strip("/")
        if not re.fullmatch(FSX_FILE_SYSTEM_ID, file_system_id):
            raise ValueError(
                f"{file_system_id!r} is not an FSx file system id; fix: write the target as "
                "fsx://fs-0123456789abcdef0/<path> (`aws fsx describe-file-systems` lists yours)"
            )
        if not path or ".." in path.split("/"):
            raise ValueError(
                f"target {self.target!r} names no folder inside the file system; fix: add a path such as "
                f"fsx://{file_system_id}/datasets/x (no '..')"
            )
        if not self.source.startswith("s3://"):
            raise ValueError(
                f"an fsx://{file_system_id}/ target is linked to S3, so the source must be s3://..., "
                f"not {self.source!r}; fix: upload the data to S3 and use s3://bucket/prefix/, or stage "
                "it to fsx:///<path> (a folder under the launcher's root)"
            )
        return self


class EvaluateSettings(Strict):
    """Run an evaluation job on the best checkpoints of a tune or train step."""

    entrypoint: str = Field(..., description="Script that loads a checkpoint and reports the metric.")
    args: dict[str, Any] = Field(default_factory=dict)
    top_k: int = Field(1, ge=1, description="How many of the best trials to evaluate.")
    metric: str = Field(..., min_length=1)
    direction: Literal["maximize", "minimize"] = "maximize"
    num_parallel: int = Field(2, ge=1, description="Evaluation jobs in flight at once.")
    resources: Resources = Field(default_factory=Resources)


class RegisterSettings(Strict):
    """Register the best evaluated checkpoint and point an alias at it if it beats the holder."""

    model: str = Field(..., min_length=1, description="Registered model name in MLflow.")
    alias: str = Field("champion", pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    only_if_better: bool = Field(True, description="Move the alias only if the new version beats its holder.")


class ExportSettings(Strict):
    """Export the checkpoints of a tune or train step from FSx for Lustre to S3.

    One data repository association links the launcher's jobs folder to ``s3_prefix`` and is reused
    by every run (FSx allows few associations per file system); each chosen trial's checkpoint
    folder lands at ``<s3_prefix>/<its path under the jobs folder>``.
    """

    file_system_id: str = Field(
        ..., pattern=rf"^{FSX_FILE_SYSTEM_ID}$", description="The FSx file system the jobs write to."
    )
    s3_prefix: str = Field(..., pattern=r"^s3://[^/]+/", description="Where the checkpoints go (s3://b/p/).")
    trials: Literal["best", "completed"] = Field(
        "best", description="best: the top_k best completed trials; completed: every completed trial."
    )
    top_k: int = Field(1, ge=1, description="How many of the best trials to export (trials: best).")
    release: bool = Field(
        False, description="Free the file-system space of the exported files (S3 keeps the bytes)."
    )
    mount: str | None = Field(
        None, description="Where the file system is mounted here; default: the launcher's root."
    )
    region: str | None = Field(None, description="AWS region of the file system; default: boto3's.")
    report_path: str | None = Field(
        None, pattern=r"^s3://", description="s3:// prefix where FSx writes a CSV of the files that failed."
    )
    poll_s: float = Field(10.0, gt=0, description="Seconds between polls of the association and tasks.")
    timeout_s: float = Field(3600.0, gt=0, description="Longest wait for the association, then each task.")

    @model_validator(mode="after")
    def _check_top_k(self) -> ExportSettings:
        if self.trials == "completed" and "top_k" in self.model_fields_set:
            raise ValueError(
                "top_k has no effect with trials: completed; fix: remove top_k or use trials: best"
            )
        return self


# ---------------------------------------------------------------------------------------------- steps


class StepBase(Strict):
    needs: list[str] = Field(default_factory=list, description="Steps whose outputs this step takes.")


class StageStep(StepBase):
    uses: Literal["stage"]
    with_: StageSettings = Field(..., alias="with")


class TuneStep(StepBase):
    uses: Literal["tune"]
    with_: TuneSettings = Field(..., alias="with")


class TrainStep(StepBase):
    uses: Literal["train"]
    with_: TrainSettings = Field(..., alias="with")


class EvaluateStep(StepBase):
    uses: Literal["evaluate"]
    with_: EvaluateSettings = Field(..., alias="with")


class RegisterStep(StepBase):
    uses: Literal["register"]
    with_: RegisterSettings = Field(..., alias="with")


class ExportStep(StepBase):
    uses: Literal["export"]
    with_: ExportSettings = Field(..., alias="with")


StepSpec = Annotated[
    StageStep | TuneStep | TrainStep | EvaluateStep | RegisterStep | ExportStep, Field(discriminator="uses")
]


class MetricsSpec(Strict):
    """Serve Prometheus metrics at ``http://<host>:<port>/metrics`` while the pipeline runs."""

    port: int = Field(9464, ge=0, le=65535, description="Port of the endpoint; 0 takes any free port.")
    host: str = Field("127.0.0.1", description="Address to listen on; 0.0.0.0 for a remote Prometheus.")
    linger_s: float = Field(
        0.0,
        ge=0,
        description="Seconds to keep serving after the run ends; set it to the scrape interval or more "
        "so a short pipeline is scraped at least once with its final counts.",
    )


#: SageMaker's own PyTorch training images without SMP v2 (SMP's are ``smdistributed-modelparallel``).
PLAIN_PYTORCH_IMAGE = re.compile(
    r"\.dkr\.ecr\.[^/]+\.amazonaws\.com(?:\.cn)?/(?:huggingface-)?pytorch-training(?:-neuronx)?[:@]"
)


def _may_need_smp(step: StepSpec) -> bool:
    """Whether a job of ``step`` may run with tensor parallelism or hybrid sharding: its train block's
    layout, or a searched ``parallelism.tensor`` above 1 or ``parallelism.sharding`` of hybrid."""
    if not isinstance(step, TuneStep | TrainStep):
        return False
    layout = step.with_.train.parallelism
    if layout is not None and (layout.tensor > 1 or layout.sharding == "hybrid"):
        return True
    space = step.with_.space if isinstance(step, TuneStep) else {}
    tensor, sharding = space.get("parallelism.tensor"), space.get("parallelism.sharding")
    searched_tensor = (isinstance(tensor, IntParam) and tensor.high > 1) or (
        isinstance(tensor, CategoricalParam) and any(isinstance(c, int) and c > 1 for c in tensor.choices)
    )
    return searched_tensor or (isinstance(sharding, CategoricalParam) and "hybrid" in sharding.choices)


def _job_resources(steps: Mapping[str, StepSpec]) -> list[tuple[str, Resources]]:
    """Each step's job resources with the YAML path of their ``min_nodes``."""
    found = []
    for name, step in steps.items():
        if isinstance(step, TuneStep | TrainStep):
            found.append((f"steps.{name}.with.train.resources.min_nodes", step.with_.train.resources))
        elif isinstance(step, EvaluateStep):
            found.append((f"steps.{name}.with.resources.min_nodes", step.with_.resources))
    return found


class PipelineSpec(Strict):
    """A whole pipeline: where to track it, where to run its jobs, and its steps."""

    name: FolderName = Field(..., description="The pipeline's name; its steps' jobs: <root>/jobs/<name>/.")
    tracking: TrackingSpec
    launcher: LauncherSpec = Field(default_factory=LocalLauncherSpec)
    metrics: MetricsSpec | None = Field(
        None, description="Prometheus endpoint of the running pipeline (e.g. {port: 9464}); off when unset."
    )
    steps: dict[str, StepSpec] = Field(
        ...,
        min_length=1,
        description="The steps by name; a step's name names its jobs' folder, <root>/jobs/<pipeline>/<step>/ "
        "(any name but '.' or '..', without '/' or '\\').",
    )

    @model_validator(mode="after")
    def _check_smp_image(self) -> PipelineSpec:
        """SageMaker runs tensor parallelism and hybrid sharding under SMP v2, which SageMaker's plain
        PyTorch image does not have: refuse that image for a spec whose jobs would need it."""
        launcher = self.launcher
        if not isinstance(launcher, SageMakerLauncherSpec) or launcher.image_uri is None:
            return self
        if not PLAIN_PYTORCH_IMAGE.search(launcher.image_uri):
            return self  # SMP's image, or a team's own image (which may be built from it)
        needing = [name for name, step in self.steps.items() if _may_need_smp(step)]
        if needing:
            raise ValueError(
                f"launcher.image_uri {launcher.image_uri} is SageMaker's plain PyTorch image, which has no "
                f"SMP v2, and step(s) {', '.join(needing)} use tensor parallelism or hybrid sharding, which "
                "SageMaker runs under SMP v2; fix: leave image_uri out and set framework_version (tunepod "
                "then takes the SMP image, smdistributed-modelparallel), or set image_uri to an SMP v2 image "
                "or one built from it"
            )
        return self

    @model_validator(mode="after")
    def _check_auto_parallel(self) -> PipelineSpec:
        """``num_parallel: auto`` reads the cluster, which only some launchers can (SageMaker starts
        instances per job; an EKS cluster's free capacity is the scheduler's to know)."""
        kind = self.launcher.kind
        if kind in AUTO_PARALLEL_LAUNCHERS:
            return self
        auto = [
            f"steps.{name}.with.num_parallel"
            for name, step in self.steps.items()
            if isinstance(step, TuneStep) and step.with_.num_parallel == AUTO
        ]
        if auto:
            raise ValueError(
                f"{', '.join(auto)} is auto, and the {kind} launcher cannot tell how many trials its "
                f"cluster runs at once (auto works with the {' and '.join(AUTO_PARALLEL_LAUNCHERS)} "
                f"launchers); fix: give a number, e.g. --set {auto[0]}=4"
            )
        return self

    @model_validator(mode="after")
    def _check_elastic(self) -> PipelineSpec:
        """An elastic job (``resources.min_nodes`` below ``num_nodes``) needs a launcher that can keep
        it alive across a node loss; elsewhere the spec would promise what the run cannot do."""
        kind = self.launcher.kind
        if kind in ELASTIC_LAUNCHERS:
            return self
        elastic = [field for field, resources in _job_resources(self.steps) if resources.elastic]
        if elastic:
            raise ValueError(
                f"{', '.join(elastic)} asks for an elastic job, and the {kind} launcher cannot keep a job "
                f"alive across a node loss (elastic jobs run on the {' and '.join(ELASTIC_LAUNCHERS)} "
                f"launchers; elsewhere a lost node fails the job, which is restarted and restores from its "
                f"checkpoint, counted against train.max_restarts); fix: remove min_nodes, or use a "
                f"slurm or hyperpod_eks launcher"
            )
        return self

    def secret_values(self) -> list[str]:
        """The credentials the spec hands its jobs (``env`` values of secret names): what a message
        about the run may quote, and must show ``redacted``."""
        return secret_values(self.model_dump(mode="json", by_alias=True))

    def store_uris(self) -> list[str]:
        """Every store URI the spec names (tracking, each study's storage, each warm start's): what a
        message about the run may quote, and must show ``redacted``."""
        uris = [self.tracking.uri]
        for step in self.steps.values():
            if isinstance(step, TuneStep):
                uris.append(step.with_.study.storage)
                uris += [w.storage for w in step.with_.warm_start if w.storage is not None]
        return uris
