"""The LCBench arm registry (benchmarks/lcbench/arms.py) and a short run of every arm: each spends
exactly its budget, in time order, and replays from its seed. A peer's arm is skipped when its
package is absent (they come with `pip install 'tunepod[bench]'`, never with tunepod itself). The slow
arms (SLOW_ARMS: their model fits take 5-15 s even on this short budget) are left to the benchmark."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.lcbench.__main__ import main as lcbench_main
from benchmarks.lcbench.arms import ARMS, BASELINE, REQUIRES, SLOW_ARMS
from benchmarks.lcbench.merge import main as merge_main
from benchmarks.lcbench.problem import Budget, Problem, make_problem
from benchmarks.quality.__main__ import lcbench_argv

BUDGET = Budget(total_epochs=3 * 52, n_workers=2, startup_s=5.0)
# The peers call ConfigSpace's and pandas' deprecated methods; not this project's to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def problem() -> Problem:
    return make_problem("7593")


def test_every_arm_takes_a_problem_a_seed_and_a_budget() -> None:
    assert BASELINE in ARMS
    assert set(REQUIRES) <= set(ARMS) and set(SLOW_ARMS) <= set(ARMS)
    for arm in ARMS.values():
        assert list(inspect.signature(arm).parameters) == ["problem", "seed", "budget"]


@pytest.mark.parametrize("name", [arm for arm in ARMS if arm not in SLOW_ARMS])
def test_a_short_run_spends_its_budget_and_replays(name: str, problem: Problem) -> None:
    for module in REQUIRES.get(name, ()):
        pytest.importorskip(module)
    first = ARMS[name](problem, 7, BUDGET)
    assert len(first.value) == BUDGET.total_epochs
    assert np.all(np.diff(first.time_s) >= 0) and first.end_s == first.time_s[-1]
    assert first.num_jobs >= first.num_trials >= 2
    again = ARMS[name](problem, 7, BUDGET)
    assert np.array_equal(first.value, again.value) and np.array_equal(first.time_s, again.time_s)


def test_the_quality_benchmark_hands_lcbench_its_own_arguments() -> None:
    assert lcbench_argv(["--workload", "lcbench", "--instances", "3945", "--seeds", "2"]) == [
        "--instances",
        "3945",
        "--seeds",
        "2",
    ]
    assert lcbench_argv(["--seeds", "2"]) is None
    assert lcbench_argv(["--workload", "digits", "--llm"]) is None


def test_the_command_writes_its_numbers(tmp_path: Path) -> None:
    out = tmp_path / "lcbench.json"
    argv = ["--instances", "3945", "--seeds", "2", "--arms", BASELINE, "--budget-trials", "2", "--jobs", "1"]
    assert lcbench_main([*argv, "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["budget"]["total_epochs"] == 104
    assert [(run["arm"], run["seed"]) for run in document["runs"]] == [(BASELINE, 0), (BASELINE, 1000)]
    (row,) = document["per_instance"]
    assert row["fraction_to_random"] <= 1.0


def test_runs_of_other_arms_and_instances_merge_into_one_table(tmp_path: Path) -> None:
    """Runs of instances apart and of arms apart, on random search's seeds, pool into one table; an
    arm missing an instance, or a file whose random rows differ (other seeds), is refused."""

    def run(name: str, instances: str, arms: str, *more: str) -> str:
        out = tmp_path / f"{name}.json"
        argv = [
            "--instances",
            instances,
            "--arms",
            arms,
            "--seeds",
            "2",
            "--budget-trials",
            "2",
            "--jobs",
            "1",
        ]
        assert lcbench_main([*argv, *more, "--json", str(out)]) == 0
        return str(out)

    part_1, part_2 = run("1", "3945", "optuna-tpe-hyperband"), run("2", "7593", "optuna-tpe-hyperband")
    random_again = run("random", "3945", BASELINE)
    merged = tmp_path / "merged.json"
    assert merge_main([part_1, part_2, random_again, "--json", str(merged)]) == 0
    document = json.loads(merged.read_text())
    pairs = sorted((row["arm"], row["instance"]) for row in document["per_instance"])
    assert pairs == [
        ("optuna-tpe-hyperband", "3945"),
        ("optuna-tpe-hyperband", "7593"),
        *[(BASELINE, i) for i in ("3945", "7593")],
    ]
    assert len(document["runs"]) == 8  # random's runs on 3945 counted once
    assert [arm["instances"] for arm in document["overall"]] == [2, 2]

    with pytest.raises(SystemExit):  # optuna has no row on 7593: its mean rank would not compare
        merge_main([part_1, run("random-7593", "7593", BASELINE)])
    with pytest.raises(SystemExit, match="ran other seeds"):
        merge_main([part_1, run("other-seeds", "3945", BASELINE, "--first-seed", "7")])
