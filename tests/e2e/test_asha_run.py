"""ASHA with pause and promote through `tunepod run`, as a user runs it: the CLI as a process of its
own on the session's Prefect server, the quadratic trainer's jobs on the local launcher or this host's
Slurm node, or the collective trainer's jobs of two namespaced Slurm nodes each (every pause a stop
that both nodes' ranks agree on), a real Optuna journal and MLflow SQLite store.

Four trials of 6 epochs, one at a time (so the order in which they reach the rung is fixed), one rung
at 3 units, halving: the first trial (the best x) leads the rung alone and goes on, the second (the
next best) is paused behind it and promoted once four trials have reached the rung. Proves: a
paused trial resumes from its checkpoint on a new job (no epoch trained twice, one MLflow run with
the whole curve), the trials never promoted end PRUNED, every trial ends once, no job is left. The
fault tests SIGKILL the whole `tunepod run` process group the moment a first pause is decided (its
cancel marker written: the stop, the pause's record and the promotion after it may each be half
done), or the moment a first promotion is recorded (its resumed job maybe not yet submitted), on
local jobs and on Slurm, and prove the same after the rerun (the fault at the first pause over six
trials: see ``XS_PAUSE_FAULT``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from faults_support import (
    MULTI_NODE,
    FaultStudy,
    MakeRuns,
    assert_nothing_left,
    nodes_of,
    placements,
    sqlite_tracking,
    starts,
    submission,
    wait_for,
)
from mlflow import MlflowClient
from optuna.trial import TrialState

from tunepod.hpo.asha import AshaState
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_cancel_marker
from tunepod.runtime import read_reports

pytestmark = pytest.mark.slow

EPOCHS = 6
MIN_RESOURCE = 3
XS = [0.3, 0.4, 0.9, 0.0]  # best first, then the next best: score = 1 - (x - 0.3)^2, scaled by the epoch
# For the fault at the first pause: the killed orchestrator may have written trial 1's pause without
# stopping its job, which then trains to its end (its pause came too late). With XS, the 4th trial's
# arrival at the rung would promote trial 1 only, so that branch would promote nobody; here trial 2
# (0.5) is paused behind 0 and 1 and promoted when the 6th trial makes the rung keep 3, in either
# branch (trials 3-5 rank below it: scores 0.64, 0.91, 0.58 against its 0.96).
XS_PAUSE_FAULT = [0.3, 0.4, 0.5, 0.9, 0.0, 0.95]


def asha_study(
    tmp_path: Path, launcher: str, sleep_s: float = 0.5, xs: list[float] = XS, *, num_nodes: int = 1
) -> FaultStudy:
    multi_node: dict[str, Any] = MULTI_NODE if num_nodes > 1 else {}
    return FaultStudy(
        tmp_path,
        launcher,
        sqlite_tracking(tmp_path),
        num_trials=len(xs),
        num_parallel=1,
        epochs=EPOCHS,
        sleep_s=sleep_s,
        tune={
            "pruner": {
                "kind": "asha",
                "min_resource": MIN_RESOURCE,
                "reduction_factor": 2,
                "max_resource": EPOCHS,
            },
            "space": {"x": {"type": "categorical", "choices": sorted(xs)}},
            "enqueue": [{"x": x} for x in xs],
        },
        # A long grace: every pause lands at the trainer's should_stop() (it saves there), even on a
        # loaded machine where an epoch's checkpoint can take seconds.
        train={"resources": {"stop_grace_s": 60, "num_nodes": num_nodes}},
        **multi_node,
    )


def assert_paused_and_promoted_once_each(study: FaultStudy) -> list[int]:
    """Every trial finished, some COMPLETE; some trial was paused and promoted, and trained on past
    its first rung on a later job; every epoch trained once across a trial's jobs; the trials paused
    and never promoted are PRUNED; one MLflow run per trial, whose score history is its metrics file.
    Returns the promoted trials' numbers."""
    trials = {t.number: t for t in study.trials()}
    assert sorted(trials) == list(range(study.num_trials)), sorted(trials)
    states = {n: t.state.name for n, t in trials.items()}
    assert all(t.state.is_finished() for t in trials.values()), states
    assert any(t.state is TrialState.COMPLETE for t in trials.values()), states
    promoted = [n for n, t in trials.items() if (s := AshaState.of(t)) is not None and s.promotions > 0]
    assert promoted, f"no trial was promoted: {states}"
    for number, job_dir in study.job_dirs().items():
        steps = [r.step for r in read_reports(JobPaths(job_dir).metrics)]
        assert steps == list(range(len(steps))), f"trial {number} trained an epoch twice: {steps}"
        if number in promoted:
            assert len(steps) > MIN_RESOURCE, f"promoted trial {number} trained nothing more: {steps}"
        state = AshaState.of(trials[number])
        jobs = 1 + (state.promotions if state else 0)
        assert starts(job_dir) == submission(job_dir).attempt == jobs, (number, starts(job_dir), state)
        if trials[number].state is TrialState.PRUNED:
            marker = read_cancel_marker(JobPaths(job_dir))
            assert marker is not None and marker.reason == "paused", (number, marker)
    client = MlflowClient(study.tracking_uri)
    for number in trials:
        found = client.search_runs(
            [client.get_experiment_by_name("faults").experiment_id],
            f"tags.`tunepod.study` = 'quad' and tags.`tunepod.trial` = '{number}'",
        )
        assert len(found) == 1, f"trial {number} has {len(found)} MLflow runs"
        history = client.get_metric_history(found[0].info.run_id, "score")
        reported = read_reports(JobPaths(study.job_dir(number)).metrics)
        assert sorted(m.step for m in history) == sorted(r.step for r in reported), number
    assert_nothing_left(study)
    return promoted


