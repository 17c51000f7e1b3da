"""What the tuner does for PBT over a real in-memory Optuna study and real checkpoint folders
(``tunepod.hpo.population``): which donor's checkpoint an exploited member goes on from, and the check
that a study holds no more first members than the population."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from tunepod.errors import TunepodError
from tunepod.hpo.pbt import ATTR_PBT, Pbt, PbtState
from tunepod.hpo.population import Population, check_members
from tunepod.hpo.trials import StudyTrials
from tunepod.launch.paths import JobPaths
from tunepod.runtime.checkpoints import save_checkpoint

SPACE = {"x": FloatDistribution(0.0, 1.0)}


def study_of(*members: tuple[TrialState, int]) -> optuna.Study:
    """A study of first members, each in its state with one value per step up to its last."""
    study = optuna.create_study(direction="maximize")
    for number, (state, last_step) in enumerate(members):
        values = {step: number / 10 + step / 100 for step in range(last_step + 1)}
        value = values[last_step] if state is TrialState.COMPLETE else None
        study.add_trial(
            create_trial(
                state=state, value=value, params={"x": 0.5}, distributions=SPACE, intermediate_values=values
            )
        )
    return study


def population_of(
    study: optuna.Study, jobs_dir: Path, max_resource: int | None, *, kept: int = 1
) -> Population:
    def job_dir(trial: FrozenTrial) -> Path:
        return jobs_dir / f"trial-{trial.number}"

    pbt = Pbt(population=4, interval=2, quantile=0.5, maximize=True, max_resource=max_resource)
    trials = StudyTrials(study)
    for trial in trials.all():  # each member saved its newest steps, as its job does
        last = max(trial.intermediate_values)
        for step in range(max(0, last - kept + 1), last + 1):
            save_checkpoint(JobPaths(job_dir(trial)).checkpoints, {"step": step}, step, keep=kept)
    return Population(pbt, trials, jobs_dir, job_dir, dict(SPACE), seed=0)


@pytest.mark.parametrize("max_resource", [8, None])
def test_a_donor_that_finished_is_passed_over_for_one_that_trains_on(
    tmp_path: Path, max_resource: int | None
) -> None:
    """Member 0 finished (COMPLETE at its last step, the only one it kept), member 1 trains on:
    whatever the seeded order of the donors, the exploited member 3 goes on from member 1's
    checkpoint, with steps left to train."""
    study = study_of(
        (TrialState.COMPLETE, 7), (TrialState.RUNNING, 4), (TrialState.RUNNING, 4), (TrialState.RUNNING, 3)
    )
    population = population_of(study, tmp_path, max_resource)
    exploited = population.trials.frozen(3)
    for donors in ([0, 1], [1, 0]):
        seed = population.seed_from_a_donor(exploited, donors)
        assert seed.donor.number == 1 and seed.copied is not None and seed.copied.step == 4
    assert not (tmp_path / "trial-3" / "pbt-seed-from-0").exists()  # nothing copied from it


def test_a_donor_at_max_resource_is_passed_over_and_with_none_left_the_member_goes_on_from_its_own(
    tmp_path: Path,
) -> None:
    """Member 0 saved its last step (7, with max_resource 8), the only one it kept, and is not told
    COMPLETE yet: a copy of it would leave nothing to train, none is made, and with no other donor the
    member goes on from its own."""
    study = study_of(
        (TrialState.RUNNING, 7), (TrialState.RUNNING, 4), (TrialState.RUNNING, 4), (TrialState.RUNNING, 3)
    )
    population = population_of(study, tmp_path, max_resource=8)
    seed = population.seed_from_a_donor(population.trials.frozen(3), [0])
    assert seed.donor.number == 3 and seed.copied is not None and seed.copied.step == 3
    assert seed.copied.path == tmp_path / "trial-3" / "pbt-seed-from-3" / "step-000003"
    assert not (tmp_path / "trial-3" / "pbt-seed-from-0").exists()  # no useless copy


@pytest.mark.parametrize("max_resource", [8, None])
def test_a_finished_donor_that_kept_an_earlier_step_is_copied_from_it(
    tmp_path: Path, max_resource: int | None
) -> None:
    """Member 0 finished and kept its last two steps (6 and 7): the exploited member goes on from step
    6, which leaves a step to train, rather than from its own checkpoint (a population whose best
    member ran ahead and finished still exploits)."""
    study = study_of(
        (TrialState.COMPLETE, 7), (TrialState.RUNNING, 4), (TrialState.RUNNING, 4), (TrialState.RUNNING, 3)
    )
    population = population_of(study, tmp_path, max_resource, kept=2)
    seed = population.seed_from_a_donor(population.trials.frozen(3), [0])
    assert seed.donor.number == 0 and seed.copied is not None and seed.copied.step == 6


def test_a_donor_with_steps_left_is_copied(tmp_path: Path) -> None:
    study = study_of(
        (TrialState.RUNNING, 6), (TrialState.RUNNING, 4), (TrialState.RUNNING, 4), (TrialState.RUNNING, 3)
    )
    population = population_of(study, tmp_path, max_resource=8)
    seed = population.seed_from_a_donor(population.trials.frozen(3), [0])
    assert seed.donor.number == 0 and seed.copied is not None and seed.copied.step == 6


def test_a_study_with_more_first_members_than_the_population_is_refused_with_the_fix() -> None:
    """A PBT spec pointed at a study run without PBT: its six trials would all count as members of a
    population of four, none would be asked, and PBT would do nothing without a word."""
    study = study_of(*[(TrialState.COMPLETE, 3)] * 6)
    pbt = Pbt(population=4, interval=2, quantile=0.25, maximize=True)
    with pytest.raises(TunepodError) as raised:
        check_members(study.get_trials(), pbt, "digits")
    message = str(raised.value)
    assert "study digits holds 6 trials that continue no PBT member (trials 0, 1, 2, 3, 4, ...)" in message
    assert "more than pbt.population 4" in message
    assert "fix: give study.name a new name for this PBT study, or set pbt.population to 6 or more" in message
    check_members(study.get_trials(), Pbt(population=6, interval=2, quantile=0.25, maximize=True), "digits")


def test_a_pbt_study_passes_with_its_continuations_and_enqueued_trials() -> None:
    """Continuations (they carry a lineage) and enqueued trials not yet asked (WAITING) are no first
    members: a PBT study of four members passes however many generations it has."""
    study = study_of(*[(TrialState.RUNNING, 3)] * 4)
    for generation, member in enumerate([3, 2, 3], start=1):
        lineage = PbtState(member, generation, parent=0, from_step=3, replaces=member, seed="")
        study.add_trial(
            create_trial(
                state=TrialState.RUNNING,
                params={"x": 0.5},
                distributions=SPACE,
                user_attrs={ATTR_PBT: lineage.to_attr()},
            )
        )
    study.enqueue_trial({"x": 0.1})
    pbt = Pbt(population=4, interval=2, quantile=0.25, maximize=True)
    check_members(study.get_trials(), pbt, "digits")
    assert len(study.get_trials()) == 8
