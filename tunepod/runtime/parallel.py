"""The job's parallelism layout (``TUNEPOD_PARALLELISM``) and the ``DeviceMesh`` that matches it.

The orchestrator checks the layout against the job's resources before anything runs and hands it over
as JSON; ``ctx.parallelism`` reads it back, and ``device_mesh`` builds the mesh a script hands to
``fully_shard`` (FSDP2), ``parallelize_module`` (tensor parallelism) and ``torch.distributed.pipelining``.

Rank order, outermost first: pipeline, data, tensor. Tensor ranks are contiguous, so with tensor
dividing ``procs_per_node`` (the spec's rule) a tensor group never spans two nodes: its collectives,
one per layer, stay on the node's fast links; data-parallel collectives, fewer and overlappable,
cross nodes. Standard library only at import time; torch is imported by ``device_mesh``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Sharding = Literal["none", "full", "hybrid"]
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)


@dataclass(frozen=True)
class Parallelism:
    """How a job's ``data x tensor x pipeline`` processes split the work. Immutable.

    ``sharding`` says how the data axis holds the model: ``none`` replicates it (DDP), ``full``
    shards it over every data rank (FSDP2 / ZeRO-3), ``hybrid`` shards it over groups of ``shard``
    data ranks and replicates it across the ``data // shard`` groups (HSDP). ``shard`` is the number
    of data ranks one copy is sharded over: 1 for ``none``, ``data`` for ``full``.
    """

    data: int
    tensor: int = 1
    pipeline: int = 1
    sharding: Sharding = "none"
    shard: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline", "shard"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallelism.{name} must be an integer >= 1, got {value!r}")
        if self.sharding not in SHARDINGS:
            raise ValueError(
                f"parallelism.sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}"
            )
        expected = {"none": 1, "full": self.data}.get(self.sharding)
        if expected is not None and self.shard != expected:
            raise ValueError(
                f"parallelism.shard is {self.shard} but sharding {self.sharding} shards over {expected} "
                f"data rank(s); fix: set shard to {expected} or sharding to hybrid"
            )
        if self.data % self.shard:
            raise ValueError(
                f"parallelism.shard {self.shard} does not divide data {self.data}; fix: use a divisor "
                "of data (the data ranks split into groups of shard)"
            )

    @property
    def world_size(self) -> int:
        """Processes the layout needs: ``data x tensor x pipeline``."""
        return self.data * self.tensor * self.pipeline

    @property
    def replicate(self) -> int:
        """Copies of the model along the data axis: ``data // shard``."""
        return self.data // self.shard

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def data_parallel(cls, world_size: int) -> Parallelism:
        """The layout of a job that declares none: every process a data-parallel replica."""
        return cls(data=world_size)


def read_parallelism(env: Mapping[str, str], name: str, world_size: int) -> Parallelism:
    """The layout in ``env[name]`` (JSON), else plain data parallelism over ``world_size``.

    Raises ``ValueError`` naming the variable when it is malformed or does not fit ``world_size``
    (a job started with other resources than the spec checked, e.g. SageMaker's one process per GPU).
    """
    raw = env.get(name, "").strip()
    if not raw:
        return Parallelism.data_parallel(world_size)
    try:
        fields = json.loads(raw)
        layout = Parallelism(**fields)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{name} is not a parallelism layout ({exc}): {raw!r}; expected JSON such as "
            '{"data": 2, "tensor": 2, "pipeline": 1, "sharding": "full", "shard": 2}'
        ) from None
    if layout.world_size != world_size:
        raise ValueError(
            f"{name}: data {layout.data} x tensor {layout.tensor} x pipeline {layout.pipeline} = "
            f"{layout.world_size} processes, but the job runs {world_size} (WORLD_SIZE); fix: make the "
            "spec's resources (num_nodes x procs_per_node) match the layout"
        )
    return layout


def mesh_dims(layout: Parallelism) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh's shape and dimension names, outermost first.

    Size-1 dimensions are kept, so a script indexes ``mesh["tp"]`` whatever the layout and one script
    serves every layout a study searches. Hybrid sharding splits the data axis in two, replicas
    outside shards, because FSDP2 does HSDP over a 2-D mesh; ``device_mesh`` adds ``dp`` as their
    flattened whole for the data loader and loss averaging.
    """
    if layout.sharding == "hybrid":
        shape = (layout.pipeline, layout.replicate, layout.shard, layout.tensor)
        return shape, ("pp", "dp_replicate", "dp_shard", "tp")
    return (layout.pipeline, layout.data, layout.tensor), ("pp", "dp", "tp")


def device_mesh(layout: Parallelism, device_type: str = "cpu") -> DeviceMesh:
    """Every rank: the ``DeviceMesh`` of ``layout`` (dims ``pp``, ``dp``, ``tp``; see ``mesh_dims``).

    Call it on every rank after ``torchrun`` started the job (it initializes the default process group
    when the script has not: gloo for ``cpu``, nccl for ``cuda``). ``device_type="cuda"`` expects the
    script to have called ``torch.cuda.set_device(local_rank)``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = mesh_dims(layout)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if layout.sharding == "hybrid":
        # DeviceMesh._flatten is private but the way torchtitan names a merged axis; without it a
        # script would rebuild the data group by hand.
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh
