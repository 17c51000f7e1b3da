"""Runs every (arm, instance, seed) in a pool of processes, each with its own surrogate."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from benchmarks.lcbench.arms import ARMS
from benchmarks.lcbench.metrics import RunSummary, summarize
from benchmarks.lcbench.problem import Budget, make_problem

# Median CPU seconds per run of each arm (the development run of 2026-12-06; BOHB up to 88 s): the
# slow ones are started first so that the pool does not end waiting on one of them.
EXPECTED_CPU_S = {
    "syne-tune-bohb": 11.0,
    "smac-hyperband": 5.7,
    "optuna-tpe-hyperband": 4.1,
    "syne-tune-asha": 2.1,
    "ray-asha": 1.3,
    "dehb": 0.7,
    "random": 0.1,
}


@dataclass(frozen=True)
class Task:
    arm: str
    instance: str
    seed: int
    budget: Budget


def run_task(task: Task) -> RunSummary:
    """One run, in a pool's process."""
    quiet_the_peers()
    problem = make_problem(task.instance)
    started = time.process_time()
    try:
        trace = ARMS[task.arm](problem, task.seed, task.budget)
    except Exception as exc:
        raise RuntimeError(
            f"arm {task.arm} failed on instance {task.instance}, seed {task.seed}: {exc!r}; replay it alone "
            f"with: python -m benchmarks.lcbench --arms {task.arm} --instances {task.instance} --seeds 1 "
            f"--first-seed {task.seed} --jobs 1"
        ) from exc
    cpu_s = time.process_time() - started
    return summarize(task.arm, task.instance, task.seed, trace, problem.reference, task.budget, cpu_s)


def quiet_the_peers() -> None:
    """The peers log every step and warn of their own deprecations; the table says what matters."""
    for name in ("syne_tune", "smac", "ray", "optuna"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def run_all(
    tasks: Sequence[Task], jobs: int, on_done: Callable[[RunSummary, int, int], None]
) -> list[RunSummary]:
    """Every task, ``jobs`` at a time; ``on_done(summary, done, total)`` after each. Results in the
    tasks' order."""
    order = sorted(range(len(tasks)), key=lambda i: -EXPECTED_CPU_S.get(tasks[i].arm, 60.0))
    results: dict[int, RunSummary] = {}
    if jobs <= 1:
        for index in order:
            results[index] = run_task(tasks[index])
            on_done(results[index], len(results), len(tasks))
    else:
        # One task per process call: a process keeps its surrogate between tasks (problem.py caches it).
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_task, tasks[index]): index for index in order}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                on_done(results[futures[future]], len(results), len(tasks))
    return [results[index] for index in range(len(tasks))]
