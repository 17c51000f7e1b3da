"""The tuning loop: keep ``num_parallel`` training jobs in flight, prune the bad ones, tell Optuna.

Trial identity is stable: study + trial number -> one job name, one job directory (with its
checkpoints), one MLflow child run. The backend job id, the job directory and the run id are kept in
the Optuna trial's user attrs, so any later process can find the job again. Optuna's heartbeat does
not work with ask/tell, so a rerun reconciles every RUNNING trial against its real job instead.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from tunepod.errors import JobError, TunepodError
from tunepod.hpo.study import distributions, open_study
from tunepod.launch.base import JobHandle, JobSpec, JobState, Launcher
from tunepod.launch.contract import contract_env
from tunepod.launch.paths import JobPaths
from tunepod.launch.watch import failure_message, watch
from tunepod.metrics import default_metrics
from tunepod.outputs import Dataset, TrialOutcome, TrialRecord, TrialSet
from tunepod.runtime import Report, latest_checkpoint, read_result, valid_checkpoints
from tunepod.spec.models import TuneSettings
from tunepod.tracking import MlflowTracker

log = logging.getLogger(__name__)

# Keys of the per-trial user attrs; they are the contract between runs of the orchestrator.
ATTR_JOB_DIR = "tunepod_job_dir"
ATTR_JOB_ID = "tunepod_job_id"
ATTR_RUN_ID = "tunepod_mlflow_run_id"
ATTR_ERROR = "tunepod_error"
ATTR_MODEL_ID = "tunepod_model_id"
ATTR_RESTARTS = "tunepod_restarts"

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
OUTCOME = {TrialState.COMPLETE: "COMPLETE", TrialState.PRUNED: "PRUNED", TrialState.FAIL: "FAIL"}

# Runs one trial to its end, somewhere (a thread, a Prefect task run), and hands back a future.
TrialSubmitter = Callable[["Tuner", int], "Future[TrialRecord]"]


@dataclass(frozen=True)
class TuneContext:
    """Everything a tune step needs from the pipeline around it."""

    step: str
    settings: TuneSettings
    launcher: Launcher
    dataset: Dataset
    jobs_dir: Path
    tracker: MlflowTracker
    parent_run_id: str
    pipeline: str


class Tuner:
    """Drives one study. ``run`` is called once; ``run_trial`` from any number of threads."""

    def __init__(self, ctx: TuneContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.study = open_study(ctx.settings)
        self._distributions = distributions(ctx.settings.space)
        self._metrics = default_metrics().trial_observer(
            pipeline=ctx.pipeline, study=ctx.settings.study.name, step=ctx.step
        )

    # ------------------------------------------------------------------------------------ the loop

    def run(self, submit: TrialSubmitter | None = None) -> TrialSet:
        """Bring the study to ``num_trials`` finished trials, ``num_parallel`` at a time."""
        finished = len(self.study.get_trials(deepcopy=False, states=FINISHED))
        orphans = [t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        to_ask = max(0, self.settings.num_trials - finished - len(orphans))
        self._metrics.count_trials(self.study)
        if orphans:
            log.warning("study %s: re-attaching to unfinished trials %s", self.settings.study.name, orphans)
        with ThreadPoolExecutor(self.settings.num_parallel + len(orphans), "trial") as pool:
            submit = submit or (lambda tuner, number: pool.submit(tuner.run_trial, number))
            in_flight = {submit(self, number): number for number in orphans}
            while in_flight or to_ask:
                while to_ask and len(in_flight) < self.settings.num_parallel:
                    number = self._ask()
                    in_flight[submit(self, number)] = number
                    to_ask -= 1
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    number = in_flight.pop(future)
                    if (exc := future.exception()) is not None:
                        self._abandon(number, exc)
        return self.trial_set()

    def _ask(self) -> int:
        trial = self.study.ask(self._distributions)
        job_dir = self.ctx.jobs_dir / f"trial-{trial.number}"
        _set_aside_stale(job_dir)
        trial.set_user_attr(ATTR_JOB_DIR, str(job_dir))
        self._metrics.count_trials(self.study)
        return trial.number

    def _abandon(self, number: int, exc: BaseException) -> None:
        """The trial's driver crashed (not the job): stop its job and record the trial as failed."""
        log.error("trial %d: orchestration failed: %s", number, exc)
        frozen = self._frozen(number)
        job_id = frozen.user_attrs.get(ATTR_JOB_ID)
        if job_id:
            try:
                self.ctx.launcher.attach(job_id, Path(frozen.user_attrs[ATTR_JOB_DIR])).cancel()
            except TunepodError as cancel_error:
                log.warning("trial %d: could not cancel job %s: %s", number, job_id, cancel_error)
        message = f"trial {number}: the orchestrator failed while driving it: {exc!r}"
        self._fail(number, frozen.user_attrs.get(ATTR_RUN_ID), message)

    # ------------------------------------------------------------------------------------ one trial

    def run_trial(self, number: int) -> TrialRecord:
        """Drive trial ``number`` to a final state and return its record. Idempotent: a retry
        re-attaches to the job it started instead of starting another one."""
        frozen = self._frozen(number)
        if frozen.state in FINISHED:
            return self._record(frozen)
        params = {**self.settings.train.args, **frozen.params}
        run_id = self._trial_run(frozen, params)
        handle = self._job(frozen, params, run_id)
        optuna_trial = optuna.trial.Trial(self.study, frozen._trial_id)
        metric = self.settings.study.metric

        def on_reports(reports: list[Report]) -> bool:
            self.ctx.tracker.log_reports(run_id, reports)
            for report in reports:
                value = report.metrics.get(metric)
                if value is not None:
                    optuna_trial.report(value, report.step)
            return self.settings.pruner.kind != "none" and optuna_trial.should_prune()

        last = max(frozen.intermediate_values, default=None)
        while True:
            result = watch(
                handle,
                poll_s=self.settings.poll_s,
                on_reports=on_reports,
                after_step=last,
                timeout_s=_timeout_s(self.settings.train.resources.timeout_min),
            )
            last = result.last_step
            if result.state is not JobState.FAILED or result.timed_out or not self._may_restart(number):
                break
            # The job died (a killed process, a lost node): start it again in the same job dir, where
            # the training script resumes from its last checkpoint.
            handle = self._resubmit(number, params, run_id)
        if result.stopped:
            return self._prune(number, run_id, result.last_step, handle.job_dir)
        if result.state is JobState.SUCCEEDED:
            return self._complete(number, run_id, handle, params)
        what = f"Trial {number} of study {self.settings.study.name}"
        if result.timed_out:
            what += f" (timed out after {self.settings.train.resources.timeout_min} min)"
        return self._fail(
            number, run_id, failure_message(what, handle, result.state, kind=self.ctx.launcher.kind)
        )

    def _may_restart(self, number: int) -> bool:
        """Count one restart of the trial's job against ``train.max_restarts``; False when used up."""
        frozen = self._frozen(number)
        restarts = int(frozen.user_attrs.get(ATTR_RESTARTS, 0))
        if restarts >= self.settings.train.max_restarts:
            return False
        self.study._storage.set_trial_user_attr(frozen._trial_id, ATTR_RESTARTS, restarts + 1)
        log.warning(
            "trial %d: job failed; restart %d of %d", number, restarts + 1, self.settings.train.max_restarts
        )
        return True

    def _resubmit(self, number: int, params: dict[str, object], run_id: str) -> JobHandle:
        frozen = self._frozen(number)
        job_dir = Path(frozen.user_attrs[ATTR_JOB_DIR])
        job = self._job_spec(number, job_dir, params, run_id)
        handle = self._metrics.submitted(self.ctx.launcher.submit(job))
        self.study._storage.set_trial_user_attr(frozen._trial_id, ATTR_JOB_ID, handle.job_id)
        self.ctx.tracker.set_tags(
            run_id,
            {"tunepod.job_id": handle.job_id, "tunepod.restarts": frozen.user_attrs.get(ATTR_RESTARTS, 0)},
        )
        return handle

    def _trial_run(self, frozen: FrozenTrial, params: dict[str, object]) -> str:
        run_id = frozen.user_attrs.get(ATTR_RUN_ID)
        if run_id:
            return str(run_id)
        run_id = self.ctx.tracker.start_run(
            f"trial-{frozen.number}",
            parent_run_id=self.ctx.parent_run_id,
            params=params,
            tags={
                "tunepod.trial": str(frozen.number),
                "tunepod.study": self.settings.study.name,
                "tunepod.step": self.ctx.step,
                "tunepod.state": "RUNNING",
                "tunepod.launcher": self.ctx.launcher.kind,
            },
        )
        self.study._storage.set_trial_user_attr(frozen._trial_id, ATTR_RUN_ID, run_id)
        return run_id

    def _job(self, frozen: FrozenTrial, params: dict[str, object], run_id: str) -> JobHandle:
        """The trial's job: the one already running (after a restart or a retry), or a new one that
        resumes from the trial's checkpoints when an earlier job of it vanished."""
        job_dir = Path(frozen.user_attrs[ATTR_JOB_DIR])
        job_id = frozen.user_attrs.get(ATTR_JOB_ID)
        if job_id:
            try:
                handle = self._metrics.attached(self.ctx.launcher.attach(str(job_id), job_dir))
                if handle.state() in (JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED):
                    return handle
                log.warning("trial %d: job %s ended while nobody watched; resuming it", frozen.number, job_id)
            except TunepodError as exc:
                log.warning("trial %d: job %s is gone (%s); resuming it", frozen.number, job_id, exc)
        self.ctx.tracker.set_tags(run_id, {"tunepod.job_dir": str(job_dir)})
        return self._resubmit(frozen.number, params, run_id)

    def _job_spec(self, number: int, job_dir: Path, params: dict[str, object], run_id: str) -> JobSpec:
        paths = JobPaths(job_dir)
        env = contract_env(
            paths,
            params=params,
            data_dir=self.ctx.dataset.path,
            trial=str(number),
            tracking_uri=self.ctx.tracker.tracking_uri,
            run_id=run_id,
        )
        return JobSpec(
            name=f"{self.settings.study.name}-trial-{number}",
            entrypoint=Path(self.settings.train.entrypoint).resolve(),
            job_dir=job_dir,
            env=env,
            resources=self.settings.train.resources,
        )

    # ------------------------------------------------------------------------------------ outcomes

    def _complete(
        self, number: int, run_id: str, handle: JobHandle, params: dict[str, object]
    ) -> TrialRecord:
        metric = self.settings.study.metric
        value = _final_value(handle, metric, self._frozen(number))
        if value is None:
            message = (
                f"Trial {number} finished without reporting {metric!r}; fix: report it with ctx.report(step, "
                f"{metric}=...) or ctx.finish({metric}=...) in {self.settings.train.entrypoint}"
            )
            return self._fail(number, run_id, message)
        # At the trial's last step, so the metric's history has no stray point at step 0.
        last_step = max(self._frozen(number).intermediate_values, default=None)
        self.ctx.tracker.log_metric(run_id, metric, value, step=last_step)
        model_id = self._log_final_checkpoint(number, run_id, handle.job_dir, params)
        if model_id:
            self.study._storage.set_trial_user_attr(self._frozen(number)._trial_id, ATTR_MODEL_ID, model_id)
        self._tell(number, TrialState.COMPLETE, value)
        self._end(run_id, "COMPLETE", "FINISHED", {"tunepod.model_id": model_id or ""}, handle.job_dir)
        return self._record(self._frozen(number))

    def _log_final_checkpoint(
        self, number: int, run_id: str, job_dir: Path, params: dict[str, object]
    ) -> str | None:
        checkpoint = latest_checkpoint(JobPaths(job_dir).checkpoints)
        if checkpoint is None:
            return None
        return self.ctx.tracker.log_checkpoint_model(
            run_id,
            checkpoint.path,
            name=f"{self.settings.study.name}-trial-{number}",
            step=checkpoint.step,
            params=params,
        )

    def _prune(self, number: int, run_id: str, step: int | None, job_dir: Path) -> TrialRecord:
        log.info("trial %d pruned at step %s", number, step)
        self._tell(number, TrialState.PRUNED)
        self._end(run_id, "PRUNED", "KILLED", {"tunepod.pruned_at_step": step}, job_dir)
        return self._record(self._frozen(number))

    def _fail(self, number: int, run_id: str | None, message: str) -> TrialRecord:
        log.error("%s", message)
        trial_id = self._frozen(number)._trial_id
        self.study._storage.set_trial_user_attr(trial_id, ATTR_ERROR, message[-4000:])
        self._tell(number, TrialState.FAIL)
        if run_id:
            self.ctx.tracker.log_text(run_id, message, "error.txt")
            self._end(run_id, "FAIL", "FAILED", {})
        return self._record(self._frozen(number))

    def _tell(self, number: int, state: TrialState, value: float | None = None) -> None:
        self.study.tell(number, value, state=state, skip_if_finished=True)
        frozen = self._frozen(number)
        job_dir = frozen.user_attrs.get(ATTR_JOB_DIR, self.ctx.jobs_dir / f"trial-{number}")
        self._metrics.finished(Path(job_dir), OUTCOME[state])
        self._metrics.count_trials(self.study)

    def _end(
        self, run_id: str, state: str, status: str, tags: dict[str, object], job_dir: Path | None = None
    ) -> None:
        if job_dir is not None:
            # The checkpoints stay on the shared filesystem; the run points at them.
            found = valid_checkpoints(JobPaths(job_dir).checkpoints)
            tags = {**tags, "tunepod.checkpoints": " ".join(c.path.as_uri() for c in found)}
        self.ctx.tracker.set_tags(run_id, {"tunepod.state": state, **tags})
        self.ctx.tracker.end_run(run_id, status)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------ reading

    def _frozen(self, number: int) -> FrozenTrial:
        trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
        return self.study._storage.get_trial(trial_id)

    def _record(self, frozen: FrozenTrial) -> TrialRecord:
        job_dir = Path(frozen.user_attrs.get(ATTR_JOB_DIR, self.ctx.jobs_dir / f"trial-{frozen.number}"))
        value = frozen.value if frozen.state is TrialState.COMPLETE else None
        return TrialRecord(
            number=frozen.number,
            outcome=_outcome(frozen.state),
            params={**self.settings.train.args, **frozen.params},
            value=value,
            last_step=max(frozen.intermediate_values, default=None),
            run_id=frozen.user_attrs.get(ATTR_RUN_ID),
            job_id=frozen.user_attrs.get(ATTR_JOB_ID),
            job_dir=str(job_dir),
            checkpoint_dir=str(JobPaths(job_dir).checkpoints),
            model_id=frozen.user_attrs.get(ATTR_MODEL_ID),
            error=frozen.user_attrs.get(ATTR_ERROR),
        )

    def trial_set(self) -> TrialSet:
        trials = self.study.get_trials(deepcopy=False, states=FINISHED)
        return TrialSet(
            step=self.ctx.step,
            study=self.settings.study.name,
            metric=self.settings.study.metric,
            direction=self.settings.study.direction,
            dataset=self.ctx.dataset,
            trials=[self._record(t) for t in trials],
        )


