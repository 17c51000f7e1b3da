"""Population-based training's rule over frozen Optuna trials (``tunepod.hpo.pbt``): members and their
lineages, the ranking at a boundary, who is exploited and from whom, each boundary judged once, how
parameters are explored; and the spec's ``pbt`` block with each error it documents."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial
from pydantic import ValidationError

from tunepod.hpo.pbt import ATTR_PBT, BoundaryJudge, Pbt, PbtState, _perturb, generation_of, member_of
from tunepod.spec.models import TuneSettings

PBT = Pbt(population=4, interval=2, quantile=0.25, maximize=True, max_resource=8)


def trial(
    number: int, values: dict[int, float], lineage: PbtState | None = None, x: float = 0.5
) -> FrozenTrial:
    made = create_trial(
        state=TrialState.RUNNING,
        params={"x": x},
        distributions={"x": FloatDistribution(0, 1)},
        intermediate_values=values,
        user_attrs={} if lineage is None else {ATTR_PBT: lineage.to_attr()},
    )
    made.number = number
    return made


def continuing(member: int, generation: int, parent: int, from_step: int, replaces: int) -> PbtState:
    return PbtState(
        member, generation, parent, from_step, replaces, seed=f"/jobs/trial-{replaces}/seed/step-1"
    )


def test_a_members_first_trial_has_no_lineage_and_a_continuation_names_its_member() -> None:
    first = trial(3, {0: 0.1})
    later = trial(7, {5: 0.9}, continuing(member=3, generation=1, parent=0, from_step=4, replaces=3))
    assert (member_of(first), generation_of(first), PbtState.of(first)) == (3, 0, None)
    assert (member_of(later), generation_of(later)) == (3, 1)
    assert PbtState.of(later) == continuing(3, 1, 0, 4, 3)


def test_a_members_curve_takes_the_newer_generation_where_both_reported() -> None:
    first = trial(1, {0: 0.1, 1: 0.2, 2: 0.3})
    later = trial(5, {2: 0.8, 3: 0.9}, continuing(1, 1, 0, 1, 1))
    assert PBT.curve(1, [first, later]) == {0: 0.1, 1: 0.2, 2: 0.8, 3: 0.9}
    assert PBT.value_at(1, 2, [first, later]) == 0.2  # 2 units: step 1
    assert PBT.value_at(1, 3, [first, later]) == 0.8
    assert PBT.value_at(1, 9, [first, later]) is None


def test_the_bottom_quantile_copies_from_the_top_once_enough_members_are_there() -> None:
    members = [trial(n, {1: v}) for n, v in enumerate([0.9, 0.5, 0.7, 0.1])]
    # Three ranked (the fourth failed short of the boundary, say): ceil(3 x 0.25) = 1 in each quantile.
    assert PBT.donors_for(3, 2, members[1:]) == [2]
    # All four: the worst copies from the best.
    assert PBT.ranking(2, members) == [0, 2, 1, 3]
    assert PBT.donors_for(3, 2, members) == [0]
    assert PBT.donors_for(1, 2, members) == []
    half = Pbt(population=4, interval=2, quantile=0.5, maximize=False)
    assert half.donors_for(0, 2, members) == [3, 1]  # minimizing: the highest is the worst


@pytest.mark.parametrize(
    ("ranked", "quantile", "in_each"),
    [
        (1, 0.5, 0),  # nobody to copy from
        (2, 0.25, 1),  # floor(2 x 0.25) = 0 never exploited: PBT ran as random search
        (3, 0.25, 1),
        (4, 0.25, 1),
        (5, 0.25, 2),
        (8, 0.25, 2),
        (9, 0.25, 3),
        (3, 0.5, 1),  # ceil(1.5) = 2 is past half: the middle member is in neither
        (4, 0.5, 2),
        (10, 0.01, 1),
    ],
)
def test_each_quantile_holds_ceil_n_x_quantile_members_and_at_most_half(
    ranked: int, quantile: float, in_each: int
) -> None:
    rule = Pbt(population=ranked, interval=2, quantile=quantile, maximize=True)
    members = [trial(n, {1: 1.0 - n / 100}) for n in range(ranked)]  # member 0 is the best
    exploited = [m for m in range(ranked) if rule.donors_for(m, 2, members)]
    assert exploited == list(range(ranked - in_each, ranked))
    assert all(rule.donors_for(m, 2, members) == list(range(in_each)) for m in exploited)


def test_a_population_of_two_exploits_and_four_go_on_exploiting_after_one_failed() -> None:
    pair = Pbt(population=2, interval=2, quantile=0.25, maximize=True)
    assert BoundaryJudge.for_job(pair, trial(1, {})).judge(
        2, lambda: [trial(0, {1: 0.9}), trial(1, {1: 0.2})]
    ) == [0]
    failed = trial(3, {0: 0.9})
    failed.state = TrialState.FAIL  # three of four ranked at 2 units
    others = [trial(0, {1: 0.9}), trial(1, {1: 0.5}), failed]
    assert BoundaryJudge.for_job(PBT, trial(2, {})).judge(2, lambda: [*others, trial(2, {1: 0.1})]) == [0]


@pytest.mark.parametrize("quantile", [0.0, -0.25, 0.51])
def test_the_quantile_is_above_0_and_at_most_a_half(quantile: float) -> None:
    with pytest.raises(ValidationError, match=r"pbt\.quantile"):
        TuneSettings.model_validate(tune(pbt={"population": 4, "interval": 2, "quantile": quantile}))
    assert TuneSettings.model_validate(tune(pbt={"population": 4, "interval": 2, "quantile": 0.5}))


def test_a_job_is_judged_once_per_boundary_and_trials_are_read_only_when_it_reaches_one() -> None:
    loads: list[int] = []

    def study(*trials: FrozenTrial) -> Callable[[], list[FrozenTrial]]:
        return lambda: loads.append(1) or list(trials)

    others = [trial(n, {1: v, 3: v}) for n, v in enumerate([0.9, 0.8, 0.7])]
    judge = BoundaryJudge.for_job(PBT, trial(3, {}))
    assert judge.next_boundary == 1
    assert judge.judge(1, study()) == [] and loads == []  # 1 unit: before the first boundary
    assert judge.judge(2, study(*others, trial(3, {1: 0.95}))) == []  # best of four at 2 units: go on
    assert judge.next_boundary == 2 and len(loads) == 1
    assert judge.judge(3, study()) == [] and len(loads) == 1
    assert judge.judge(4, study(*others, trial(3, {1: 0.95, 3: 0.1}))) == [0]  # worst at 4 units
    # At max_resource (8 units) it is finishing: never judged there.
    late = BoundaryJudge(PBT, member=3, next_boundary=4)
    assert late.judge(8, study(*others)) == [] and len(loads) == 2


def test_a_boundary_stays_open_until_every_member_reached_it_and_is_then_decided_further_on() -> None:
    judge = BoundaryJudge.for_job(PBT, trial(0, {}))
    slow = trial(3, {0: 0.9})  # not yet at 2 units
    worst = trial(0, {0: 0.1, 1: 0.1})
    middle = [trial(1, {1: 0.5}), trial(2, {1: 0.6})]
    assert judge.judge(2, lambda: [worst, *middle, slow]) == []  # open: member 3 is on its way
    assert judge.next_boundary == 1
    # Member 3 arrives (and beats it); the worst has trained on to 3 units and is judged at 2 units now.
    worst = trial(0, {0: 0.1, 1: 0.1, 2: 0.2})
    assert judge.judge(3, lambda: [worst, *middle, trial(3, {0: 0.9, 1: 0.9})]) == [3]
    # A member that finished short of the boundary (it failed) holds nobody up.
    failed = trial(3, {0: 0.9})
    failed.state = TrialState.FAIL
    half = Pbt(population=4, interval=2, quantile=0.5, maximize=True)  # floor(3 x 0.5) = 1 of three
    assert BoundaryJudge.for_job(half, trial(0, {})).judge(2, lambda: [worst, *middle, failed]) == [2]
    # Nor is a boundary decided before the whole population was asked.
    assert BoundaryJudge.for_job(PBT, trial(0, {})).judge(2, lambda: [worst, *middle]) == []


def test_a_continuation_is_first_judged_at_the_boundary_after_its_donors_step() -> None:
    later = trial(9, {}, continuing(member=3, generation=1, parent=0, from_step=4, replaces=3))
    assert BoundaryJudge.for_job(PBT, later).next_boundary == 3  # trained 5 units: next at 6


def test_the_head_of_a_member_is_its_newest_generation() -> None:
    trials = [
        trial(2, {0: 0.1}),
        trial(6, {}, continuing(2, 1, 0, 1, 2)),
        trial(8, {}, continuing(2, 2, 1, 3, 6)),
    ]
    assert PBT.head(2, trials).number == 8


def test_explore_perturbs_by_a_factor_on_the_grid_and_within_range() -> None:
    space = {
        "lr": FloatDistribution(1e-4, 1e-1, log=True),
        "width": IntDistribution(16, 128, step=16),
        "layers": IntDistribution(1, 4),
        "optimizer": CategoricalDistribution(["sgd", "adam", "adamw"]),
        "dropout": FloatDistribution(0.0, 0.5, step=0.1),
    }
    params: dict[str, Any] = {"lr": 0.1, "width": 64, "layers": 1, "optimizer": "adam", "dropout": 0.3}
    rule = Pbt(population=4, interval=1, quantile=0.25, maximize=True, resample_probability=0.0)
    layers = set()
    for seed in range(50):
        explored = rule.explore(params, space, random.Random(seed))
        layers.add(explored["layers"])
        assert explored["lr"] in (pytest.approx(0.08), 0.1)  # x 1.2 is past the top: clipped
        assert explored["width"] in (48, 80)  # 64 x 0.8 = 51.2 -> 48, 64 x 1.2 = 76.8 -> 80
        assert explored["optimizer"] in ("sgd", "adamw")
        assert explored["dropout"] in (pytest.approx(0.2), pytest.approx(0.4))
        assert all(space[name]._contains(space[name].to_internal_repr(v)) for name, v in explored.items())
    # 1 x 1.2 rounds to 1: one grid step up instead; 1 x 0.8 would step below the range and stays.
    assert layers == {1, 2}


def test_a_perturbation_moves_a_float_at_0_and_one_on_a_coarse_grid() -> None:
    """No factor moves 0, and 0.1 x 0.8 or x 1.2 rounds back to 0.1 on a grid of 0.1: each moves the
    least its factor should instead (a share of the range at 0, a grid step on a grid), unless it is
    at the bound it is pushed toward."""
    space = {
        "dropout": FloatDistribution(0.0, 0.5, step=0.1),
        "wd": FloatDistribution(0.0, 0.1),
        "shift": FloatDistribution(-1.0, 1.0),
        "layers": IntDistribution(1, 4),
    }
    params: dict[str, Any] = {"dropout": 0.1, "wd": 0.0, "shift": 0.0, "layers": 1}
    rule = Pbt(population=4, interval=1, quantile=0.25, maximize=True, resample_probability=0.0)
    seen: dict[str, set[float]] = {name: set() for name in space}
    for seed in range(200):
        explored = rule.explore(params, space, random.Random(seed))
        assert all(space[name]._contains(space[name].to_internal_repr(v)) for name, v in explored.items())
        for name, value in explored.items():
            seen[name].add(round(value, 9))
    # wd and layers stay only where x 0.8 pushes them into their low bound.
    assert seen == {"dropout": {0.0, 0.2}, "wd": {0.0, 0.02}, "shift": {-0.4, 0.4}, "layers": {1, 2}}


@pytest.mark.parametrize(
    ("value", "distribution", "factor", "moved"),
    [
        (0.1, FloatDistribution(0.0, 0.5, step=0.1), 1.2, 0.2),
        (0.1, FloatDistribution(0.0, 0.5, step=0.1), 0.8, 0.0),
        (0.0, FloatDistribution(0.0, 0.5, step=0.1), 1.2, 0.1),
        (0.0, FloatDistribution(0.0, 0.1), 1.5, 0.05),
        (0.0, FloatDistribution(0.0, 0.1), 0.5, 0.0),  # at the bound it is pushed toward
        (-0.1, FloatDistribution(-0.5, 0.5, step=0.1), 1.2, -0.2),  # x 1.2: away from 0
        (-0.1, FloatDistribution(-0.5, 0.5, step=0.1), 0.8, 0.0),  # x 0.8: toward it
        (0.5, FloatDistribution(0.0, 0.5, step=0.1), 1.2, 0.5),  # at the top: clipped
        (3, IntDistribution(0, 10), 1.2, 4),  # 3.6 -> 4: the factor moved it
        (0, IntDistribution(0, 10), 1.2, 1),
        (1, IntDistribution(0, 10), 0.8, 0),
        (-1, IntDistribution(-5, 5), 1.2, -2),
        (64, IntDistribution(16, 128, step=16), 1.1, 80),  # 70.4 rounds back to 64: one step up
        (0.3, FloatDistribution(0.0, 0.5, step=0.1), 1.0, 0.3),  # a factor of 1 keeps it
    ],
)
def test_a_perturbation_moves_at_least_one_step_the_way_of_its_factor(
    value: float, distribution: FloatDistribution | IntDistribution, factor: float, moved: float
) -> None:
    assert _perturb(value, distribution, factor, random.Random(0)) == pytest.approx(moved)


def test_explore_resamples_from_the_space_at_the_resample_probability() -> None:
    space = {"x": FloatDistribution(0.0, 1.0)}
    rule = Pbt(population=4, interval=1, quantile=0.25, maximize=True, resample_probability=1.0)
    drawn = {rule.explore({"x": 0.5}, space, random.Random(seed))["x"] for seed in range(20)}
    assert len(drawn) == 20 and all(0.0 <= x <= 1.0 for x in drawn)


def test_explore_leaves_the_parameters_it_is_not_given_as_the_donors() -> None:
    space = {"lr": FloatDistribution(1e-4, 1e-1, log=True), "hidden": IntDistribution(16, 128)}
    rule = Pbt(population=4, interval=1, quantile=0.25, maximize=True, explored=frozenset({"lr"}))
    for seed in range(20):
        assert rule.explore({"lr": 0.01, "hidden": 64}, space, random.Random(seed))["hidden"] == 64


def tune(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "train": {"entrypoint": "train.py"},
        "study": {"name": "s", "metric": "score"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "num_parallel": 4,
        "pbt": {"population": 4, "interval": 2},
    }
    return raw | overrides


def test_pbt_validates_and_num_trials_defaults_to_the_population() -> None:
    settings = TuneSettings.model_validate(tune())
    assert settings.num_trials == 4 and settings.pbt is not None
    assert settings.pbt.quantile == 0.25 and settings.pbt.perturb.factors == (0.8, 1.2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_trials": 10}, "num_trials 10 is not pbt.population 4.*fix: leave num_trials out"),
        ({"num_parallel": 2}, "num_parallel 2 is below pbt.population 4.*fix: set num_parallel to 4"),
        ({"pruner": {"kind": "median"}}, "pbt and pruner median both stop trials; fix: remove the pruner"),
        (
            {
                "study": {
                    "name": "s",
                    "objectives": [
                        {"metric": "a", "direction": "maximize"},
                        {"metric": "b", "direction": "minimize"},
                    ],
                }
            },
            "pbt ranks members by one objective.*fix: keep one",
        ),
        ({"enqueue": [{"x": 0.1}] * 5}, "enqueue has 5 configurations for a population of 4"),
        ({"pbt": {"population": 4, "interval": 2, "quantile": 0.75}}, "pbt.quantile"),
        ({"pbt": {"population": 1, "interval": 2}}, "pbt.population"),
        (
            {"pbt": {"population": 4, "interval": 2, "perturb": {"factors": [1, 1]}}},
            r"\[1.0, 1.0\] would not move a parameter; fix: two positive factors",
        ),
        (
            {"pbt": {"population": 4, "interval": 2, "perturb": {"params": ["lr"]}}},
            r"pbt.perturb.params names lr, not in space \(x\); fix: name parameters of the search space",
        ),
    ],
)
def test_each_pbt_spec_error_names_the_field_and_the_fix(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TuneSettings.model_validate(tune(**overrides))
