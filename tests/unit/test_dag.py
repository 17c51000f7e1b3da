"""The DAG: input rules from one table, deterministic order, concurrent levels, Mermaid, cycles."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest

from tunepod.dag import INPUT_RULES, Dag, build_dag, describe_inputs, find_problems, format_path
from tunepod.errors import SpecError
from tunepod.spec import PipelineSpec, StepSpec, load_spec

SPECS = Path(__file__).resolve().parents[1] / "fixtures" / "specs"


def fixture_dag(name: str) -> Dag:
    return build_dag(load_spec(SPECS / f"{name}.yaml", check_files=False))


def spec_of(steps: dict[str, dict[str, Any]]) -> PipelineSpec:
    """A spec whose steps carry only ``uses`` and ``needs``: the DAG looks at nothing else."""
    settings: dict[str, dict[str, Any]] = {
        "stage": {"source": "a", "target": "b"},
        "tune": {
            "train": {"entrypoint": "t.py"},
            "study": {"name": "s", "metric": "m"},
            "num_trials": 1,
            "space": {"x": {"type": "int", "low": 0, "high": 1}},
        },
        "train": {"train": {"entrypoint": "t.py"}},
        "evaluate": {"entrypoint": "e.py", "metric": "m"},
        "register": {"model": "m"},
        "export": {"file_system_id": "fs-0123456789abcdef0", "s3_prefix": "s3://b/p/"},
    }
    return PipelineSpec.model_validate(
        {
            "name": "p",
            "tracking": {"experiment": "e"},
            "steps": {name: {**step, "with": settings[step["uses"]]} for name, step in steps.items()},
        }
    )


def test_rules_cover_exactly_the_step_kinds_the_models_accept() -> None:
    union = get_args(get_args(StepSpec)[0])
    model_kinds = {kind for member in union for kind in get_args(member.model_fields["uses"].annotation)}
    assert set(INPUT_RULES) == model_kinds


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("stage", "a stage step takes no inputs"),
        ("tune", "a tune step takes exactly one stage step"),
        ("train", "a train step takes exactly one stage step and optionally one tune step"),
        ("evaluate", "an evaluate step takes exactly one tune or train step"),
        ("register", "a register step takes exactly one evaluate step"),
        ("export", "an export step takes exactly one tune or train step"),
    ],
)
def test_rules_read_as_sentences(kind: str, words: str) -> None:
    assert describe_inputs(kind) == words


def test_linear_pipeline() -> None:
    dag = fixture_dag("valid")
    assert dag.order == ["data", "search", "check", "promote"]
    assert dag.levels == [["data"], ["search"], ["check"], ["promote"]]
    assert dag.inputs("data") == {}
    assert dag.inputs("search") == {"stage": "data"}
    assert dag.inputs("check") == {"tune": "search"}
    assert dag.inputs("promote") == {"evaluate": "check"}
    assert dag.kind("check") == "evaluate"
    assert dag.to_mermaid() == (
        "flowchart LR\n"
        '    data["data<br/>stage"]\n'
        '    search["search<br/>tune"]\n'
        '    check["check<br/>evaluate"]\n'
        '    promote["promote<br/>register"]\n'
        "    data --> search\n"
        "    search --> check\n"
        "    check --> promote\n"
    )


def test_branches_run_concurrently_and_ties_follow_spec_order() -> None:
    # fanout.yaml lists promote and check_final before the steps they need.
    dag = fixture_dag("fanout")
    assert dag.levels == [["data"], ["wide", "narrow"], ["final", "check_wide"], ["check_final"], ["promote"]]
    # Among the steps ready at once, the one written first goes first.
    assert dag.order == ["data", "wide", "narrow", "final", "check_final", "promote", "check_wide"]
    assert dag.inputs("final") == {"stage": "data", "tune": "narrow"}
    assert dag.inputs("check_wide") == {"tune": "wide"}
    assert dag.inputs("check_final") == {"train": "final"}


def test_inputs_is_a_copy() -> None:
    dag = fixture_dag("valid")
    dag.inputs("search")["stage"] = "other"
    assert dag.inputs("search") == {"stage": "data"}


def test_build_dag_raises_with_every_problem_by_path() -> None:
    spec = spec_of(
        {
            "data": {"uses": "stage"},
            "a": {"uses": "evaluate", "needs": ["b"]},
            "b": {"uses": "train", "needs": ["data", "a"]},
            "loop": {"uses": "register", "needs": ["loop"]},
        }
    )
    with pytest.raises(SpecError) as caught:
        build_dag(spec, source="inline")
    rendered = str(caught.value)
    assert "inline: steps.a.needs: the steps form a cycle: a -> b -> a" in rendered
    assert "inline: steps.loop.needs: the steps form a cycle: loop -> loop" in rendered
    assert "inline: steps.b.needs[1]: 'a' is an evaluate step, but a train step takes" in rendered
    assert all(issue.line is None for issue in caught.value.issues)


@pytest.mark.parametrize(
    ("steps", "path", "message"),
    [
        (
            {"s1": {"uses": "stage"}, "s2": {"uses": "stage"}, "t": {"uses": "tune", "needs": ["s1", "s2"]}},
            "steps.t.needs",
            "needs 2 stage steps (s1, s2), but a tune step takes exactly one stage step",
        ),
        (
            {"s": {"uses": "stage", "needs": ["s0"]}, "s0": {"uses": "stage"}},
            "steps.s.needs[0]",
            "'s0' is a stage step, but a stage step takes no inputs",
        ),
        (
            {
                "s": {"uses": "stage"},
                "t": {"uses": "tune", "needs": ["s"]},
                "f": {"uses": "train", "needs": ["s", "t"]},
                "e": {"uses": "evaluate", "needs": ["t", "f"]},
            },
            "steps.e.needs",
            "needs 2 tune or train steps (t, f), but an evaluate step takes exactly one tune or train step",
        ),
        (
            {"s": {"uses": "stage"}, "r": {"uses": "register"}},
            "steps.r.needs",
            "a register step takes exactly one evaluate step; none is listed",
        ),
    ],
    ids=["two stages", "stage with input", "two evaluated", "register alone"],
)
def test_input_kind_problems(steps: dict[str, dict[str, Any]], path: str, message: str) -> None:
    problems = {format_path(p.path): p for p in find_problems(spec_of(steps))}
    assert path in problems, problems
    assert problems[path].message == message
    assert problems[path].fix


def test_train_takes_a_stage_and_optionally_a_tune() -> None:
    with_tune = spec_of(
        {
            "s": {"uses": "stage"},
            "t": {"uses": "tune", "needs": ["s"]},
            "f": {"uses": "train", "needs": ["t", "s"]},
        }
    )
    assert build_dag(with_tune).inputs("f") == {"tune": "t", "stage": "s"}
    alone = spec_of({"s": {"uses": "stage"}, "f": {"uses": "train", "needs": ["s"]}})
    assert build_dag(alone).inputs("f") == {"stage": "s"}


def test_export_takes_the_trials_of_a_tune_or_a_train_step() -> None:
    steps = {
        "s": {"uses": "stage"},
        "t": {"uses": "tune", "needs": ["s"]},
        "f": {"uses": "train", "needs": ["s"]},
        "x": {"uses": "export", "needs": ["f"]},
    }
    assert build_dag(spec_of(steps)).inputs("x") == {"train": "f"}
    problems = find_problems(spec_of({**steps, "x": {"uses": "export"}}))
    assert [(format_path(p.path), p.message, p.fix) for p in problems] == [
        (
            "steps.x.needs",
            "an export step takes exactly one tune or train step; none is listed",
            "add one of these steps to needs: t, f",
        )
    ]


def test_mermaid_ids_stay_valid_for_any_step_name() -> None:
    spec = spec_of({"raw data": {"uses": "stage"}, "end": {"uses": "tune", "needs": ["raw data"]}})
    text = build_dag(spec).to_mermaid()
    assert '    step0["raw data<br/>stage"]' in text
    assert '    step1["end<br/>tune"]' in text
    assert "    step0 --> step1" in text
