"""The simulation's short form (``make test``): seeds hold every invariant, a seed replays exactly, and
the simulation finds a fixed defect put back. The long form is ``make simulate`` (1,000 seeds, a few
minutes on two cores) and ``make simulate SIMULATE_ARGS=--mutants`` (every fixed defect put back).
"""

from __future__ import annotations

import pytest
from simulation.mutants import mutant
from simulation.run import describe, run_seed
from simulation.scenario import scenario_of

SHORT_FORM_SEEDS = range(0, 24)


def test_seeds_hold_every_invariant() -> None:
    failed = [outcome for seed in SHORT_FORM_SEEDS if not (outcome := run_seed(seed)).held]
    assert not failed, f"{len(failed)} seed(s) broke an invariant; the first:\n{describe(failed[0])}"


def test_a_seed_replays_its_run_event_for_event() -> None:
    first, again = run_seed(7), run_seed(7)
    assert first.steps > 100 and first.trace.events
    assert first.trace.render() == again.trace.render()


# Mutants a few seeds find (make simulate SIMULATE_ARGS=--mutants hunts every one, on its backends):
# the short form shows that the invariants can fail, on the tuner, the watchdog, three launchers (Slurm's
# under node failures), ASHA, and a train step's lease.
@pytest.mark.parametrize(
    "name",
    [
        "half-asked",
        "host-clock",
        "leftovers-ignored",
        "gone-intent",
        "early-pause",
        "node-fail-cancelled",
        "train-step-leaks-lease",
    ],
)
def test_the_simulation_finds_a_fixed_defect_put_back(name: str) -> None:
    put_back = mutant(name)
    with put_back.apply():
        seeds = (run_seed(seed, scenario=scenario_of(seed, kinds=put_back.kinds)) for seed in range(100))
        found = next((outcome for outcome in seeds if not outcome.held), None)
    assert found is not None, f"100 seeds did not notice the {name} defect: {put_back.defect}"


# Seeds that found a defect of the library, each fixed: the seed holds now, and breaks an invariant
# again with the defect put back (make simulate SEED=1087 SIMULATE_ARGS=--mutant=lease-handed-back).
@pytest.mark.parametrize(
    ("seed", "name"),
    [
        (1087, "lease-handed-back"),  # a promotion inside the fence of a trial still recording its pause
        (604, "no-marker-for-an-ended-job"),  # a pause decided as its job died, lost in a crash
    ],
)
def test_a_seed_that_found_a_defect_holds_and_finds_it_put_back(seed: int, name: str) -> None:
    fixed = run_seed(seed)
    assert fixed.held, describe(fixed)
    with mutant(name).apply():
        put_back = run_seed(seed)
    assert not put_back.held, f"seed {seed} no longer notices the {name} defect: {mutant(name).defect}"
