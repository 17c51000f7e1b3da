"""The ``parallelism`` block: checked against resources at spec load (``tunepod validate``) with the
arithmetic, searched through ``parallelism.<field>`` space parameters, and handed to the job as
``TUNEPOD_PARALLELISM`` / ``ctx.parallelism``. The DeviceMesh itself: tests/integration/test_device_mesh.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tunepod import runtime
from tunepod.errors import SpecError
from tunepod.launch.contract import contract_env
from tunepod.launch.paths import JobPaths
from tunepod.runtime import Parallelism
from tunepod.runtime.parallel import mesh_dims
from tunepod.spec.loader import parse_spec
from tunepod.spec.models import PipelineSpec, TrainJob
from tunepod.spec.parallelism import ParallelismSpec, job_layout, resolve, script_params
from tunepod.spec.resources import Resources


def pipeline(train: dict[str, Any], space: dict[str, Any] | None = None) -> str:
    """A tune step whose train job is ``train`` (resources 2 nodes x 4 procs unless given)."""
    train = {"entrypoint": "train.py", "resources": {"num_nodes": 2, "procs_per_node": 4}, **train}
    study = {"name": "s", "metric": "loss", "direction": "minimize"}
    space = {"lr": {"type": "float", "low": 0.001, "high": 0.1}, **(space or {})}
    settings = {"train": train, "study": study, "space": space, "num_trials": 4}
    spec = {
        "name": "p",
        "tracking": {"experiment": "e"},
        "steps": {
            "data": {"uses": "stage", "with": {"source": "builtin://digits", "target": "fsx:///d"}},
            "search": {"uses": "tune", "needs": ["data"], "with": settings},
        },
    }
    return yaml.safe_dump(spec, sort_keys=False)


def load(text: str) -> PipelineSpec:
    return parse_spec(text, "p.yaml", check_files=False)


def refusal(text: str) -> str:
    with pytest.raises(SpecError) as caught:
        load(text)
    return str(caught.value)


def layout_of(train: dict[str, Any], params: dict[str, Any] | None = None) -> Parallelism | None:
    job = load(pipeline(train)).steps["search"].with_.train
    assert isinstance(job, TrainJob)
    return job_layout(job.parallelism, job.resources, params or {})


# ---------------------------------------------------------------------------------------------- the block


def test_data_is_derived_and_hybrid_shards_within_a_node_by_default() -> None:
    assert layout_of({}) is None  # no block: the job stays plain data parallel
    assert layout_of({"parallelism": {"tensor": 2}}) == Parallelism(data=4, tensor=2)
    assert layout_of({"parallelism": {"tensor": 2, "pipeline": 2, "sharding": "full"}}) == Parallelism(
        data=2, tensor=2, pipeline=2, sharding="full", shard=2
    )
    # 4 procs per node, tensor 2: a node holds 2 data ranks, so one copy is sharded over those 2.
    hybrid = layout_of({"parallelism": {"tensor": 2, "sharding": "hybrid"}})
    assert hybrid == Parallelism(data=4, tensor=2, sharding="hybrid", shard=2)
    assert hybrid is not None and hybrid.replicate == 2


@pytest.mark.parametrize(
    ("block", "resources", "expected"),
    [
        (
            {"data": 2, "tensor": 2, "pipeline": 2},
            {"num_nodes": 2, "procs_per_node": 2},
            "parallelism: data 2 x tensor 2 x pipeline 2 = 8, but resources gives 2 nodes x 2 "
            "procs_per_node = 4 processes\n    fix: set data to 1 (= 4 / 4) or remove it to derive it",
        ),
        (
            {"data": 4, "tensor": 2},
            {"num_nodes": 2, "procs_per_node": 2},
            "data 4 x tensor 2 x pipeline 1 = 8, but resources gives 2 nodes x 2 procs_per_node = 4 "
            "processes\n    fix: set data to 2 (= 4 / 2) or remove it to derive it",
        ),
        (
            {"data": 3, "pipeline": 3},
            {"num_nodes": 2, "procs_per_node": 4},
            "fix: make data x tensor x pipeline = 8, or change num_nodes or procs_per_node",
        ),
        (
            {"tensor": 4},
            {"num_nodes": 4, "procs_per_node": 2},
            "parallelism.tensor 4 does not divide resources.procs_per_node 2: a tensor group must stay "
            "inside one node",
        ),
        (
            {"tensor": 2, "pipeline": 3},
            {"num_nodes": 2, "procs_per_node": 4},
            "tensor 2 x pipeline 3 = 6 does not divide the 8 processes",
        ),
        (
            {"shard": 2},
            {"num_nodes": 2, "procs_per_node": 4},
            "parallelism.shard applies to sharding: hybrid",
        ),
        (
            {"sharding": "hybrid", "shard": 3},
            {"num_nodes": 2, "procs_per_node": 4},
            "parallelism.shard 3 does not divide data 8",
        ),
    ],
)
def test_a_layout_that_does_not_fit_is_refused_at_validation_with_the_arithmetic(
    block: dict[str, Any], resources: dict[str, int], expected: str
) -> None:
    message = refusal(pipeline({"parallelism": block, "resources": resources}))
    assert "steps.search.with.train" in message
    assert expected in message
    assert "fix:" in message


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"parallelism.tensor": 8}, "parallelism.tensor 8 does not divide resources.procs_per_node 4"),
        ({"parallelism.tensors": 2}, "parallelism.tensors: Extra inputs are not permitted"),
    ],
)
def test_layout_values_fixed_in_args_are_checked_like_the_block(args: dict[str, Any], expected: str) -> None:
    message = refusal(pipeline({"args": args}))
    assert "steps.search.with.train" in message and expected in message


def test_a_train_step_checks_its_layout_params_at_validation() -> None:
    train = {"entrypoint": "train.py", "resources": {"num_nodes": 1, "procs_per_node": 2}}
    final = {
        "uses": "train",
        "needs": ["data"],
        "with": {"train": train, "params": {"parallelism.tensor": 4}},
    }
    spec = yaml.safe_load(pipeline({}))
    spec["steps"]["final"] = final
    message = refusal(yaml.safe_dump(spec))
    assert "steps.final.with: parallelism.tensor 4 does not divide resources.procs_per_node 2" in message


def test_unknown_keys_in_the_block_are_refused() -> None:
    message = refusal(pipeline({"parallelism": {"tensors": 2}}))
    assert "did you mean 'tensor'?" in message


# ---------------------------------------------------------------------------------------------- the search


def test_searched_degrees_override_the_block_and_leave_the_script_params() -> None:
    spec = ParallelismSpec(sharding="full")
    params = {"lr": 0.01, "parallelism.tensor": 2, "parallelism.pipeline": 2}
    resources = Resources(num_nodes=2, procs_per_node=4)
    assert job_layout(spec, resources, params) == Parallelism(
        data=2, tensor=2, pipeline=2, sharding="full", shard=2
    )
    assert script_params(params) == {"lr": 0.01}
    # A combination of fitting values that does not fit is the tuner's to prune, with the arithmetic.
    with pytest.raises(ValueError, match=r"tensor 4 x pipeline 4 = 16 does not divide the 8 processes"):
        job_layout(spec, resources, {"parallelism.tensor": 4, "parallelism.pipeline": 4})


def test_a_search_where_every_value_fits_some_layout_is_accepted() -> None:
    space = {
        "parallelism.tensor": {"type": "categorical", "choices": [1, 2, 4]},
        "parallelism.pipeline": {"type": "int", "low": 1, "high": 2},
        "parallelism.sharding": {"type": "categorical", "choices": ["none", "full", "hybrid"]},
    }
    tune = load(pipeline({}, space)).steps["search"].with_
    assert set(tune.space) >= set(space)


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        (
            {"parallelism.tensor": {"type": "categorical", "choices": [1, 2, 8]}},
            "space.parallelism.tensor: 8 fits no layout of these resources, so every trial that samples "
            "it would be pruned (parallelism.tensor 8 does not divide resources.procs_per_node 4",
        ),
        (
            {
                "parallelism.data": {"type": "int", "low": 1, "high": 4},
                "parallelism.tensor": {"type": "int", "low": 1, "high": 2},
            },
            "space.parallelism.data: 1 fits no layout",
        ),
        ({"parallelism.tensor": {"type": "float", "low": 1, "high": 4}}, "a layout takes whole degrees"),
        ({"parallelism.tensors": {"type": "int", "low": 1, "high": 4}}, "not a layout parameter"),
        (
            {"parallelism.sharding": {"type": "categorical", "choices": ["full", "zero3"]}},
            "space.parallelism.sharding: 'zero3' fits no layout",
        ),
        (
            {"parallelism.tensor": {"type": "int", "low": 1, "high": 10**6}},
            "more than 100000 checked",
        ),
    ],
)
def test_a_searched_value_that_fits_no_layout_is_refused_at_validation(
    space: dict[str, Any], expected: str
) -> None:
    message = refusal(pipeline({}, space))
    assert "steps.search.with" in message
    assert expected in message
    assert "fix:" in message


# ---------------------------------------------------------------------------------------------- the contract


def test_the_layout_reaches_ctx_parallelism_through_the_environment(tmp_path: Path) -> None:
    layout = resolve(ParallelismSpec(tensor=2, sharding="hybrid"), Resources(num_nodes=2, procs_per_node=4))
    env = contract_env(JobPaths(tmp_path), params={}, data_dir=tmp_path, trial="1", parallelism=layout)
    assert json.loads(env[runtime.PARALLELISM_ENV])["tensor"] == 2
    ctx = runtime.init(environ={**env, "WORLD_SIZE": "8", "RANK": "3"})
    try:
        assert ctx.parallelism == layout
    finally:
        ctx.finish()
    # Without the variable a job is data parallel over every process.
    assert runtime.init(environ={"WORLD_SIZE": "4"}).parallelism == Parallelism(data=4)
    assert runtime.PARALLELISM_ENV not in contract_env(
        JobPaths(tmp_path), params={}, data_dir="/d", trial="1"
    )


@pytest.mark.parametrize(
    ("raw", "world", "expected"),
    [
        ("{not json", 4, "TUNEPOD_PARALLELISM is not a parallelism layout"),
        ('{"data": 2, "tensor": 0}', 4, "parallelism.tensor must be an integer >= 1"),
        ('{"data": 2, "sharding": "zero3"}', 2, "parallelism.sharding must be one of none, full, hybrid"),
        ('{"data": 4, "sharding": "full", "shard": 2}', 4, "fix: set shard to 4 or sharding to hybrid"),
        ('{"data": 4, "sharding": "hybrid", "shard": 3}', 4, "parallelism.shard 3 does not divide data 4"),
        (
            '{"data": 2, "tensor": 2}',
            8,
            "data 2 x tensor 2 x pipeline 1 = 4 processes, but the job runs 8 (WORLD_SIZE)",
        ),
    ],
)
def test_a_malformed_or_misfit_variable_is_refused_at_init(raw: str, world: int, expected: str) -> None:
    with pytest.raises(ValueError, match="TUNEPOD_PARALLELISM") as caught:
        runtime.init(environ={runtime.PARALLELISM_ENV: raw, "WORLD_SIZE": str(world)})
    assert expected in str(caught.value)


def test_mesh_dims_keep_size_one_axes_and_split_data_for_hybrid() -> None:
    assert mesh_dims(Parallelism(data=4, tensor=2)) == ((1, 4, 2), ("pp", "dp", "tp"))
    hybrid = Parallelism(data=4, pipeline=2, sharding="hybrid", shard=2)
    assert mesh_dims(hybrid) == ((2, 2, 2, 1), ("pp", "dp_replicate", "dp_shard", "tp"))


def test_a_train_step_refuses_a_best_layout_that_does_not_fit_its_own_resources() -> None:
    from tunepod.errors import JobError
    from tunepod.steps.jobs import StepJob, _layout

    train = TrainJob(entrypoint="train.py", resources=Resources(num_nodes=1, procs_per_node=2))
    job = StepJob(
        what="Train step final",
        name="p-final",
        entrypoint="train.py",
        job_dir=Path("/unused"),
        params={"lr": 0.1, "parallelism.tensor": 4},  # the study's best, found on 4 procs per node
        data_dir="/d",
        resources=train.resources,
        train=train,
    )
    with pytest.raises(JobError, match=r"Train step final: its parallelism layout does not fit") as caught:
        _layout(job)
    assert "parallelism.tensor 4 does not divide resources.procs_per_node 2" in str(caught.value)
    fitting = dataclasses.replace(job, params={"parallelism.tensor": 2})
    assert _layout(fitting) == Parallelism(data=1, tensor=2)
    evaluation = dataclasses.replace(job, train=None)
    assert _layout(evaluation) is None  # only training jobs take a layout
