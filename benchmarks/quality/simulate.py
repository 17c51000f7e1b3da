"""The digits quality study replayed in one process, in simulated time: which tuning settings to measure.

    .venv/bin/python -m benchmarks.quality.simulate                      # the benchmark's two arms
    .venv/bin/python -m benchmarks.quality.simulate --seeds 20 --arms \\
        "random/none,tpe/hyperband:1:auto,tpe/hyperband:2:6,tpe:4/none"

A real study of the benchmark takes minutes; its outcome is mostly which parameters the sampler draws
and which trials the pruner stops, and those depend on the learning curves alone. This trains each
drawn configuration in-process with the digits trainer's code and settings (examples/digits/train.py:
one process, batch 64, seed 0, the staged splits) and replays the study on a clock: a trial's report
of epoch k comes ``start_s + (k + 1) * epoch_s`` after its start, a full trial frees its slot
``exit_s`` after its last report, a pruned one ``kill_s`` after the report that pruned it, and the
next trial starts in the freed slot (measured here on 2026-12-02: start 2.5 s to the first epoch's
end, exit 1.0 s, kill 0.9 s, epochs of the sleep plus ~0.05 s). The study is the benchmark's spec
(specs/quality-digits.yaml) with the arm's overrides: its space, and the sampler and pruner tunepod
builds from it, reseeded before each ask as the tuner does. The learning curve is the one piece
written twice: the trainer is a script, so its model and loop are repeated here. It says nothing
about the orchestrator's own time; the benchmark measures that.

An arm is ``sampler[:n_startup_trials]/pruner[:min_resource[:max_resource]]``: sampler ``random`` or
``tpe`` (or any sampler kind the spec takes), pruner ``none``, ``hyperband`` (``max_resource`` a
number or ``auto``), ``successive_halving`` or ``median`` (the number is its ``warmup_steps``). It
prints, per arm, the median time to target over seeds and its ratio to the first arm's; a study that
never reaches the target counts with its whole budget's time (``>``)."""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import optuna
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmarks.quality.workloads import SPECS, TPE_HYPERBAND, TUNE_STEP, Workload
from benchmarks.quality.workloads import digits as quality_digits
from tunepod.hpo.asha import ATTR_ASHA, AshaState, RungJudge
from tunepod.hpo.policies.asha import make_asha
from tunepod.hpo.study import distributions, make_pruner, reseed_for_next_trial
from tunepod.spec.loader import load_spec
from tunepod.spec.models import TuneSettings
from tunepod.staging.builtin import write_digits

SEED_STRIDE = 1000  # as the benchmark's: seeds 0, 1000, 2000, ...


@dataclass(frozen=True)
class Clock:
    start_s: float
    epoch_s: float
    exit_s: float
    kill_s: float


@dataclass(frozen=True)
class Arm:
    """One arm, as the spec overrides that make the benchmark's digits spec that arm's study."""

    text: str

    def settings(self, seed: int) -> TuneSettings:
        sampler_text, _, pruner_text = self.text.partition("/")
        sampler, *startup = sampler_text.split(":")
        pruner, *resources = (pruner_text or "none").split(":")
        sampler_options = {"kind": sampler} | ({"n_startup_trials": int(startup[0])} if startup else {})
        pruner_options: dict[str, object] = {"kind": pruner}
        if resources and pruner == "median":
            pruner_options["warmup_steps"] = int(resources[0])
        elif resources:
            pruner_options["min_resource"] = int(resources[0])
        if len(resources) > 1 and resources[1] != "auto":
            pruner_options["max_resource"] = int(resources[1])
        tune = f"steps.{TUNE_STEP}.with"
        overrides = [
            f"{tune}.sampler={json.dumps(sampler_options)}",
            f"{tune}.pruner={json.dumps(pruner_options)}",
            f"{tune}.seed={seed}",
        ]
        settings = load_spec(SPECS / "quality-digits.yaml", overrides).steps[TUNE_STEP].with_
        assert isinstance(settings, TuneSettings)
        return settings


@dataclass(frozen=True)
class Outcome:
    time_s: float
    reached: bool
    trials: int
    pruned: int

    def describe(self) -> str:
        return f"{'' if self.reached else '>'}{self.time_s:.0f}s/{self.trials}t/{self.pruned}p"


