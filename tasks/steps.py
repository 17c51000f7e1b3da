"""One task per pipeline step, one per tuning trial; a tune step's progress shows while it runs."""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TypeVar, cast
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_link_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.futures import PrefectFuture
from prefect.runtime import task_run
from prefect.states import Completed
from prefect.transactions import Transaction

from tasks.retry import transient_only
from tunepod.hpo.endings import ENDING_NAMES
from tunepod.hpo.tuner import TrialLinks, Tuner
from tunepod.outputs import StepOutput, TrialRecord
from tunepod.pipeline import SUMMARY_ROWS, LiveTable, PipelineRun, TrialRow
from tunepod.steps import STEP_KINDS

RETRIES = 2
FINISHED = ("COMPLETE", "PRUNED", "FAIL")
#: The live trial table is written again at most this often (and when the last trial finishes), and
#: holds the latest ``SUMMARY_ROWS`` trials to end: a study of any size sends tables of bounded size.
TABLE_EVERY_S = 5.0

log = logging.getLogger(__name__)
T = TypeVar("T")


@task(cache_policy=NO_CACHE, retries=RETRIES, retry_delay_seconds=5, retry_condition_fn=transient_only)
def run_step(run: PipelineRun, name: str, inputs: Mapping[str, StepOutput]) -> StepOutput:
    return run.run_step(name, inputs, submit_trial=submit_trial)


def step_retries(uses: str) -> int:
    """Retries for a step of kind ``uses``: only a kind that is idempotent may run twice."""
    return RETRIES if STEP_KINDS[uses].idempotent else 0


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=transient_only)
def run_trial(tuner: Tuner, number: int) -> State[TrialRecord]:
    # Idempotent: a retry re-attaches to the job the first attempt started.
    record = tuner.run_trial(number, _links(tuner))
    # Named for how the trial ended (Pruned, Paused, Exploited ...), never a bare "Completed", with why
    # and at which step as its message: what the Prefect UI and the "Finished in state" line show.
    return Completed(data=record, name=ENDING_NAMES[record.ending or record.outcome], message=record.why)


def _links(tuner: Tuner) -> TrialLinks:
    """The trial's MLflow run carries this task run's id and URL; this task run links the MLflow run."""
    ui_url = task_run.ui_url
    tags = {"prefect.task_run_id": str(task_run.id), **({"prefect.task_run_url": ui_url} if ui_url else {})}

    def link(run_id: str) -> None:
        create_link_artifact(
            tuner.run_url(run_id), link_text=f"MLflow run {run_id}", description="The trial in MLflow"
        )

    return TrialLinks(tags=tags, on_run=link)


#: The board of each tune step's tuner, made when its first trial is submitted.
_boards: weakref.WeakKeyDictionary[Tuner, TrialBoard] = weakref.WeakKeyDictionary()
_boards_lock = threading.Lock()


def submit_trial(tuner: Tuner, number: int) -> Future[TrialRecord]:
    """Run one trial as its own task run, named after its step and number (two tune steps of one
    flow each have a trial 0), and hand back a plain future; the step's board shows it finish."""
    with _boards_lock:  # two tune steps may run at once
        board = _boards.get(tuner)
        if board is None:
            board = _boards[tuner] = TrialBoard(tuner)
    name = f"{tuner.step}/trial-{number}"
    # The task ends in a named state holding the record: the future's result is the record itself.
    prefect_future = cast(
        "PrefectFuture[TrialRecord]",
        _outside_the_step_transaction(
            lambda: run_trial.with_options(name=name, task_run_name=name).submit(tuner, number)
        ),
    )
    future: Future[TrialRecord] = Future()

    def settle(done: PrefectFuture[TrialRecord]) -> None:
        # The tuner first (its freed slot starts the next trial), then the board's API calls.
        try:
            record = done.result()
        except BaseException as exc:
            future.set_exception(exc)
            board.failed(number, exc)
        else:
            future.set_result(record)
            board.finished(record)

    prefect_future.add_done_callback(settle)
    return future


