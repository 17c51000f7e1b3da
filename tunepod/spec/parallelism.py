"""The ``parallelism`` block of a train job, checked against its resources, and searched layouts.

A layout is ``data x tensor x pipeline`` processes plus how the data axis shards the model. It must
use exactly the job's ``num_nodes x procs_per_node`` processes, and tensor groups must fit inside one
node (their collectives run once per layer, too often for the network between nodes). ``data`` may be
left out: it is then whatever the other degrees leave of the world size.

A study searches layouts with space parameters named ``parallelism.<field>`` (``parallelism.tensor``,
``parallelism.pipeline``, ``parallelism.data``, ``parallelism.sharding``, ``parallelism.shard``):
they override the block for that trial and reach the job as ``TUNEPOD_PARALLELISM``, not as script
parameters. ``check_space`` refuses, before anything runs, a choice that fits no layout; a sampled
combination of fitting choices that does not fit (tensor 4 x pipeline 2 on 4 processes) is pruned by
the tuner without starting a job (see ``tunepod.hpo.tuner``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunepod.runtime.parallel import Parallelism
from tunepod.spec.resources import Resources

SPACE_PREFIX = "parallelism."
# The product of the searched layout parameters' values checked at validation; past it only each
# value's own fit would be guessed, so a larger search is refused rather than half checked.
MAX_LAYOUTS = 100_000


class ParallelismSpec(BaseModel):
    """How a job's processes split the work: ``data x tensor x pipeline = num_nodes x procs_per_node``.

    Every launcher hands it to the job (``TUNEPOD_PARALLELISM``, ``ctx.parallelism``,
    ``ctx.device_mesh()``); SageMaker also renders it as SMP v2 parameters.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: int | None = Field(
        None, ge=1, description="Data-parallel degree; unset: world size / (tensor x pipeline)."
    )
    tensor: int = Field(1, ge=1, description="Tensor-parallel degree; must divide procs_per_node.")
    pipeline: int = Field(1, ge=1, description="Pipeline stages (torch.distributed.pipelining).")
    sharding: Literal["none", "full", "hybrid"] = Field(
        "none",
        description="How the data axis holds the model: none replicates it (DDP), full shards it over "
        "every data rank (FSDP2), hybrid shards it over groups of `shard` data ranks and replicates "
        "across groups (HSDP; SMP v2 hybrid_shard_degree).",
    )
    shard: int | None = Field(
        None,
        ge=1,
        description="sharding: hybrid only: data ranks one copy is sharded over; unset: the data ranks "
        "of one node.",
    )


def resolve(spec: ParallelismSpec, resources: Resources) -> Parallelism:
    """The layout ``spec`` describes on ``resources``; ``ValueError`` with the arithmetic and a fix."""
    world = resources.num_nodes * resources.procs_per_node
    nodes, per_node = resources.num_nodes, resources.procs_per_node
    procs = f"resources gives {nodes} nodes x {per_node} procs_per_node = {world} processes"
    if resources.procs_per_node % spec.tensor:
        raise ValueError(
            f"parallelism.tensor {spec.tensor} does not divide resources.procs_per_node "
            f"{resources.procs_per_node}: a tensor group must stay inside one node (its collectives run "
            f"once per layer, too often for the network between nodes); fix: set tensor to one of "
            f"{_divisors(resources.procs_per_node)}, or procs_per_node to a multiple of {spec.tensor}"
        )
    model = spec.tensor * spec.pipeline
    if spec.data is None:
        if world % model:
            raise ValueError(
                f"parallelism: tensor {spec.tensor} x pipeline {spec.pipeline} = {model} does not divide "
                f"the {world} processes ({procs}), so no data degree fits; fix: make tensor x pipeline "
                f"one of {_divisors(world)}, or change num_nodes or procs_per_node"
            )
        data = world // model
    else:
        data = spec.data
        if data * model != world:
            raise ValueError(
                f"parallelism: data {data} x tensor {spec.tensor} x pipeline {spec.pipeline} = "
                f"{data * model}, but {procs}; fix: " + _fix_data(world, model)
            )
    return Parallelism(data, spec.tensor, spec.pipeline, spec.sharding, _shard(spec, data, resources))


def _fix_data(world: int, model: int) -> str:
    if world % model == 0:
        return f"set data to {world // model} (= {world} / {model}) or remove it to derive it"
    return f"make data x tensor x pipeline = {world}, or change num_nodes or procs_per_node"


