"""One task per pipeline step, one per tuning trial."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from tasks.retry import transient_only
from tunepod.hpo.tuner import Tuner
from tunepod.outputs import StepOutput, TrialRecord
from tunepod.pipeline import PipelineRun
from tunepod.steps import STEP_KINDS

RETRIES = 2


@task(cache_policy=NO_CACHE, retries=RETRIES, retry_delay_seconds=5, retry_condition_fn=transient_only)
def run_step(run: PipelineRun, name: str, inputs: Mapping[str, StepOutput]) -> StepOutput:
    return run.run_step(name, inputs, submit_trial=submit_trial)


def step_retries(uses: str) -> int:
    """Retries for a step of kind ``uses``: only a kind that is idempotent may run twice."""
    return RETRIES if STEP_KINDS[uses].idempotent else 0


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=transient_only)
def run_trial(tuner: Tuner, number: int) -> TrialRecord:
    # Idempotent: a retry re-attaches to the job the first attempt started.
    return tuner.run_trial(number)


def submit_trial(tuner: Tuner, number: int) -> Future[TrialRecord]:
    """Run one trial as its own task run, named after its step and number (two tune steps of one
    flow each have a trial 0), and hand back a plain future."""
    name = f"{tuner.step}/trial-{number}"
    prefect_future = run_trial.with_options(name=name, task_run_name=name).submit(tuner, number)
    future: Future[TrialRecord] = Future()

    def settle(done: PrefectFuture[TrialRecord]) -> None:
        try:
            future.set_result(done.result())
        except BaseException as exc:
            future.set_exception(exc)

    prefect_future.add_done_callback(settle)
    return future
