"""What a study publishes stays bounded at any size: Prefect refuses an event past 1.5 MB, and a
table artifact's event carries the table. The summary and the live table show a bounded number of
trials; every trial goes to MLflow as one table."""

from __future__ import annotations

import json

from tunepod.outputs import Dataset, TrialOutcome, TrialRecord, TrialSet
from tunepod.pipeline import SUMMARY_ROWS, LiveTable, PipelineSummary, TrialRow, shown_trials
from tunepod.steps.tune import trial_columns

NUM_TRIALS = 5_000
# Prefect's PREFECT_EVENTS_MAXIMUM_SIZE_BYTES is 1.5 MB; a table stays far below it.
TABLE_BYTES = 100_000


def record(number: int, outcome: TrialOutcome = "COMPLETE") -> TrialRecord:
    value = (number * 7919 % NUM_TRIALS) / NUM_TRIALS if outcome == "COMPLETE" else None
    return TrialRecord(
        number=number,
        outcome=outcome,
        params={"lr": 10 ** -(number % 5), "optimizer": "adam" if number % 2 else "sgd", "epochs": 12},
        value=value,
        values={"score": value} if value is not None else {},
        run_id=f"{number:032x}",
        job_dir=f"/jobs/trial-{number}",
        checkpoint_dir=f"/jobs/trial-{number}/checkpoints",
    )


def study(num_trials: int) -> TrialSet:
    dataset = Dataset(source="s", path="/d", num_files=0, num_bytes=0, copied_files=0, copied_bytes=0)
    trials = [record(n, "PRUNED" if n % 3 == 0 else "COMPLETE") for n in range(num_trials)]
    return TrialSet(
        step="search", study="s", metric="score", direction="maximize", dataset=dataset, trials=trials
    )


def summary_of(trials: TrialSet) -> PipelineSummary:
    return PipelineSummary(
        pipeline="p",
        run_id="r",
        tracking_uri="sqlite:///m.db",
        experiment_id="1",
        mlflow_ui_command="",
        run_url="http://mlflow/r",
        trials=[TrialRow.of(t) for t in shown_trials(trials)],
        num_trials=len(trials.trials),
        metric="score",
    )


def test_the_summary_of_a_large_study_shows_its_best_trials_in_a_bounded_table() -> None:
    trials = study(NUM_TRIALS)
    summary = summary_of(trials)
    rows = [row.table_row([]) for row in summary.trials]
    assert len(rows) == SUMMARY_ROWS
    assert [r["trial"] for r in rows] == [t.number for t in trials.best(SUMMARY_ROWS)]
    assert len(json.dumps(rows)) < TABLE_BYTES
    left_out = summary.trials_left_out()
    assert left_out is not None and f"{NUM_TRIALS:,}" in left_out and "trials.json" in left_out


def test_a_small_study_shows_every_trial_in_order() -> None:
    trials = study(SUMMARY_ROWS)
    summary = summary_of(trials)
    assert [row.number for row in summary.trials] == list(range(SUMMARY_ROWS))
    assert summary.trials_left_out() is None


def test_the_live_table_keeps_the_latest_trials_and_counts_every_finished_one() -> None:
    table = LiveTable(SUMMARY_ROWS)
    table.put(0, {"trial": 0, "outcome": "PAUSED"}, finished=False)
    outcomes = ["COMPLETE", "PRUNED", "FAIL", "ERROR"]
    for number in range(1, NUM_TRIALS):
        outcome = outcomes[number % 4]
        table.put(number, {"trial": number, "outcome": outcome}, finished=outcome != "ERROR")
    table.put(0, {"trial": 0, "outcome": "PRUNED"}, finished=True)  # the paused trial, pruned at the end
    table.put(0, {"trial": 0, "outcome": "PRUNED"}, finished=True)  # told twice, counted once
    walked = 1 + sum(outcomes[n % 4] != "ERROR" for n in range(1, NUM_TRIALS))
    assert table.num_finished == walked
    assert table.num_seen == NUM_TRIALS
    rows = table.rows()
    assert [r["trial"] for r in rows] == [0, *range(NUM_TRIALS - SUMMARY_ROWS + 1, NUM_TRIALS)]
    assert len(json.dumps(rows)) < TABLE_BYTES


def test_every_trial_goes_to_mlflow_as_one_table() -> None:
    trials = study(NUM_TRIALS)
    columns = trial_columns(trials)
    assert set(columns) == {
        "trial",
        "outcome",
        "score",
        "params.lr",
        "params.optimizer",
        "params.epochs",
        "run_id",
    }
    assert all(len(column) == NUM_TRIALS for column in columns.values())
    assert columns["score"][0] is None and columns["score"][1] == trials.trials[1].value