class Digits:
    """The digits trainer's learning curve for a configuration (every epoch's val_accuracy)."""

    def __init__(self) -> None:
        data = Path(tempfile.mkdtemp(prefix="tunepod-simulate-"))
        write_digits(data)
        self.train, self.val = (self._split(data / f"{name}.npz") for name in ("train", "val"))

    @staticmethod
    def _split(path: Path) -> TensorDataset:
        arrays = np.load(path)
        return TensorDataset(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]))

    @functools.cache  # noqa: B019 (one instance per process)
    def curve(self, lr: float, hidden: int, optimizer_name: str, epochs: int) -> tuple[float, ...]:
        torch.manual_seed(0)
        sampler = DistributedSampler(self.train, num_replicas=1, rank=0, seed=0)
        loader = DataLoader(self.train, batch_size=64, sampler=sampler)
        model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        optimizer: torch.optim.Optimizer = (
            torch.optim.Adam(model.parameters(), lr=lr)
            if optimizer_name == "adam"
            else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        )
        accuracies = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            model.eval()
            with torch.no_grad():
                x, y = self.val.tensors
                accuracies.append((model(x).argmax(dim=1) == y).float().mean().item())
        return tuple(accuracies)


@dataclass(order=True)
class _Event:
    time_s: float
    order: int
    trial: optuna.trial.Trial | None = field(compare=False)  # None: a slot frees
    step: int = field(compare=False, default=0)
    value: float = field(compare=False, default=0.0)
    job: int = field(compare=False, default=0)
    """Which of its trial's jobs reports it (ASHA starts a paused trial again on a new job)."""


def simulate(arm: Arm, seed: int, digits: Digits, clock: Clock, workload: Workload) -> Outcome:
    settings = arm.settings(seed)
    space = distributions(settings.space)
    epochs = workload.max_step + 1  # reports at steps 0..epochs-1
    # Named as the benchmark names its tpe+hyperband study of this seed: Hyperband puts a trial in a
    # bracket by a hash of the study's name and the trial's number (Optuna's default name is random).
    study = optuna.create_study(
        study_name=workload.study_name(TPE_HYPERBAND, seed),
        direction=settings.study.primary.direction,
        pruner=make_pruner(settings.pruner),
    )
    events: list[_Event] = []
    counter = iter(range(1 << 62))
    started = pruned = 0

    def start(now: float) -> None:
        nonlocal started
        reseed_for_next_trial(study, settings, len(study.trials))  # as the tuner, before each ask
        trial = study.ask(space)
        params = trial.params
        curve = digits.curve(params["lr"], params["hidden"], params["optimizer"], epochs)
        started += 1
        for step, value in enumerate(curve):
            due = now + clock.start_s + (step + 1) * clock.epoch_s
            heapq.heappush(events, _Event(due, next(counter), trial, step, value))

    def free_slot(at: float) -> None:
        heapq.heappush(events, _Event(at, next(counter), None))

    for _ in range(workload.parallel):
        start(0.0)
    finished: set[int] = set()
    now = 0.0
    while events:
        event = heapq.heappop(events)
        now = event.time_s
        if event.trial is None:
            if started < workload.trials:
                start(now)
            continue
        trial = event.trial
        if trial.number in finished:
            continue  # a report after its trial was pruned: the job is gone
        if workload.goal.reached_by(event.value):
            return Outcome(now, True, started, pruned)
        trial.report(event.value, event.step)
        if event.step == epochs - 1:
            study.tell(trial, event.value)
            finished.add(trial.number)
            free_slot(now + clock.exit_s)
        elif trial.should_prune():
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            finished.add(trial.number)
            pruned += 1
            free_slot(now + clock.kill_s)
    return Outcome(now, False, started, pruned)


