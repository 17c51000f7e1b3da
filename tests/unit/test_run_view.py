"""``tunepod run``'s view: a line per event off a terminal, a live table on one, told through the
process's watch registry as the pipeline and the tuner tell it."""

from __future__ import annotations

import io
import re

from rich.console import Console

from tunepod import watch
from tunepod.console import RunView
from tunepod.outputs import TrialRecord


def record(
    number: int, outcome: str, *, ending: str | None = None, value: float | None = None, why: str = "w"
) -> TrialRecord:
    return TrialRecord.model_validate(
        {"number": number, "outcome": outcome, "params": {}, "value": value, "job_dir": "/j",
         "checkpoint_dir": "/c", "ending": ending, "why": why}
    )  # fmt: skip


def tell_a_study() -> None:
    """What a pipeline with a stage step and a 6-trial tune step tells, one trial of which an earlier
    run completed and another an earlier run paused (promoted here)."""
    watch.step_started("data", "stage")
    watch.step_ended("data", True)
    watch.step_started("search", "tune")
    watch.study_started(
        watch.StudyStart(
            "search", "digits", 6, "maximize", "val_accuracy", {"COMPLETE": 1, "PAUSED": 1}, (0, 0.9)
        )
    )
    watch.trial_started("search", 1)  # the paused one, promoted
    watch.trial_started("search", 2)
    watch.trial_ended(
        "search", record(2, "PRUNED", ending="PRUNED", why="pruned at step 3 by the asha pruner")
    )
    watch.trial_ended(
        "search", record(1, "COMPLETE", ending="COMPLETE", value=0.95, why="completed at step 9")
    )
    watch.trial_started("search", 3)
    watch.trial_ended("search", record(3, "PAUSED", ending="PAUSED", why="paused at step 2 (rung 0) by ASHA"))
    watch.trial_started("search", 4)
    watch.trial_ended("search", record(4, "PRUNED", ending="EXPLOITED", why="exploited at step 4 by PBT"))


def test_off_a_terminal_each_event_is_a_line_with_the_studys_standing() -> None:
    out = io.StringIO()
    view = RunView(Console(file=out, width=300), live=False)
    with view, watch.watching(view):
        tell_a_study()
    lines = out.getvalue().splitlines()
    assert lines[0] == "step data (stage) started"
    assert re.fullmatch(r"step data \(stage\) done after 00:00", lines[1])
    assert lines[3] == "search: study digits, 6 trials (1 ended in earlier runs), maximize val_accuracy"
    assert lines[4].startswith(
        "search/trial-1 started | 1 running, 1 completed | best 0.9 (trial 0) | 1 of 6"
    )
    pruned, completed = lines[6], lines[7]
    assert pruned.startswith(
        "search/trial-2 Pruned: pruned at step 3 by the asha pruner | 1 running, 1 pruned"
    )
    assert completed.startswith("search/trial-1 Completed: completed at step 9 | 1 pruned, 2 completed")
    assert "| best 0.95 (trial 1) | 3 of 6 ended, 3 left |" in completed
    assert lines[9].startswith("search/trial-3 Paused: paused at step 2 (rung 0) by ASHA | 1 paused,")
    assert "3 of 6 ended, 3 left" in lines[9], "a paused trial may resume: it is not ended"
    assert lines[11].startswith(
        "search/trial-4 Exploited: exploited at step 4 by PBT | 1 paused, 1 pruned, 1 exploited"
    )


def test_on_a_terminal_the_table_shows_each_steps_counts_and_best() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=True, color_system=None)
    view = RunView(console, live=True)
    with view, watch.watching(view):
        tell_a_study()
    table = out.getvalue().split("tunepod run")[-1]  # the last frame drawn
    [search] = [line for line in table.splitlines() if "search" in line]
    cells = [cell.strip() for cell in search.strip("│ ").split("│")]
    # step, kind, state, running, paused, pruned, exploited, completed, failed, best, left, time
    assert cells[:11] == ["search", "tune", "running", "", "1", "1", "1", "2", "", "0.95 (trial 1)", "2"]
    [data] = [line for line in table.splitlines() if "data" in line]
    assert "stage" in data and "done" in data


def test_a_watcher_that_fails_never_fails_the_run() -> None:
    class Broken:
        def __getattr__(self, name: str) -> object:
            def fail(*args: object) -> None:
                raise RuntimeError("broken view")

            return fail

    with watch.watching(Broken()):  # type: ignore[arg-type]
        tell_a_study()


def test_a_steps_long_work_shows_how_far_it_got() -> None:
    """Staging counts bytes and evaluation counts evaluations through ``watch.progress``; the line
    view says so now and then and at the end, the table in the step's state."""
    out = io.StringIO()
    view = RunView(Console(file=out, width=300), live=False)
    with view, watch.watching(view):
        watch.step_started("data", "stage")
        with watch.in_step("data"):
            copied = watch.progress(3_000_000, "bytes")
        for _ in range(3):
            copied(1_000_000)
        watch.step_started("check", "evaluate")
        with watch.in_step("check"):
            evaluated = watch.progress(3, "evaluations")
        evaluated(1)
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"step data: 0% \(0 B of 3 MB\) \| 00:00", lines[1])
    assert re.fullmatch(r"step data: 100% \(3 MB of 3 MB\) \| 00:00", lines[2]), "the end is always said"
    assert len(lines) == 5, lines  # nothing in between: lines come at most every 10 s
    assert lines[4] == "step check: 0 of 3 evaluations | 00:00"
    table = io.StringIO()
    Console(file=table, width=250).print(view)
    assert "running: 1 of 3 evaluations" in table.getvalue()
    assert "running: 100% (3 MB of 3 MB)" in table.getvalue()


def test_outside_a_step_or_unwatched_progress_counts_nothing() -> None:
    assert watch.progress(10, "bytes") is watch.progress(5, "files")


def test_a_steps_counts_are_kept_as_trials_move_and_equal_a_count_of_every_trial() -> None:
    from collections import Counter

    from tunepod.console import _Step

    board = _Step("tune", 0.0)
    endings = ["COMPLETE", "PRUNED", "PAUSED", "FAIL"]
    for number in range(1_000):
        board.put(number, "RUNNING")
        if number >= 10:
            board.put(number - 10, endings[number % 4])
    board.put(2, "RUNNING")  # a paused trial promoted
    assert board.counts() == Counter(board.trials.values())