def _shard(spec: ParallelismSpec, data: int, resources: Resources) -> int:
    if spec.sharding != "hybrid":
        if spec.shard is not None:
            raise ValueError(
                f"parallelism.shard applies to sharding: hybrid only (sharding is {spec.sharding}); "
                "fix: remove shard, or set sharding: hybrid"
            )
        return 1 if spec.sharding == "none" else data
    if spec.shard is None:
        # The data ranks of one node: tensor ranks are innermost, so a node holds this many data ranks.
        return math.gcd(data, max(1, resources.procs_per_node // spec.tensor))
    if data % spec.shard:
        raise ValueError(
            f"parallelism.shard {spec.shard} does not divide data {data}: the data ranks split into "
            f"groups of shard; fix: set shard to one of {_divisors(data)}"
        )
    return spec.shard


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def with_params(spec: ParallelismSpec | None, params: Mapping[str, Any]) -> ParallelismSpec | None:
    """``spec`` with the trial's ``parallelism.<field>`` parameters applied; None when neither is set."""
    overrides = {
        name[len(SPACE_PREFIX) :]: value for name, value in params.items() if name.startswith(SPACE_PREFIX)
    }
    if spec is None and not overrides:
        return None
    base = spec.model_dump(exclude_unset=True) if spec is not None else {}
    try:
        return ParallelismSpec.model_validate({**base, **overrides})
    except ValidationError as exc:
        problems = "; ".join(
            f"{SPACE_PREFIX}{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        valid = ", ".join(SPACE_PREFIX + field for field in ParallelismSpec.model_fields)
        raise ValueError(
            f"{problems}; fix: layout parameters are {valid}, with values as in the block"
        ) from None


def script_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a script sees: the layout ones travel as ``TUNEPOD_PARALLELISM`` instead."""
    return {name: value for name, value in params.items() if not name.startswith(SPACE_PREFIX)}


def job_layout(
    spec: ParallelismSpec | None, resources: Resources, params: Mapping[str, Any]
) -> Parallelism | None:
    """The layout a job with trial ``params`` runs, or None when it declares none (data parallel).

    ``ValueError`` with the arithmetic when the combination does not fit ``resources``.
    """
    merged = with_params(spec, params)
    return None if merged is None else resolve(merged, resources)


def check_space(
    spec: ParallelismSpec | None, resources: Resources, space: Mapping[str, Any], fixed: Mapping[str, Any]
) -> None:
    """Refuse searched layout parameters that can never fit (``ValueError``, naming the parameter);
    ``fixed`` are the train job's args, which may fix other layout parameters.

    Every combination of the searched values is resolved: the search must have a layout that fits,
    and each value must fit in at least one combination (else trials that sample it only ever prune).
    """
    searched = {name: _values(name, param) for name, param in space.items() if name.startswith(SPACE_PREFIX)}
    if not searched:
        return
    unknown = [name for name in searched if name[len(SPACE_PREFIX) :] not in ParallelismSpec.model_fields]
    if unknown:
        valid = ", ".join(SPACE_PREFIX + field for field in ParallelismSpec.model_fields)
        raise ValueError(f"space.{unknown[0]} is not a layout parameter; fix: use one of {valid}")
    size = math.prod(len(values) for values in searched.values())
    if size > MAX_LAYOUTS:
        raise ValueError(
            f"the layout parameters span {size} combinations, more than {MAX_LAYOUTS} checked; fix: "
            "list the degrees as categorical choices (e.g. choices: [1, 2, 4, 8])"
        )
    fits: dict[str, set[Any]] = {name: set() for name in searched}
    first_error: dict[tuple[str, Any], str] = {}
    for combo in itertools.product(*searched.values()):
        params = dict(zip(searched, combo, strict=True))
        try:
            job_layout(spec, resources, {**fixed, **params})
        except ValueError as exc:
            for name, value in params.items():
                first_error.setdefault((name, value), str(exc).partition("; fix: ")[0])
            continue
        for name, value in params.items():
            fits[name].add(value)
    for name, values in searched.items():
        for value in values:
            if value not in fits[name]:
                raise ValueError(
                    f"space.{name}: {value!r} fits no layout of these resources, so every trial that "
                    f"samples it would be pruned ({first_error[(name, value)]}); fix: remove {value!r} "
                    f"from space.{name}"
                )


def _values(name: str, param: Any) -> Sequence[Any]:
    kind = getattr(param, "type", None)
    if kind == "categorical":
        return list(param.choices)
    if kind == "int":
        return list(range(param.low, param.high + 1, param.step))
    raise ValueError(
        f"space.{name} is a {kind} parameter, but a layout takes whole degrees; fix: make it "
        "type: categorical (e.g. choices: [1, 2, 4]) or type: int"
    )
