"""``Resources``: what one job asks for, in one vocabulary every launcher maps onto its own.

It lives in ``spec`` (not ``launch``) so that the dependency runs one way: launchers read the spec's
types, and the spec never imports a launcher.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