def simulate_asha(arm: Arm, seed: int, digits: Digits, clock: Clock, workload: Workload) -> Outcome:
    """The study under tunepod's ASHA (``tunepod.hpo.asha``, its real rule over the study's real
    trials): a paused trial frees its slot ``kill_s`` after the report that paused it, having saved
    that epoch; a promoted one starts again (``start_s`` to its next epoch's end, as a new job) from
    the epoch after. Slots are filled as the tuner fills them: promotions first, then new trials, then,
    with nothing left to ask, a slot that would idle while the study's own trials run resumes the best
    paused trial, and once nothing runs the best paused trial is trained on until one has completed.
    (A real pause lands up to an epoch later, when the script next checks ``ctx.should_stop()``.)"""
    settings = arm.settings(seed)
    asha = make_asha(settings)
    assert asha is not None, f"{arm.text} is not an ASHA arm"
    space = distributions(settings.space)
    epochs = workload.max_step + 1
    study = optuna.create_study(
        study_name=workload.study_name(TPE_HYPERBAND, seed), direction=settings.study.primary.direction
    )
    live: dict[int, optuna.trial.Trial] = {}
    generation: dict[int, int] = {}  # a trial's current job: reports of an earlier one are stale
    judges: dict[int, RungJudge] = {}  # each running job's rungs still to decide
    events: list[_Event] = []
    counter = iter(range(1 << 62))
    running: set[int] = set()
    idle_promoted: set[int] = set()
    started = paused = 0
    idle_slots = workload.parallel

    def run(trial: optuna.trial.Trial, now: float, first_step: int) -> None:
        params = trial.params
        curve = digits.curve(params["lr"], params["hidden"], params["optimizer"], epochs)
        generation[trial.number] = generation.get(trial.number, 0) + 1
        running.add(trial.number)
        judges[trial.number] = RungJudge.for_job(asha, trial.number, AshaState.of(study.trials[trial.number]))
        job = generation[trial.number]
        for step in range(first_step, epochs):
            due = now + clock.start_s + (step - first_step + 1) * clock.epoch_s
            heapq.heappush(events, _Event(due, next(counter), trial, step, curve[step], job))

    def promote(number: int, now: float) -> None:
        frozen = study.trials[number]
        state = AshaState.of(frozen)
        assert state is not None
        live[number].set_user_attr(ATTR_ASHA, state.promoted().to_attr())
        run(live[number], now, max(frozen.intermediate_values) + 1)

    def fill(now: float) -> None:
        nonlocal idle_slots, started
        while idle_slots > 0:
            trials = study.trials
            candidates = asha.promotable(trials)
            if candidates:
                idle_promoted.discard(candidates[0])
                promote(candidates[0], now)
            elif started < workload.trials:
                reseed_for_next_trial(study, settings, len(trials))
                trial = study.ask(space)
                live[trial.number] = trial
                started += 1
                run(trial, now, 0)
            else:
                busy = bool(running - idle_promoted)
                completed = any(t.state is optuna.trial.TrialState.COMPLETE for t in trials)
                merit = asha.by_merit(trials) if busy or not completed else []
                if not merit:
                    return
                if busy:
                    idle_promoted.add(merit[0])
                promote(merit[0], now)
            idle_slots -= 1

    fill(0.0)
    now = 0.0
    while events:
        event = heapq.heappop(events)
        now = event.time_s
        trial = event.trial
        if trial is None:
            idle_slots += 1
            fill(now)
            continue
        if event.job != generation[trial.number] or trial.number not in running:
            continue  # a report of a job that was stopped
        if workload.goal.reached_by(event.value):
            return Outcome(now, True, started, paused)
        trial.report(event.value, event.step)
        if event.step == epochs - 1:
            study.tell(trial, event.value)
            running.discard(trial.number)
            heapq.heappush(events, _Event(now + clock.exit_s, next(counter), None))
            continue
        rung = judges[trial.number].judge(event.step + 1, lambda: study.trials)
        if rung is not None:
            state = AshaState.of(study.trials[trial.number])
            promotions = state.promotions if state else 0
            trial.set_user_attr(ATTR_ASHA, AshaState(rung, True, 1, promotions).to_attr())
            running.discard(trial.number)
            paused += 1
            heapq.heappush(events, _Event(now + clock.kill_s, next(counter), None))
    return Outcome(now, False, started, paused)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality.simulate", description=__doc__)
    parser.add_argument("--arms", default="random/none,tpe/hyperband:2:6", help="comma-separated arms")
    parser.add_argument("--seeds", type=int, default=15)
    parser.add_argument("--first-seed", type=int, default=0, help=f"seeds: this, + {SEED_STRIDE}, ...")
    parser.add_argument("--trials", type=int, default=40, help="trials per study")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--target", type=float, default=0.974)
    parser.add_argument("--start-s", type=float, default=2.5, help="a trial's start to its first epoch's end")
    parser.add_argument("--epoch-s", type=float, default=0.55, help="one more epoch")
    parser.add_argument("--exit-s", type=float, default=1.0, help="a full trial's last report to its exit")
    parser.add_argument("--kill-s", type=float, default=0.9, help="a pruned trial's last report to its exit")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    torch.set_num_threads(1)
    digits = Digits()
    clock = Clock(args.start_s, args.epoch_s, args.exit_s, args.kill_s)
    workload = quality_digits(args.trials, args.parallel, args.epochs, args.epoch_s, args.target)
    medians: dict[str, float] = {}
    for text in args.arms.split(","):
        run = simulate_asha if "/asha" in text else simulate
        outcomes = [
            run(Arm(text), args.first_seed + index * SEED_STRIDE, digits, clock, workload)
            for index in range(args.seeds)
        ]
        medians[text] = statistics.median(o.time_s for o in outcomes)
        baseline = next(iter(medians.values()))
        print(
            f"{text}: median {medians[text]:.1f} s ({medians[text] / baseline:.2f}x), reached "
            f"{sum(o.reached for o in outcomes)}/{len(outcomes)}; per seed "
            + " ".join(o.describe() for o in outcomes),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
