"""The digits quality study run on the real Tuner in simulated time: which tuning settings to measure.

    .venv/bin/python -m benchmarks.quality.simulate                      # the benchmark's two arms
    .venv/bin/python -m benchmarks.quality.simulate --seeds 20 --arms \\
        "random/none,tpe/hyperband:1:auto,tpe/hyperband:2:6,tpe:4/none,tpe/asha:2:6"

A real study of the benchmark takes minutes; its outcome is mostly which parameters the sampler draws
and which trials the pruner stops, pauses or resumes, and those depend on the learning curves and on
the tuner alone. This trains each drawn configuration in-process with the digits trainer's code and
settings (examples/digits/train.py: one process, batch 64, seed 0, the staged splits) and runs the
study on the real Tuner in simulated time (``run_quality_study``: its sampler, pruner, ASHA or PBT
policy, its polls, over the real local launcher): a trial's job starts ``start_s`` before its first
epoch, each epoch takes ``epoch_s`` and reports, a full trial exits ``exit_s`` after its last report
and a stopped one ``kill_s`` after its stop signal (measured here on 2026-12-02: start 2.5 s to the
first epoch's end, exit 1.0 s, kill 0.9 s from the report that stopped it, of which the tuner's poll
is simulated; epochs of the sleep plus ~0.05 s). The study is the benchmark's spec
(specs/quality-digits.yaml) with the arm's overrides, named as the benchmark names its tpe+hyperband
study of the seed (Hyperband puts a trial in a bracket by a hash of the study's name). The learning
curve is the one piece written twice: the trainer is a script, so its model and loop are repeated
here. It says nothing about the orchestrator's own time; the benchmark measures that.

An arm is ``sampler[:n_startup_trials]/pruner[:min_resource[:max_resource]]``: sampler ``random`` or
``tpe`` (or any sampler kind the spec takes), pruner ``none``, ``hyperband`` (``max_resource`` a
number or ``auto``), ``successive_halving``, ``asha`` or ``median`` (the number is its
``warmup_steps``). It prints, per arm, the median time to target over seeds and its ratio to the
first arm's, and per seed the time, the trials asked and those stopped early (pruned, or paused and
never resumed) by then; a study that never reaches the target counts with its whole budget's time
(``>``)."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmarks.quality.workloads import SPECS, TPE_HYPERBAND, TUNE_STEP, Workload
from benchmarks.quality.workloads import digits as quality_digits
from benchmarks.simulated_tuner import run_quality_study
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

    def settings(self, seed: int, workload: Workload) -> TuneSettings:
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
            f"{tune}.study.name={workload.study_name(TPE_HYPERBAND, seed)}",
            f"{tune}.num_trials={workload.trials}",
            *(f"{tune}.train.args.{key}={value}" for key, value in workload.train_args.items()),
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


@dataclass(frozen=True)
class DigitsCurve:
    """The digits trainer's curves on the benchmark's clock, as the quality run's ``CurveModel``."""

    digits: Digits
    clock: Clock
    num_steps: int
    """Epochs of a full trial (reports at steps 0..epochs-1)."""

    @property
    def startup_s(self) -> float:
        return self.clock.start_s

    @property
    def exit_s(self) -> float:
        return self.clock.exit_s

    @property
    def stop_s(self) -> float:
        return self.clock.kill_s

    def value(self, params: Mapping[str, Any], step: int) -> float:
        curve = self.digits.curve(params["lr"], params["hidden"], params["optimizer"], self.num_steps)
        return curve[step]

    def step_s(self, params: Mapping[str, Any], step: int) -> float:
        return self.clock.epoch_s


def simulate(arm: Arm, seed: int, curve: DigitsCurve, workload: Workload) -> Outcome:
    """The arm's study of ``seed`` on the real tuner, up to the first report that reaches the target."""
    goal = workload.goal
    trace = run_quality_study(
        arm.settings(seed, workload),
        curve,
        seed=seed,
        num_parallel=workload.parallel,
        stop=lambda report: goal.reached_by(report.value),
    )
    hit = trace.first_reaching(goal.reached_by)
    time_s = hit.at_s if hit is not None else trace.simulated_s
    return Outcome(time_s, hit is not None, len(trace.outcomes), trace.count("PRUNED", "PAUSED", "EXPLOITED"))


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
    parser.add_argument(
        "--kill-s",
        type=float,
        default=0.65,
        help="a stopped trial's stop signal to its exit (the measured 0.9 s from the report that stopped "
        "it, less the tuner's mean poll delay, which is simulated: poll_s 0.5 / 2)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    torch.set_num_threads(1)
    clock = Clock(args.start_s, args.epoch_s, args.exit_s, args.kill_s)
    curve = DigitsCurve(Digits(), clock, args.epochs)
    workload = quality_digits(args.trials, args.parallel, args.epochs, args.epoch_s, args.target)
    medians: dict[str, float] = {}
    for text in args.arms.split(","):
        outcomes = [
            simulate(Arm(text), args.first_seed + index * SEED_STRIDE, curve, workload)
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
