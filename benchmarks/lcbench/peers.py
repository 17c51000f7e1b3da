"""The tuners users pick instead of tunepod, each driven through its own ask/tell or scheduler API by the
simulator (simulator.py), so that every arm meets the same clock, workers, start-up cost and budget.

Each package is imported inside its arm only (``pip install 'tunepod[bench]'`` brings them all);
tunepod itself never imports them. Settings: each tuner's documented defaults for multi-fidelity,
with min budget 1 epoch, max 52 and reduction factor 3 where the option exists (benchmarks/README.md,
"LCBench", has the table).

How a peer's trials train: Syne Tune's and Ray Tune's ASHA stop a trial or let it go on (they never
pause), so a trial is one job. SMAC's and DEHB's Hyperband evaluate (configuration, budget) pairs, and
their documented use trains each pair from scratch: a configuration promoted from 6 to 17 epochs trains
17 epochs again, and all of them count against the budget.
"""

from __future__ import annotations

import datetime
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lcbench.baselines import MIN_EPOCHS, REDUCTION_FACTOR
from benchmarks.lcbench.problem import METRIC, Budget, Problem, Trace
from benchmarks.lcbench.simulator import Job, epochs_of, simulate
from benchmarks.lcbench.surrogate import Config, Param

EPOCH = "epoch"


# ------------------------------------------------------------------------------------------ Syne Tune


def syne_tune_domain(param: Param) -> Any:
    from syne_tune import config_space as sp

    if param.integer:
        return (sp.lograndint if param.log else sp.randint)(int(param.low), int(param.high))
    return (sp.loguniform if param.log else sp.uniform)(param.low, param.high)


class SyneTuneScheduler:
    """A Syne Tune TrialScheduler, called as Syne Tune's Tuner calls it (syne_tune/tuner.py): suggest
    and on_trial_add for a new trial, on_trial_result per epoch, on_trial_remove after STOP or PAUSE,
    on_trial_complete when a trial ends without either. A PAUSE keeps the trial's epoch, so a resume
    suggestion continues from its checkpoint."""

    def __init__(self, problem: Problem, scheduler: Any) -> None:
        self.problem = problem
        self.scheduler = scheduler
        self.trials: dict[int, Any] = {}
        self.paused_at: dict[int, int] = {}

    def next_job(self) -> Job | None:
        from syne_tune.backend.trial_status import Trial

        suggestion = self.scheduler.suggest()
        if suggestion is None:
            return None
        if not suggestion.spawn_new_trial_id:
            trial_id = suggestion.checkpoint_trial_id
            first = self.paused_at.pop(trial_id) + 1
            return Job(trial_id, self.trials[trial_id].config, first, self.problem.max_epochs)
        trial_id = len(self.trials)
        config = {param.name: suggestion.config[param.name] for param in self.problem.space}
        trial = Trial(trial_id=trial_id, config=config, creation_time=datetime.datetime.now())
        self.trials[trial_id] = trial
        self.scheduler.on_trial_add(trial=trial)
        return Job(trial_id, config, 1, self.problem.max_epochs)

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        from syne_tune.optimizer.scheduler import SchedulerDecision

        trial = self.trials[job.trial]
        result = {METRIC: value, EPOCH: epoch}
        decision = self.scheduler.on_trial_result(trial=trial, result=result)
        if decision in (SchedulerDecision.STOP, SchedulerDecision.PAUSE):
            if decision == SchedulerDecision.PAUSE:
                self.paused_at[job.trial] = epoch
            self.scheduler.on_trial_remove(trial=trial)
            return False
        if epoch == job.last_epoch:
            self.scheduler.on_trial_complete(trial, result)
        return True


def syne_tune_arm(problem: Problem, seed: int, budget: Budget, name: str) -> Trace:
    from syne_tune.optimizer import baselines

    # Syne Tune's ASHA draws each trial's bracket from numpy's global generator (one bracket by
    # default, so it draws nothing that matters); seeded anyway so that a run replays.
    np.random.seed(seed)
    logging.getLogger("syne_tune").setLevel(logging.WARNING)
    scheduler = getattr(baselines, name)(
        config_space={param.name: syne_tune_domain(param) for param in problem.space},
        metric=METRIC,
        do_minimize=False,
        time_attr=EPOCH,
        max_t=problem.max_epochs,
        grace_period=MIN_EPOCHS,
        reduction_factor=REDUCTION_FACTOR,
        random_seed=seed,
    )
    return simulate(problem, budget, SyneTuneScheduler(problem, scheduler))