def _outside_the_step_transaction(submit: Callable[[], T]) -> T:
    """``submit`` a trial's task run with no transaction around it. Submitted from inside the step's
    task run, it would open its transaction as a child of the step's, which keeps every child (and,
    through its hooks, the child's whole task engine: its task run, events and result) until the
    step ends: tens of KB per trial, for a study of any size. A trial's task run persists no result
    and has no commit or rollback hooks, so nothing is lost when it commits on its own at its end."""
    context = contextvars.copy_context()

    def detached() -> T:
        Transaction.__var__.set(None)  # type: ignore[arg-type]  # Prefect's own "no transaction"
        return submit()

    return context.run(detached)


class TrialBoard:
    """A tune step's live view in Prefect: a progress artifact (finished trials of ``num_trials``)
    and a table of the latest trials to end, both on the step's task run, updated as each trial
    finishes or fails (so a run that fails still shows how far it got). Made in the step's task (its
    run context is kept for the updates, which come from Prefect's future callbacks); a failed
    update is logged and never fails the study. Each update costs the same at any size of study
    (``LiveTable``)."""

    def __init__(self, tuner: Tuner) -> None:
        self._step = tuner.step
        self._key = re.sub(r"[^a-z0-9-]+", "-", tuner.step.lower())
        self._num_trials = tuner.settings.num_trials
        trials = tuner.trial_set()
        self._objectives = [goal.metric for goal in trials.objectives]
        self._table = LiveTable(SUMMARY_ROWS)
        for record in trials.trials:
            self._table.put(record.number, self._row(record), finished=record.outcome in FINISHED)
        self._lock = threading.Lock()
        self._table_at = 0.0
        self._context = contextvars.copy_context()
        created = self._safely(
            lambda: create_progress_artifact(
                self._percent(),
                key=f"{self._key}-progress",
                description=f"Finished trials of step {self._step}",
            )
        )
        self._progress = created if isinstance(created, UUID) else None  # sync: a UUID

    def finished(self, record: TrialRecord) -> None:
        self._update(record.number, self._row(record), finished=record.outcome in FINISHED)

    def _row(self, record: TrialRecord) -> dict[str, object]:
        # The front is the study's, known at its end: the final table marks it, this one cannot.
        return TrialRow.of(record).table_row(self._objectives)

    def failed(self, number: int, error: BaseException) -> None:
        self._update(number, {"trial": number, "outcome": "ERROR", "error": str(error)[:200]}, finished=False)

    def _update(self, number: int, row: dict[str, object], *, finished: bool) -> None:
        with self._lock:
            self._table.put(number, row, finished=finished)
            if self._progress is not None:
                progress = self._progress
                self._safely(lambda: update_progress_artifact(progress, self._percent()))
            done = self._percent() >= 100.0
            if done or time.monotonic() - self._table_at >= TABLE_EVERY_S:
                self._table_at = time.monotonic()
                rows = self._table.rows()
                self._safely(
                    lambda: create_table_artifact(
                        rows, key=f"{self._key}-trials", description=self._table_description()
                    )
                )

    def _table_description(self) -> str:
        if self._table.num_rows >= self._table.num_seen:
            return f"Trials of step {self._step}, so far"
        return (
            f"The latest {self._table.num_rows} trials of step {self._step} to end, of "
            f"{self._table.num_seen:,} so far; every trial is in MLflow (a run per trial)"
        )

    def _percent(self) -> float:
        return min(100.0, 100.0 * self._table.num_finished / self._num_trials)

    def _safely(self, call: Callable[[], T]) -> T | None:
        """``call()`` in the step task's run context; None (and a warning) if Prefect refused it."""
        try:
            return self._context.copy().run(call)
        except Exception as exc:
            log.warning("step %s: live progress not updated in Prefect: %s", self._step, exc)
            return None
