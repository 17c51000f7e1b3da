"""Every arm of the tuning-quality benchmark (benchmarks/quality) makes a valid spec of each workload:
the overrides it sets are the ones the spec accepts, so a benchmark run never dies at its first study
(the benchmark itself runs in make bench, not here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.quality.__main__ import as_factor, ratio_of
from benchmarks.quality.workloads import (
    ARMS,
    LONG_RANDOM,
    PBT,
    REPO,
    TPE_ASHA,
    TUNE_STEP,
    Workload,
    digits,
    tiny_llm,
)
from tunepod.spec.loader import load_spec
from tunepod.spec.models import TuneStep

WORKLOADS = [
    digits(trials=40, parallel=4, epochs=6, epoch_s=0.25, target=0.974),
    tiny_llm(trials=40, parallel=4, steps=120, eval_interval=20, target=13.0),
]


@pytest.mark.parametrize("arm", sorted(ARMS))
@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_each_arm_makes_a_valid_spec(workload: Workload, arm: str, tmp_path: Path) -> None:
    spec = load_spec(workload.spec, workload.overrides(arm, seed=7, root=tmp_path), base_dir=REPO)
    step = spec.steps[TUNE_STEP]
    assert isinstance(step, TuneStep)
    tune = step.with_
    assert tune.study.name == workload.study_name(arm, 7) and tune.seed == 7
    if arm == PBT:
        # The population is the study's trials, all side by side; only lr is explored. Its members
        # share the other arms' budget: 4 members of 10 trials' length against 40 trials.
        assert tune.pbt is not None and tune.pbt.population == tune.num_trials == tune.num_parallel == 4
        assert tune.pbt.interval == workload.trial_length and tune.pbt.perturb.params == ["lr"]
        assert tune.train.args[workload.length_arg] == 10 * workload.trial_length
        # To the last report: digits' epochs 0..59 (60 units), the tiny LLM's step 1200 (1201 units).
        assert tune.pbt.max_resource == {"digits": 60, "tiny LLM": 1201}[workload.name]
        assert tune.pruner.kind == "none"
    elif arm == LONG_RANDOM:
        # PBT's control: the same population of random draws, members as long, no schedule.
        assert tune.pbt is None and tune.sampler.kind == "random" and tune.pruner.kind == "none"
        assert tune.num_trials == tune.num_parallel == 4
        assert tune.train.args[workload.length_arg] == 10 * workload.trial_length
    else:
        assert tune.pbt is None and tune.num_trials == workload.trials
        assert tune.train.args[workload.length_arg] == workload.trial_length
    if arm == TPE_ASHA:
        # The recommended setting: ASHA's rungs are tunepod's defaults for a full trial's length, or
        # the workload's first rung where it sets one (the tiny LLM's: half a trial).
        assert tune.pruner.max_resource == workload.max_step + 1
        default = (workload.max_step + 1) // 3
        assert tune.pruner.min_resource == (workload.asha_min_resource or default)
        # Ray Tune's ASHA arm decides at the same rung (its grace_period).
        assert workload.asha_first_rung == tune.pruner.min_resource


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_ray_pbt_is_given_the_schedule_of_the_pbt_arm(workload: Workload, tmp_path: Path) -> None:
    # Ray's PBT is the baseline of tunepod's pbt arm: it must decide at the same units, copy the same
    # share and explore the same parameters the same way (Ray itself is imported only by the arm's run).
    from benchmarks.quality.ray_tune import pbt_settings

    spec = load_spec(workload.spec, workload.overrides(PBT, seed=7, root=tmp_path), base_dir=REPO)
    step = spec.steps[TUNE_STEP]
    assert isinstance(step, TuneStep) and step.with_.pbt is not None
    pbt = step.with_.pbt
    assert pbt_settings(workload) == {
        "interval": pbt.interval,
        "quantile": pbt.quantile,
        "params": pbt.perturb.params,
        "factors": list(pbt.perturb.factors),
        "resample_probability": pbt.perturb.resample_probability,
    }


def test_a_factor_against_a_median_that_never_reached_says_so() -> None:
    # A control that never reached its target in most seeds has an infinite median: the printed
    # comparison must not read as a number ("n/ax" did).
    assert as_factor(ratio_of(12.5, 12.9)) == "0.97x"
    assert as_factor(ratio_of(51.7, math.inf)) == "n/a: a median never reached the target"
    assert as_factor(ratio_of(math.inf, 84.0)) == "n/a: a median never reached the target"
