"""The smallest story of a failing seed: its scenario with as few faults as still break the invariant.

Greedy, as delta debugging does it: drop one timed fault, or silence one kind of fault, or make every
call instant, or run one trial fewer, or one in parallel fewer; keep the change whenever the same
invariant still breaks; stop when no change keeps it broken. The scheduling choices stay the seed's,
so each candidate is itself a deterministic, replayable run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

from simulation.run import Outcome, run_seed
from simulation.scenario import Scenario
from simulation.scheduler import Latency

_RATES = ("optuna_writes", "optuna_reads", "mlflow", "jobs")


def shrink(outcome: Outcome) -> Outcome:
    """A run of a smaller scenario that breaks ``outcome``'s first invariant (``outcome`` itself when
    none does)."""
    target = outcome.violations[0].invariant
    best = outcome
    while True:
        for candidate in smaller(best.scenario):
            tried = run_seed(candidate.seed, scenario=candidate)
            if any(violation.invariant == target for violation in tried.violations):
                best = tried
                break
        else:
            return best


def smaller(scenario: Scenario) -> Iterator[Scenario]:
    """Scenarios one step smaller than ``scenario``, the biggest cuts first."""
    if scenario.backend != scenario.backend.quiet():
        yield replace(scenario, backend=scenario.backend.quiet())
    for name in _RATES:
        rates = getattr(scenario, name)
        quiet = type(rates)()
        if rates != quiet:
            yield replace(scenario, **{name: quiet})
    for index in range(len(scenario.timed)):
        yield replace(scenario, timed=scenario.timed[:index] + scenario.timed[index + 1 :])
    for name in _RATES:
        rates = getattr(scenario, name)
        for field in fields(rates):
            if getattr(rates, field.name):
                yield replace(scenario, **{name: replace(rates, **{field.name: 0.0})})
    if scenario.crash_per_step:
        yield replace(scenario, crash_per_step=0.0)
    if scenario.crash_after_write:
        yield replace(scenario, crash_after_write=0.0)
    if scenario.lost_pause_answers:
        yield replace(scenario, lost_pause_answers=0.0)
    if scenario.disk_full_per_write:
        yield replace(scenario, disk_full_per_write=0.0)
    for name in ("stall_per_step", "clock_jump_per_step", "job_stall_per_step"):
        if getattr(scenario, name):
            off: dict[str, Any] = {name: 0.0}
            yield replace(scenario, **off)
    if scenario.latency != Latency():
        yield replace(scenario, latency=Latency())
    for name, least in (("num_trials", 1), ("num_parallel", 1), ("max_restarts", 0)):
        value: Any = getattr(scenario, name)
        if value > least:
            yield replace(scenario, **{name: value - 1})
