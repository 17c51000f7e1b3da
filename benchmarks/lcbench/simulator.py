"""Simulated time for ask/tell tuners: ``n_workers`` slots, an event queue, the surrogate's epoch times.

A tuner plugs in as a Scheduler (two methods). When a worker is free the simulator asks the scheduler
for a Job (a configuration and the epochs to train) and places each of its epochs on the clock:

    epoch k of a job started at t ends at  t + startup_s + time[k] - time[first_epoch - 1]

where ``time`` is the surrogate's cumulative training time of that configuration (``time[0] = 0``),
so a job resumed from a checkpoint of epoch ``first_epoch - 1`` pays only its new epochs, plus the
start-up cost. Events are handled in time order (ties in the order they were scheduled); after each
epoch the scheduler says whether the job goes on. The run ends when the Budget's epochs are spent
(mid-flight epochs of the other workers are not counted) or when every worker is idle and the
scheduler has nothing to start.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from benchmarks.lcbench.problem import Budget, Curve, Problem, Recorder, Trace
from benchmarks.lcbench.surrogate import Config


@dataclass(frozen=True)
class Job:
    """Train configuration ``trial`` from ``first_epoch`` to ``last_epoch`` (1-based, inclusive).
    ``first_epoch > 1`` resumes from the checkpoint of epoch ``first_epoch - 1``, which the scheduler
    must have had trained before (the simulator checks nothing about checkpoints). ``trial`` names the
    configuration: jobs of one trial must carry the same config."""

    trial: int
    config: Config
    first_epoch: int
    last_epoch: int


class Scheduler(Protocol):
    """The tuner under test, as the simulator drives it. Called from one thread, in simulated-time
    order; it holds its own state (which trials are paused, what to promote)."""

    def next_job(self) -> Job | None:
        """A job for a free worker, or None when nothing can start until a running job reports (the
        simulator asks again after every job's end; when every worker is idle, None ends the run)."""

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        """The job trained ``epoch`` and its val_accuracy is ``value``: True to train the next epoch,
        False to stop the job here (kill or pause: the scheduler decides which it means). The job
        ends after ``job.last_epoch`` whatever this returns."""


@dataclass
class _Running:
    job: Job
    curve: Curve
    started_s: float
    epoch: int  # the epoch whose end is the next event


def simulate(problem: Problem, budget: Budget, scheduler: Scheduler) -> Trace:
    """Run ``scheduler`` on ``problem`` until the budget is spent; its trace (problem.Trace)."""
    recorder = Recorder(budget)
    curves: dict[int, Curve] = {}
    events: list[tuple[float, int, int]] = []  # (time_s, order, worker)
    order = itertools.count()
    running: dict[int, _Running] = {}
    idle = list(range(budget.n_workers))
    num_jobs = 0
    now = 0.0

    def epoch_end(state: _Running) -> float:
        time_s = state.curve.time_s
        before = time_s[state.job.first_epoch - 2] if state.job.first_epoch > 1 else 0.0
        return state.started_s + budget.startup_s + float(time_s[state.epoch - 1] - before)

    def fill_idle_workers() -> None:
        nonlocal num_jobs
        while idle:
            job = scheduler.next_job()
            if job is None:
                return
            check_job(job, problem.max_epochs)
            if job.trial not in curves:
                curves[job.trial] = problem.curve(job.config)
            worker = idle.pop(0)
            state = _Running(job, curves[job.trial], now, job.first_epoch)
            running[worker] = state
            num_jobs += 1
            heapq.heappush(events, (epoch_end(state), next(order), worker))

    fill_idle_workers()
    while events and not recorder.spent:
        now, _, worker = heapq.heappop(events)
        state = running[worker]
        value = float(state.curve.val_accuracy[state.epoch - 1])
        if not recorder.record(now, value):
            break
        go_on = scheduler.on_epoch(state.job, state.epoch, value)
        if go_on and state.epoch < state.job.last_epoch:
            state.epoch += 1
            heapq.heappush(events, (epoch_end(state), next(order), worker))
        else:
            del running[worker]
            idle.append(worker)
        # Also after an epoch that goes on: a scheduler that had nothing to start may have now.
        fill_idle_workers()
    return recorder.trace(end_s=now, num_trials=len(curves), num_jobs=num_jobs)


def check_job(job: Job, max_epochs: int) -> None:
    if not 1 <= job.first_epoch <= job.last_epoch <= max_epochs:
        raise ValueError(
            f"job of trial {job.trial}: epochs {job.first_epoch}..{job.last_epoch} outside 1..{max_epochs}"
        )


def epochs_of(fidelity: float, max_epochs: int) -> int:
    """A tuner's (float) budget as whole epochs: rounded, within 1..max_epochs (Hyperband's 52 / 3^k
    gives 1.93, 5.78, 17.3: 2, 6, 17)."""
    return int(np.clip(round(fidelity), 1, max_epochs))
