"""The arms of the LCBench benchmark, by name: the one place to add an arm.

An arm is a function ``(problem, seed, budget) -> Trace``:

- ``problem`` (problem.Problem): the instance, its surrogate (``problem.curves(configs)`` gives each
  configuration's val_accuracy and cumulative training time over epochs 1..52, ``problem.space`` the
  7 hyperparameters, ``problem.sample(rng)`` uniform draws) and its reference values;
- ``seed``: the run's seed (0, 1000, 2000, ... by default); the arm seeds everything random with it, so
  that a run replays;
- ``budget`` (problem.Budget): ``total_epochs`` to train over all trials, ``n_workers`` trials at once,
  ``startup_s`` simulated seconds for every job's start or resume;
- the Trace (problem.Trace): one point per epoch trained, in simulated-time order: its end time, the
  running count of epochs, the val_accuracy it reported; build it with problem.Recorder, which also
  says when the budget is spent.

An arm that is an ask/tell tuner implements simulator.Scheduler (``next_job``, ``on_epoch``) and
returns ``simulate(problem, budget, scheduler)``; an arm with a loop of its own (tunepod's Tuner on a
simulated clock) fills a Recorder itself and must keep the same rules: epochs counted as trained, at
most ``n_workers`` at once, ``startup_s`` per start or resume, the surrogate's epoch times. Then:

    ARMS["tunepod-asha"] = tunepod_asha      # one entry here

Arms that need a package import it inside the function, and REQUIRES names it, so that a missing one
is skipped with a message instead of failing the run.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.lcbench import baselines, peers, tunepod_arms
from benchmarks.lcbench.problem import Budget, Problem, Recorder, Reference, Trace, make_problem
from benchmarks.lcbench.simulator import Job, Scheduler, simulate

__all__ = [
    "ARMS",
    "BASELINE",
    "REQUIRES",
    "SLOW_ARMS",
    "Arm",
    "Budget",
    "Job",
    "Problem",
    "Recorder",
    "Reference",
    "Scheduler",
    "Trace",
    "make_problem",
    "simulate",
]

Arm = Callable[[Problem, int, Budget], Trace]

BASELINE = "random"
ARMS: dict[str, Arm] = {
    BASELINE: baselines.random_search,
    "optuna-tpe-hyperband": baselines.optuna_tpe_hyperband,
    "syne-tune-asha": peers.syne_tune_asha,
    "syne-tune-bohb": peers.syne_tune_bohb,
    "smac-hyperband": peers.smac_hyperband,
    "dehb": peers.dehb,
    "ray-asha": peers.ray_asha,
    "tunepod-asha": tunepod_arms.arm("tunepod-asha"),
    "tunepod-asha-forecast": tunepod_arms.arm("tunepod-asha-forecast"),
    "syne-tune-asha-cqr": peers.syne_tune_asha_cqr,
    "smac-multi-fidelity": peers.smac_multi_fidelity,
}
# Run only when named (--arms): their model fits take minutes per run here (one run of 3945 at load ~7:
# CQR, which refits gradient-boosted quantile regressors at every suggestion, 11 min; SMAC's random
# forest 2.5 min), against seconds for the others, so they would turn a run of minutes into hours.
SLOW_ARMS = ("syne-tune-asha-cqr", "smac-multi-fidelity")
# Named with --arms: what the development instances are to decide between (the first rung's place,
# the sampler alone).
ARMS |= {name: tunepod_arms.arm(name) for name in ("tunepod-asha-epoch-1", "tunepod-tpe")}
OPT_IN_ARMS = (*SLOW_ARMS, "tunepod-asha-epoch-1", "tunepod-tpe")
# The modules each arm imports; `pip install 'tunepod[bench]'` brings them all.
REQUIRES: dict[str, tuple[str, ...]] = {
    "optuna-tpe-hyperband": ("optuna",),
    "syne-tune-asha": ("syne_tune",),
    "syne-tune-bohb": ("syne_tune",),
    "syne-tune-asha-cqr": ("syne_tune", "huggingface_hub"),
    "smac-hyperband": ("smac",),
    "smac-multi-fidelity": ("smac",),
    "dehb": ("dehb",),
    "ray-asha": ("ray",),
}
