"""What the studies train, the arms they compare, and the overrides that set both on a spec."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.quality.timing import Goal
from tunepod.spec.models import PrunerSpec

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "benchmarks" / "specs"
TUNE_STEP = "search"
REDUCTION_FACTOR = 3

RANDOM = "random"
TPE_HYPERBAND = "tpe+hyperband"
TPE_ASHA = "tpe+asha"
PBT = "pbt"
LONG_RANDOM = "long random"
RAY_ASHA = "ray asha"
RAY_PBT = "ray pbt"
RAY_ARMS = (RAY_ASHA, RAY_PBT)
ARMS: dict[str, dict[str, str]] = {
    # The baseline: every trial trains to its end, parameters drawn at random. The whole pruner
    # mapping is replaced: the spec's Hyperband options are refused on kind none.
    RANDOM: {"sampler": "random", "pruner": "{kind: none}"},
    # tunepod's way: multivariate TPE with the constant liar (tunepod.hpo.study.make_sampler), trials
    # stopped early by Optuna's Hyperband.
    TPE_HYPERBAND: {"sampler": "tpe", "pruner.kind": "hyperband"},
    # tunepod's ASHA: trials outside the top of a rung paused after their checkpoint and promoted
    # (resumed from it) later, instead of killed; TPE sees paused trials as pruned ones. The recommended
    # setting: tunepod's defaults, given only a full trial's length (Workload.pruner_options).
    TPE_ASHA: {"sampler": "tpe", "pruner": "{kind: asha}"},
    # tunepod's population-based training: a population of --parallel members drawn at random, each
    # member as long as the other arms' whole budget shared among the population, the bottom quarter
    # going on from a top member's checkpoint every full trial's length with its lr perturbed (the other
    # parameters shape the model: the donor's are kept). The population is the study's trials
    # (Workload.pbt_options).
    PBT: {"sampler": "random", "pruner": "{kind: none}"},
    # The pbt arm's control: its population drawn at random, its members as long, none ever copying
    # another. What PBT gains over it is its exploit and explore; what both gain over random is
    # training fewer, longer trials.
    LONG_RANDOM: {"sampler": "random", "pruner": "{kind: none}"},
}
# The arms whose trials are a population of --parallel members, each the budget shared among them.
MEMBER_ARMS = (PBT, LONG_RANDOM, RAY_PBT)


@dataclass(frozen=True)
class Workload:
    """One training script tuned by every arm: its spec, its goal and the trial budget."""

    name: str
    spec: Path
    study: str
    goal: Goal
    trials: int
    parallel: int
    train_args: dict[str, object]
    """Fixed parameters of every trial (the spec's ``train.args`` are replaced key by key)."""
    min_resource: int
    """Hyperband's (and ASHA's) first rung, in report steps: no trial is stopped before it."""
    max_step: int
    """The step of a full trial's last report (ASHA's ``max_t``; Hyperband's ``max_resource`` is one
    more, so that it prunes from the first trials on instead of after the first one completes)."""
    length_arg: str = "epochs"
    """The ``train_args`` key of a trial's length (its reports are steps ``0..max_step`` or up to it)."""
    asha_min_resource: int | None = None
    """The tpe+asha arm's first rung where the workload's recommended setting puts it; None: tunepod's
    default (a third of a full trial)."""

    @property
    def asha_first_rung(self) -> int:
        """The tpe+asha arm's first rung, in units: the workload's, else tunepod's default, as the spec
        model sets it. Ray Tune's ASHA gets it as its ``grace_period``, so both decide at the same step."""
        rungs = {"max_resource": self.max_step + 1}
        if self.asha_min_resource is not None:
            rungs["min_resource"] = self.asha_min_resource
        return PrunerSpec(kind="asha", **rungs).min_resource

    def study_name(self, arm: str, seed: int) -> str:
        return f"{self.study}-{arm.replace('+', '-').replace(' ', '-')}-s{seed}"

    def overrides(self, arm: str, seed: int, root: Path) -> list[str]:
        """``dotted.key=value`` settings that make the spec one arm's study for ``seed``, every store in
        ``root``. Every study of a benchmark run shares the stores (one MLflow database, one
        launcher root, so the data is staged once), each under its own study name, in its own Optuna
        journal (a study stopped at its target is SIGKILLed: a torn last line must not spoil the next)."""
        tune = f"steps.{TUNE_STEP}.with"
        settings = {
            "tracking.uri": f"sqlite:///{root}/mlflow.db",
            "launcher.root": str(root / "shared"),
            f"{tune}.study.storage": self.storage(root, arm, seed),
            f"{tune}.study.name": self.study_name(arm, seed),
            f"{tune}.num_trials": str(self.trials_of(arm)),
            f"{tune}.num_parallel": str(self.parallel),
            f"{tune}.seed": str(seed),
            **{f"{tune}.{key}": value for key, value in ARMS[arm].items()},
            **{f"{tune}.pruner.{key}": value for key, value in self.pruner_options(arm).items()},
            **{f"{tune}.{key}": value for key, value in self.pbt_options(arm).items()},
            **{f"{tune}.train.args.{key}": str(value) for key, value in self.train_args_of(arm).items()},
        }
        return [f"{key}={value}" for key, value in settings.items()]

    def pruner_options(self, arm: str) -> dict[str, str]:
        """Hyperband's settings (the spec refuses them on ``kind: none``); ASHA's rungs are its
        defaults for a full trial's length."""
        if arm == TPE_ASHA:
            rungs = {"max_resource": str(self.max_step + 1)}
            if self.asha_min_resource is not None:
                rungs["min_resource"] = str(self.asha_min_resource)
            return rungs
        if ARMS[arm].get("pruner.kind") != "hyperband":
            return {}
        return {
            "min_resource": str(self.min_resource),
            "max_resource": str(self.max_step + 1),
            "reduction_factor": str(REDUCTION_FACTOR),
        }

    def trials_of(self, arm: str) -> int:
        """``arm``'s trial budget: a population arm's members, all side by side, else ``trials``."""
        return self.parallel if arm in MEMBER_ARMS else self.trials

    def train_args_of(self, arm: str) -> dict[str, object]:
        """The fixed parameters of ``arm``'s trials: a population member trains as long as the other
        arms' whole budget shared among the population (``pbt_member_length``), the same compute."""
        if arm not in MEMBER_ARMS:
            return self.train_args
        return {**self.train_args, self.length_arg: self.pbt_member_length}

    @property
    def trial_length(self) -> int:
        """A full trial's length in the trainer's units (``train_args[length_arg]``)."""
        length = self.train_args[self.length_arg]
        assert isinstance(length, int), f"{self.name}: {self.length_arg} must be an int, got {length!r}"
        return length

    @property
    def pbt_member_length(self) -> int:
        """A member's length in the trainer's units: ``trials`` full trials' training over the
        population of ``parallel`` members."""
        return self.trial_length * self.trials // self.parallel

    def last_step(self, arm: str) -> int:
        """The step of the last report of ``arm``'s trials: a full trial's, or a PBT member's (it sits
        where a trial's does against its length: digits' is epochs - 1)."""
        if arm not in MEMBER_ARMS:
            return self.max_step
        return self.pbt_member_length + (self.max_step - self.trial_length)

    def pbt_options(self, arm: str) -> dict[str, str]:
        """The PBT arm's population (its trials, all side by side: ``trials_of``) and schedule:
        decisions every full trial's length, up to a member's last report."""
        if arm != PBT:
            return {}
        schedule = {
            "population": self.parallel,
            "interval": self.trial_length,  # reports land on its multiples (units are step + 1)
            "quantile": 0.25,
            "max_resource": self.last_step(PBT) + 1,
            "perturb": {"params": ["lr"]},
        }
        return {"pbt": json.dumps(schedule)}

    def storage(self, root: Path, arm: str, seed: int) -> str:
        return f"journal://{root}/{self.study_name(arm, seed)}.optuna.log"

    def jobs_dir(self, root: Path, arm: str, seed: int) -> Path:
        """Where the local launcher puts a study's trial job dirs (``tunepod.launch.paths``)."""
        return root / "shared" / "jobs" / self.study_name(arm, seed)


def digits(trials: int, parallel: int, epochs: int, epoch_s: float, target: float) -> Workload:
    return Workload(
        name="digits",
        spec=SPECS / "quality-digits.yaml",
        study="quality-digits",
        goal=Goal("val_accuracy", "maximize", target),
        trials=trials,
        parallel=parallel,
        train_args={"epochs": epochs, "epoch_sleep_s": epoch_s},
        # Not before step 2 (a third of the default 6 epochs): pruned from the first trials on at step 1,
        # trials that would reach the target by their last epoch are stopped (benchmarks.quality.simulate,
        # 15 seeds: 0.67x random's time from step 1, 0.46x from step 2; README "quality/").
        min_resource=min(2, epochs),
        max_step=epochs - 1,  # epochs are reported as steps 0..epochs-1
    )


def tiny_llm(trials: int, parallel: int, steps: int, eval_interval: int, target: float) -> Workload:
    return Workload(
        name="tiny LLM",
        spec=SPECS / "quality-llm.yaml",
        study="quality-llm",
        goal=Goal("val_perplexity", "minimize", target),
        trials=trials,
        parallel=parallel,
        train_args={"steps": steps, "eval_interval": eval_interval},
        length_arg="steps",
        min_resource=eval_interval,  # reports come at eval_interval, 2 x eval_interval, ...
        max_step=steps,
        # Half a trial: larger models start slower and finish better here. Of 80 random draws (seeds
        # 90000, 91000, never measured) the 5 that reach 13.0 ranked 2nd-37th at a third of a trial,
        # where ASHA keeps the top third (26), and 0th-22nd at half (README "quality/").
        asha_min_resource=steps // 2,
    )
