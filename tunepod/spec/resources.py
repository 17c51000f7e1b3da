"""``Resources``: what one job asks for, in one vocabulary every launcher maps onto its own.

It lives in ``spec`` (not ``launch``) so that the dependency runs one way: launchers read the spec's
types, and the spec never imports a launcher.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TIME_LIMIT_WARNING_S = 60


class Resources(BaseModel):
    """What one job asks for, in one vocabulary that each backend maps onto its own.

    A backend warns once about a field it cannot honour rather than failing silently.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_nodes: int = Field(1, ge=1, description="Machines the job spans.")
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

    @property
    def time_limit_warning_s(self) -> int:
        """How long before the run-time limit a backend that can warn (Slurm's ``--signal``) sends
        SIGTERM: the stop grace, or a minute."""
        return DEFAULT_TIME_LIMIT_WARNING_S if self.stop_grace_s is None else max(1, self.stop_grace_s)
