"""Population-based training against real components: the quadratic trainer's jobs on the local
launcher, a journal Optuna storage, an MLflow SQLite store (``tests/e2e/test_pbt_run.py`` runs PBT
through `tunepod run` on the local launcher and the Slurm cluster, and SIGKILLs it at an exploit).

Proves: a member in the bottom of the population at a boundary is stopped, its trial ends PRUNED, and
its member goes on in one new trial that starts from a copy of a top member's checkpoint (its job's
first report is the step after it), with that member's parameters perturbed; each member ends with
one COMPLETE trial; the lineage is in MLflow; no job is left behind.
"""

from __future__ import annotations

import math
from pathlib import Path

import boto3
import pytest
from mlflow import MlflowClient
from optuna.trial import FrozenTrial, TrialState
from test_sagemaker_launcher import launcher_spec
from test_tuner import assert_no_job_left, child_runs, make_tuner, settings, starts

from tunepod.errors import TunepodError
from tunepod.hpo.pbt import PbtState, member_of
from tunepod.hpo.population import lineage
from tunepod.launch.paths import JobPaths
from tunepod.launch.sagemaker import SageMakerLauncher
from tunepod.launch.submission import read_cancel_marker
from tunepod.runtime import read_reports
from tunepod.runtime.checkpoints import latest_checkpoint

EPOCHS = 8
FACTORS = (0.9, 1.1)
# Boundaries at 2, 4 and 6 units; a member that ranks in the bottom half of those there is exploited.
PBT = {
    "population": 4,
    "interval": 2,
    "quantile": 0.5,
    "max_resource": EPOCHS,
    "perturb": {"factors": list(FACTORS), "resample_probability": 0.0},
}
# The last member is the worst (score 1 - (x - 0.3)^2) and the slowest, so it reaches each boundary
# after others and ranks last there: it is exploited at the first.
MEMBERS = [
    {"x": 0.3, "sleep_s": 0.4},
    {"x": 0.5, "sleep_s": 0.4},
    {"x": 0.7, "sleep_s": 0.4},
    {"x": 1.0, "sleep_s": 1.2},
]


def test_the_worst_member_goes_on_from_a_top_members_checkpoint_with_perturbed_parameters(
    tmp_path: Path,
) -> None:
    tune = settings(
        tmp_path,
        train={"args": {"epochs": EPOCHS}, "resources": {"stop_grace_s": 60}},
        num_parallel=4,
        pbt=PBT,
        space={
            "x": {"type": "float", "low": 0.0, "high": 1.0},
            "sleep_s": {"type": "float", "low": 0.1, "high": 1.5},
        },
        enqueue=MEMBERS,
    )
    assert tune.num_trials == 4  # defaults to the population
    tuner = make_tuner(tmp_path, tune)
    records = {t.number: t for t in tuner.run().trials}
    trials = {t.number: t for t in tuner.study.get_trials()}
    assert all(t.state.is_finished() for t in trials.values()), {n: t.state for n, t in trials.items()}

    roots = sorted(n for n, t in trials.items() if PbtState.of(t) is None)
    assert roots == [0, 1, 2, 3]
    for root in roots:
        chain = lineage(trials, root)
        assert {member_of(t) for t in chain} == {root}
        assert [t.state for t in chain] == [TrialState.PRUNED] * (len(chain) - 1) + [TrialState.COMPLETE]
        for exploited in chain[:-1]:
            marker = read_cancel_marker(JobPaths(Path(records[exploited.number].job_dir)))
            assert marker is not None and marker.reason == "exploited", (exploited.number, marker)
    assert len(trials) == 4 + sum(PbtState.of(t) is not None for t in trials.values())
    assert sum(t.state is TrialState.COMPLETE for t in trials.values()) == 4

    worst = lineage(trials, 3)
    assert len(worst) >= 2, "the worst member was never exploited"
    for continuation in [t for t in trials.values() if PbtState.of(t) is not None]:
        assert_continues_from_its_donor(trials, continuation, Path(records[continuation.number].job_dir))
    # It took a better member's x: its final score beats what its own x could ever reach.
    assert worst[-1].value is not None and worst[-1].value > 1 - (1.0 - 0.3) ** 2

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = {r.data.tags["tunepod.trial"]: r for r in child_runs(tmp_path, tuner.ctx.parent_run_id)}
    assert sorted(runs, key=int) == [str(n) for n in sorted(trials)]  # one run per trial
    first, then = runs[str(worst[0].number)], runs[str(worst[1].number)]
    assert first.info.status == "KILLED" and first.data.tags["tunepod.pbt.continued_in"] == str(
        worst[1].number
    )
    state = PbtState.of(worst[1])
    assert state is not None
    assert then.data.tags["tunepod.pbt.member"] == "3" and then.data.tags["tunepod.pbt.generation"] == "1"
    assert then.data.tags["tunepod.pbt.parent"] == str(state.parent)
    assert then.data.tags["tunepod.pbt.from_step"] == str(state.from_step)
    # Its curve is what its job reported, from the step after the donor's checkpoint; a continuation
    # whose donor had finished trains nothing and ends at that step.
    history = client.get_metric_history(then.info.run_id, "score")
    reported = {r.step for r in read_reports(JobPaths(Path(records[worst[1].number].job_dir)).metrics)}
    assert {m.step for m in history} == reported | {max(reported, default=state.from_step)}
    assert all(step > state.from_step for step in reported)
    assert_no_job_left(list(records.values()), "local")


def assert_continues_from_its_donor(
    trials: dict[int, FrozenTrial], trial: FrozenTrial, job_dir: Path
) -> None:
    """The continuation's job started once, from the copy of its donor's checkpoint (its reports
    begin at the step after it, each step once), with the donor's x times one of the factors."""
    state = PbtState.of(trial)
    assert state is not None
    donor = trials[state.parent]
    assert member_of(donor) != state.member, "a member copied itself"
    assert max(donor.intermediate_values) >= state.from_step >= 0
    seed = latest_checkpoint(Path(state.seed).parent)
    assert seed is not None and seed.step == state.from_step
    steps = [r.step for r in read_reports(JobPaths(job_dir).metrics)]
    assert steps == list(range(state.from_step + 1, state.from_step + 1 + len(steps))), steps
    assert starts(str(job_dir)) == 1
    donor_x = float(donor.params["x"])
    assert any(math.isclose(trial.params["x"], min(1.0, donor_x * f)) for f in FACTORS), (
        donor_x,
        trial.params,
    )


def test_pbt_is_refused_where_the_orchestrator_cannot_read_the_jobs_checkpoints(tmp_path: Path) -> None:
    """SageMaker without FSx read-write syncs checkpoints to S3: PBT could copy nothing between members.
    Refused before any trial starts (the client is never called)."""
    client = boto3.client(
        "sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    sagemaker = SageMakerLauncher(launcher_spec(tmp_path), client)
    tune = settings(tmp_path, num_parallel=4, pbt=PBT)
    with pytest.raises(TunepodError, match=r"pbt copies checkpoints.*sagemaker.*fix: mount FSx read-write"):
        make_tuner(tmp_path, tune, launcher=sagemaker)
