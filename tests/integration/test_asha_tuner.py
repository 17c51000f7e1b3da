"""ASHA with pause and promote against real components: the quadratic trainer's jobs on the local
launcher, a journal Optuna storage, an MLflow SQLite store (``tests/e2e/test_asha_run.py`` runs ASHA
through `tunepod run` on the local launcher and the Slurm cluster, and SIGKILLs it at a pause).

Proves: a trial paused at a rung (its job stopped after its checkpoint, the Optuna trial left
RUNNING) and promoted later resumes from that checkpoint on a new job, in the same job dir and the
same MLflow run, whose history is continuous; trials the rule never promotes end PRUNED once nothing
else runs; every trial ends once, and no job is left behind.
"""

from __future__ import annotations

from pathlib import Path

import optuna
from mlflow import MlflowClient
from test_tuner import assert_no_job_left, child_runs, make_tuner, run_together, settings, starts, stops

from tunepod.hpo.asha import AshaState
from tunepod.hpo.tuner import ReportFeed
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_cancel_marker, read_submission
from tunepod.runtime import Report, read_reports

EPOCHS = 9
# One rung, at 3 units (step 2): a trial that gets past it trains to its end, step 8.
ASHA = {"kind": "asha", "min_resource": 3, "reduction_factor": 3, "max_resource": EPOCHS}
# One at a time, so the order in which trials reach the rung is fixed. The best (0.3) leads the rung
# alone and goes on; the second best (0.4) is paused behind it, and promoted once six trials have
# reached the rung (the top two of six go on); the rest are paused and never promoted.
BEST, SECOND = 0.3, 0.4
XS = (BEST, SECOND, 0.9, 0.1, 1.0, 0.0)


def test_a_paused_trial_is_promoted_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    tune = settings(
        tmp_path,
        # A long grace: every pause lands at the trainer's should_stop() (it saves there), even on a
        # loaded machine where an epoch's checkpoint can take seconds.
        train={"args": {"epochs": EPOCHS, "sleep_s": 0.2}, "resources": {"stop_grace_s": 60}},
        num_trials=len(XS),
        num_parallel=1,
        pruner=ASHA,
        space={"x": {"type": "categorical", "choices": sorted(set(XS))}},
    )
    tuner = make_tuner(tmp_path, tune)
    for x in XS:
        tuner.study.enqueue_trial({"x": x})
    trials = {t.number: t for t in tuner.run().trials}

    frozen = {t.number: t for t in tuner.study.get_trials()}
    assert all(t.state.is_finished() for t in frozen.values()), {n: t.state for n, t in frozen.items()}
    assert AshaState.of(frozen[0]) is None and starts(trials[0].job_dir) == 1  # the leader never paused
    promoted = trials[XS.index(SECOND)]
    assert promoted.outcome == "COMPLETE" and promoted.last_step == EPOCHS - 1, promoted
    state = AshaState.of(frozen[promoted.number])
    assert state is not None and state.promotions == 1 and not state.paused, state

    # Its job dir: stopped once at the pause (saving the epoch it finished), started again, and the
    # second start resumed after that epoch instead of training from scratch.
    assert len(stops(promoted.job_dir)) == 1 and starts(promoted.job_dir) == 2
    record = read_submission(JobPaths(Path(promoted.job_dir)))
    assert record is not None and record.attempt == 2
    steps = [r.step for r in read_reports(JobPaths(Path(promoted.job_dir)).metrics)]
    assert steps == list(range(EPOCHS)), steps  # each epoch trained once, across the pause

    # One MLflow run for the trial, with the whole curve.
    children = child_runs(tmp_path, tuner.ctx.parent_run_id)
    runs = [r for r in children if r.data.tags["tunepod.trial"] == str(promoted.number)]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["tunepod.promotions"] == str(state.promotions)
    history = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(runs[0].info.run_id, "score")
    assert sorted(m.step for m in history) == list(range(EPOCHS))

    # The worst trials were paused at a rung and never promoted: PRUNED, their jobs stopped as paused.
    pruned = [t for t in trials.values() if t.outcome == "PRUNED"]
    assert pruned, {n: (t.params, t.outcome) for n, t in trials.items()}
    for trial in pruned:
        marker = read_cancel_marker(JobPaths(Path(trial.job_dir)))
        assert marker is not None and marker.reason == "paused"
        assert not Path(trial.job_dir, "result.json").exists()
        assert frozen[trial.number].state is optuna.trial.TrialState.PRUNED
    assert {float(t.params["x"]) for t in pruned} == set(XS) - {BEST, SECOND}
    assert_no_job_left(list(trials.values()), "local")


def test_two_orchestrators_prune_the_paused_trials_one_would(tmp_path: Path) -> None:
    """Two orchestrators on one study, with one's slots: ASHA still ends the trials it never promoted
    PRUNED. Each orchestrator that follows the other's trials looks at the study every second, also
    while its own just-paused trial's driver is still returning; such a trial once counted as the
    study's own work in flight, and each idle slot then resumed another paused trial, until every
    trial had trained to its end and ASHA saved nothing."""
    tune = settings(
        tmp_path,
        train={"args": {"epochs": EPOCHS, "sleep_s": 0.2}, "resources": {"stop_grace_s": 60}},
        num_trials=len(XS),
        num_parallel=2,
        pruner=ASHA,
        space={"x": {"type": "categorical", "choices": sorted(set(XS))}},
    )
    first, second = make_tuner(tmp_path, tune), make_tuner(tmp_path, tune)
    for x in XS:
        first.study.enqueue_trial({"x": x})
    run_together(first, second)

    frozen = first.study.get_trials()
    assert all(t.state.is_finished() for t in frozen), {t.number: t.state for t in frozen}
    never_resumed = [
        t.number
        for t in frozen
        if t.state is optuna.trial.TrialState.PRUNED and starts(first.ctx.jobs_dir / f"trial-{t.number}") == 1
    ]
    # Six trials at one rung keep two (and a leader while fewer than three were there): at least two
    # are paused for good, as under one orchestrator.
    assert len(never_resumed) >= 2, {t.number: (t.state, AshaState.of(t)) for t in frozen}


def test_a_rung_past_step_1000_is_judged_on_the_value_optuna_holds_there(tmp_path: Path) -> None:
    """Past step 1,000 Optuna is told every 10th step. A batch of reports that reaches a rung (2,997
    units: step 2,996) with its last told step before it (2,990) does not judge the rung yet: the
    trial has no value there, and would be paused as though outside the top, the only trial of its
    study. The next told step (3,000) judges it, on its own value."""
    tune = settings(
        tmp_path,
        num_trials=1,
        num_parallel=1,
        pruner={"kind": "asha", "min_resource": 37, "reduction_factor": 3, "max_resource": 9000},
    )
    tuner = make_tuner(tmp_path, tune)
    number = tuner.study.ask().number
    frozen = tuner.trials.frozen(number)
    feed = ReportFeed(tuner, frozen, tuner._mirror(frozen, {}, {}))

    def reports(steps: range) -> list[Report]:
        return [Report(step, {"score": 1.0 / (step + 1)}, 0.0) for step in steps]

    assert feed(reports(range(2985))) is None  # every rung below 2,997 units: alone, in the top
    assert feed(reports(range(2985, 3000))) is None, "judged at rung 2,997 before Optuna held a value there"
    assert feed(reports(range(3000, 3001))) is None
    assert 3000 in tuner.trials.frozen(number).intermediate_values