def syne_tune_asha(problem: Problem, seed: int, budget: Budget) -> Trace:
    """Syne Tune's ASHA: random search, one bracket, a trial stopped at a rung unless in its top third."""
    return syne_tune_arm(problem, seed, budget, "ASHA")


def syne_tune_asha_cqr(problem: Problem, seed: int, budget: Budget) -> Trace:
    """Syne Tune's ASHA with conformal quantile regression proposing configurations (ASHACQR, its
    model-based multi-fidelity scheduler: MOBSTER, Hyper-Tune and DyHPO left Syne Tune in 0.15)."""
    return syne_tune_arm(problem, seed, budget, "ASHACQR")


def syne_tune_bohb(problem: Problem, seed: int, budget: Budget) -> Trace:
    """Syne Tune's BOHB: ASHA with kernel density estimators proposing configurations."""
    return syne_tune_arm(problem, seed, budget, "BOHB")


# ------------------------------------------------------------------------ SMAC3 and DEHB (ConfigSpace)


def config_space(problem: Problem, seed: int) -> Any:
    from ConfigSpace import ConfigurationSpace, Float, Integer

    space = ConfigurationSpace(seed=seed)
    for param in problem.space:
        if param.integer:
            space.add(Integer(param.name, (int(param.low), int(param.high)), log=param.log))
        else:
            space.add(Float(param.name, (param.low, param.high), log=param.log))
    return space


class FidelityJobs:
    """Hands a tuner's (configuration, budget) evaluations to the simulator as from-scratch jobs: one
    trial id per distinct configuration (so its curve is queried once), epochs 1..budget."""

    def __init__(self) -> None:
        self.trial_ids: dict[tuple[tuple[str, float], ...], int] = {}

    def job(self, config: Config, fidelity: float, max_epochs: int) -> Job:
        key = tuple(sorted((name, float(value)) for name, value in config.items()))
        trial = self.trial_ids.setdefault(key, len(self.trial_ids))
        return Job(trial, dict(config), 1, epochs_of(fidelity, max_epochs))


class SmacAskTell:
    """SMAC3 through ask and tell: each ask is a (configuration, budget) trained from scratch to the
    budget; tell gets the cost 100 - val_accuracy at the budget's last epoch (SMAC minimises)."""

    def __init__(self, problem: Problem, smac: Any) -> None:
        self.problem = problem
        self.smac = smac
        self.jobs = FidelityJobs()
        self.pending: dict[int, list[Any]] = {}

    def next_job(self) -> Job:
        info = self.smac.ask()
        job = self.jobs.job(dict(info.config), info.budget, self.problem.max_epochs)
        self.pending.setdefault(job.trial, []).append(info)
        return job

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        from smac.runhistory.dataclasses import TrialValue

        if epoch == job.last_epoch:
            info = self.pending[job.trial].pop(0)
            self.smac.tell(info, TrialValue(cost=100.0 - value))
        return True


def smac_arm(problem: Problem, seed: int, budget: Budget, facade_name: str) -> Trace:
    import smac

    facade = getattr(smac, facade_name)
    with tempfile.TemporaryDirectory(prefix="tunepod-lcbench-smac-") as folder:
        scenario = smac.Scenario(
            config_space(problem, seed),
            name=f"lcbench-{problem.instance}-seed-{seed}",
            output_directory=Path(folder),
            deterministic=True,
            # The simulator stops SMAC at the epoch budget; SMAC's own trial limit must not come first.
            n_trials=budget.total_epochs,
            min_budget=MIN_EPOCHS,
            max_budget=problem.max_epochs,
            seed=seed,
        )
        optimizer = facade(
            scenario,
            target_function=evaluated_by_the_simulator,
            intensifier=facade.get_intensifier(scenario, eta=REDUCTION_FACTOR),
            overwrite=True,
            logging_level=logging.ERROR,
        )
        return simulate(problem, budget, SmacAskTell(problem, optimizer))


def evaluated_by_the_simulator(config: Any, seed: int = 0, budget: float = 0.0) -> float:
    raise RuntimeError("SMAC is driven by ask and tell here: the simulator trains, SMAC never calls this")


def smac_hyperband(problem: Problem, seed: int, budget: Budget) -> Trace:
    """SMAC3's HyperbandFacade: random configurations, Hyperband's brackets (eta 3)."""
    return smac_arm(problem, seed, budget, "HyperbandFacade")


