"""``Resources``: what one job asks for, in one vocabulary every launcher maps onto its own.

It lives in ``spec`` (not ``launch``) so that the dependency runs one way: launchers read the spec's
types, and the spec never imports a launcher.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_TIME_LIMIT_WARNING_S = 60


class Resources(BaseModel):
    """What one job asks for, in one vocabulary that each backend maps onto its own.

    A backend warns once about a field it cannot honour rather than failing silently.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_nodes: int = Field(1, ge=1, description="Machines the job spans.")
    min_nodes: int | None = Field(
        None,
        ge=1,
        description="Elastic trial: the fewest machines the job may go on with. Below num_nodes, torchrun "
        "runs with --nnodes=min_nodes:num_nodes and a c10d rendezvous, and when a node dies the survivors "
        "re-form the group with fewer nodes and go on from the newest checkpoint step (the memory tier's "
        "with train.checkpoints), in the same job. Slurm and hyperpod_eks only; the first node of a Slurm "
        "job hosts the rendezvous, so losing it falls back to requeue and restore. null: not elastic.",
    )
    procs_per_node: int = Field(
        1, ge=1, description="Training processes per machine (torchrun --nproc-per-node)."
    )
    gpus_per_node: int = Field(0, ge=0, description="Accelerators per machine; 0 runs on CPU.")
    instance_type: str | None = Field(None, description="Cloud instance type (SageMaker, HyperPod).")
    timeout_min: float | None = Field(
        None,
        gt=0,
        description="Run time of each attempt, from when it starts running (queue time does not count); "
        "the job is stopped after it.",
    )
    stop_grace_s: int | None = Field(
        None,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL whenever the job is stopped (a prune, a timeout, "
        "a preemption or requeue, the time limit), for the script to save a checkpoint when it sees "
        "ctx.should_stop(). null: the backend's own (local: the launcher's cancel_grace_s; Slurm: the "
        "cluster's KillWait, and --signal 60 s before the time limit; EKS: Kubernetes' 30 s). SageMaker "
        "always gives 120 s.",
    )

    @model_validator(mode="after")
    def _check_min_nodes(self) -> Resources:
        if self.min_nodes is not None and self.min_nodes > self.num_nodes:
            raise ValueError(
                f"resources.min_nodes {self.min_nodes} is above num_nodes {self.num_nodes}: min_nodes is "
                f"the fewest nodes an elastic job goes on with, num_nodes the most it starts with; fix: set "
                f"min_nodes to at most {self.num_nodes}, or num_nodes to at least {self.min_nodes}"
            )
        return self

    @property
    def elastic(self) -> bool:
        """Whether the job may go on with fewer nodes than it started with."""
        return self.min_nodes is not None and self.min_nodes < self.num_nodes

    @property
    def nnodes(self) -> str:
        """torchrun's ``--nnodes``: ``min:max`` for an elastic job, else the node count."""
        return f"{self.min_nodes}:{self.num_nodes}" if self.elastic else str(self.num_nodes)

    @property
    def elastic_restarts(self) -> int:
        """torchrun's ``--max-restarts`` for an elastic job: one re-forming per node it may lose (a
        worker that fails for another reason uses one too, so the count stays bounded)."""
        return self.num_nodes - self.min_nodes if self.min_nodes is not None and self.elastic else 0

    @property
    def time_limit_warning_s(self) -> int:
        """How long before the run-time limit a backend that can warn (Slurm's ``--signal``) sends
        SIGTERM: the stop grace, or a minute."""
        return DEFAULT_TIME_LIMIT_WARNING_S if self.stop_grace_s is None else max(1, self.stop_grace_s)