# On Slurm only, with trials of two nodes: the fault tests below run the same study on local jobs and
# this host's Slurm node and check the same after their rerun, so a plain run there would spend CI time
# on nothing more.
@pytest.mark.slurm_nodes(4)
def test_a_study_under_asha_on_slurm_pauses_promotes_and_resumes_from_checkpoints(
    runs: MakeRuns, tmp_path: Path
) -> None:
    # Epochs of 1 s: the pause must reach the second trial's job before it trains its last three
    # epochs, and on a loaded machine Slurm's scancel --signal can take more than the 1.5 s that
    # epochs of 0.5 s left (the job then completed unpaused, and nothing proved a resume).
    study = asha_study(tmp_path, "slurm", sleep_s=1.0, num_nodes=2)
    run = runs(study).run("asha")
    promoted = assert_paused_and_promoted_once_each(study)
    for number, job_dir in study.job_dirs().items():
        assert all(len(nodes_of(ranks)) == 2 for ranks in placements(job_dir).values()), number
    # Off a terminal, `tunepod run` says each event on a line: the pause, never a bare "Completed".
    output = run.output()
    assert re.search(r"^search/trial-1 Paused: paused at step \d+ \(rung \d+\) by ASHA", output, re.M), output
    assert re.search(r"^search/trial-1 Completed: completed at step \d+ with ", output, re.M), output
    assert re.search(r"^step search \(tune\) done after \d\d:\d\d$", output, re.M), output
    # Without a fault, the promoted trial is the second, and it completes. (After the faults below,
    # the first paused job may finish before the rerun stops it, which is right.)
    assert promoted == [1] and study.trials()[1].state is TrialState.COMPLETE
    # It stopped at its pause, saving the epoch it had finished, and resumed after it; the best, the
    # rung's leader, was never stopped.
    second, best = study.job_dir(1), study.job_dir(0)
    assert (second / "stops.log").exists() and starts(second) == 2
    assert not (best / "stops.log").exists() and starts(best) == 1


@pytest.mark.parametrize("launcher", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_sigkill_of_the_orchestrator_group_as_a_pause_is_decided_then_rerun(
    runs: MakeRuns, tmp_path: Path, launcher: str
) -> None:
    """Fault: SIGKILL of the whole `tunepod run` process group as soon as a first pause is decided (its
    cancel marker written), then the same command again: the rerun finishes the stop, records the
    pause, promotes and prunes as if nothing happened. A job the kill left unstopped may have trained
    to its end before the rerun could stop it: it is then COMPLETE, its pause came too late (as a
    prune that comes too late), so which trial completes is not fixed here; six trials
    (``XS_PAUSE_FAULT``) make a promotion due either way. On Slurm the stop is
    `scancel --signal` to a job slurmd runs, which outlives the killed orchestrator."""
    study = asha_study(tmp_path, launcher, sleep_s=1.0 if launcher == "slurm" else 0.5, xs=XS_PAUSE_FAULT)
    tunepod = runs(study)
    first = tunepod.start("killed")

    def pause_decided() -> bool:
        markers = [read_cancel_marker(JobPaths(d)) for d in study.job_dirs().values()]
        return any(m is not None and m.reason == "paused" for m in markers)

    wait_for(pause_decided, "a first pause", running=first)
    first.kill()
    tunepod.run("rerun")
    assert_paused_and_promoted_once_each(study)


@pytest.mark.parametrize("launcher", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_sigkill_of_the_orchestrator_group_as_a_promotion_is_recorded_then_rerun(
    runs: MakeRuns, tmp_path: Path, launcher: str
) -> None:
    """Fault: SIGKILL of the whole `tunepod run` process group as soon as a first promotion is in the
    study (the tuner records it before it submits the resumed job, so the kill lands between the record
    and the resume, or just after the submission), then the same command again: the promoted trial
    resumes exactly once (its job's attempts are 1 + its promotions), from its checkpoint. On Slurm
    the resumed job is an sbatch the killed orchestrator may or may not have made: the rerun must
    neither lose it nor submit it twice."""
    study = asha_study(tmp_path, launcher, sleep_s=1.0 if launcher == "slurm" else 0.5)
    tunepod = runs(study)
    first = tunepod.start("killed")

    def promotion_recorded() -> bool:
        if not study.job_dirs():
            return False  # the tuner has not created the study yet
        return any((s := AshaState.of(t)) is not None and s.promotions > 0 for t in study.trials())

    wait_for(promotion_recorded, "a first promotion", running=first)
    first.kill()
    tunepod.run("rerun")
    assert_paused_and_promoted_once_each(study)