def _final_value(handle: JobHandle, metric: str, frozen: FrozenTrial) -> float | None:
    """The objective: the metric the job passed to ``finish``, else the last one it reported."""
    result = read_result(JobPaths(handle.job_dir).result)
    if result is not None and metric in result.metrics:
        value = float(result.metrics[metric])
        return value if math.isfinite(value) else None
    if frozen.intermediate_values:
        return float(frozen.intermediate_values[max(frozen.intermediate_values)])
    return None


def _outcome(state: TrialState) -> TrialOutcome:
    return "COMPLETE" if state is TrialState.COMPLETE else "PRUNED" if state is TrialState.PRUNED else "FAIL"


def _timeout_s(timeout_min: float | None) -> float | None:
    return None if timeout_min is None else timeout_min * 60


def _set_aside_stale(job_dir: Path) -> None:
    """A new trial must not resume from checkpoints of a deleted study that had the same name."""
    if job_dir.exists() and any(job_dir.iterdir()):
        stale = job_dir.with_name(f"{job_dir.name}.stale-{int(time.time())}")
        log.warning("moving leftover %s (from an earlier study of the same name) to %s", job_dir, stale)
        shutil.move(job_dir, stale)


def require_completed(trials: TrialSet) -> TrialSet:
    """Fail the tune step when no trial completed, quoting the first failure."""
    if trials.completed():
        return trials
    failures = [t for t in trials.trials if t.outcome == "FAIL"]
    detail = failures[0].error if failures and failures[0].error else "every trial was pruned"
    raise JobError(
        f"study {trials.study}: none of {len(trials.trials)} trials completed. First failure:\n{detail}"
    )