def smac_multi_fidelity(problem: Problem, seed: int, budget: Budget) -> Trace:
    """SMAC3's MultiFidelityFacade: a random forest proposing configurations into Hyperband's brackets
    (BOHB's idea with SMAC's model)."""
    return smac_arm(problem, seed, budget, "MultiFidelityFacade")


class DehbAskTell:
    """DEHB through ask and tell: each ask a (configuration, fidelity) trained from scratch; tell gets
    fitness -val_accuracy (DEHB minimises) and the epochs trained as cost (DEHB reads the cost only
    to end its own run loop, which is not used here)."""

    def __init__(self, problem: Problem, dehb: Any) -> None:
        self.problem = problem
        self.dehb = dehb
        self.jobs = FidelityJobs()
        self.pending: dict[int, list[Any]] = {}

    def next_job(self) -> Job:
        info = self.dehb.ask()
        job = self.jobs.job(dict(info["config"]), info["fidelity"], self.problem.max_epochs)
        self.pending.setdefault(job.trial, []).append(info)
        return job

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        if epoch == job.last_epoch:
            info = self.pending[job.trial].pop(0)
            self.dehb.tell(info, {"fitness": -value, "cost": float(epoch)})
        return True


def dehb(problem: Problem, seed: int, budget: Budget) -> Trace:
    """DEHB at its defaults (mutation 0.5, crossover 0.5, rand1_bin), eta 3, fidelities 1..52 epochs."""
    from dehb import DEHB
    from loguru import logger

    with tempfile.TemporaryDirectory(prefix="tunepod-lcbench-dehb-") as folder:
        optimizer = DEHB(
            cs=config_space(problem, seed),
            min_fidelity=MIN_EPOCHS,
            max_fidelity=problem.max_epochs,
            eta=REDUCTION_FACTOR,
            # One worker and no Dask client: the simulator runs the workers; DEHB's ask hands out jobs
            # as its asynchronous mode does, starting a new bracket when the others wait.
            n_workers=1,
            output_path=folder,
            seed=seed,
            save_freq="end",
        )
        # DEHB logs every step to stdout and a file at INFO; the run's table says what matters.
        logger.remove()
        return simulate(problem, budget, DehbAskTell(problem, optimizer))


# ------------------------------------------------------------------------------------------- Ray Tune


class RayTrial:
    """What Ray Tune's ASHAScheduler reads of a trial: its id (a stand-in for ray.tune's Trial, which
    needs a running Tune controller)."""

    def __init__(self, trial_id: int) -> None:
        self.trial_id = str(trial_id)


class RayAsha:
    """Ray Tune's ASHAScheduler (AsyncHyperBandScheduler) deciding on each epoch of random trials."""

    def __init__(self, problem: Problem, seed: int, scheduler: Any) -> None:
        self.problem = problem
        self.rng = np.random.default_rng(seed)
        self.scheduler = scheduler
        self.trials: dict[int, RayTrial] = {}

    def next_job(self) -> Job:
        (config,) = self.problem.sample(self.rng)
        trial = RayTrial(len(self.trials))
        self.trials[len(self.trials)] = trial
        self.scheduler.on_trial_add(None, trial)
        return Job(len(self.trials) - 1, config, 1, self.problem.max_epochs)

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        from ray.tune.schedulers import TrialScheduler

        trial = self.trials[job.trial]
        decision = self.scheduler.on_trial_result(None, trial, {METRIC: value, EPOCH: epoch})
        if decision == TrialScheduler.STOP:
            self.scheduler.on_trial_remove(None, trial)
            return False
        return True


def ray_asha(problem: Problem, seed: int, budget: Budget) -> Trace:
    """Ray Tune's ASHAScheduler (grace_period 1, max_t 52, reduction_factor 3: Ray's default is 4)
    over random configurations (Ray's default searcher is random too, BasicVariantGenerator)."""
    from ray.tune.schedulers import ASHAScheduler

    np.random.seed(seed)  # Ray's bracket draw uses numpy's global generator (one bracket: no effect)
    scheduler = ASHAScheduler(
        time_attr=EPOCH,
        metric=METRIC,
        mode="max",
        max_t=problem.max_epochs,
        grace_period=MIN_EPOCHS,
        reduction_factor=REDUCTION_FACTOR,
    )
    return simulate(problem, budget, RayAsha(problem, seed, scheduler))
