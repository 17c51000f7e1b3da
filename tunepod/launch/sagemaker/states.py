"""What DescribeTrainingJob says about a training job, and how tunepod reads it (pure).

A job's state is its ``TrainingJobStatus`` and, while InProgress, its ``SecondaryStatus``; a script
error's exit code is only in the ``FailureReason`` text. ``Uploading`` means the training is complete
(the script exited 0; SageMaker uploads the model): a job stopped after it got there ends ``Stopped``
although its training finished by itself, which ``SecondaryStatusTransitions`` tells.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tunepod.launch.job_state import JobState, warn_unknown_state

logger = logging.getLogger(__name__)

NOT_FOUND = "NotFound"
"""Not a SageMaker status: tunepod's, for a job DescribeTrainingJob does not know (it will never run)."""

# TrainingJobStatus -> JobState, for every status but InProgress (decided by SecondaryStatus).
TRAINING_JOB_STATES: Mapping[str, JobState] = {
    "Completed": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
    # StopTrainingJob was called; SageMaker is still shutting the instances down (and uploading the
    # output): not over yet, so that cancel() returns only once nothing of the job is left.
    "Stopping": JobState.RUNNING,
    "Stopped": JobState.CANCELLED,
    NOT_FOUND: JobState.FAILED,
}

# SecondaryStatus of an InProgress job -> JobState: the script runs only in Training (and the upload
# after it); everything before is provisioning.
IN_PROGRESS_SECONDARY_STATES: Mapping[str, JobState] = {
    "Starting": JobState.PENDING,
    "Pending": JobState.PENDING,
    "LaunchingMLInstances": JobState.PENDING,
    "PreparingTrainingStack": JobState.PENDING,
    "Downloading": JobState.PENDING,
    "DownloadingTrainingImage": JobState.PENDING,
    # Managed spot capacity was taken back; the job waits for capacity and resumes from checkpoints.
    "Interrupted": JobState.PENDING,
    # RetryStrategy is starting the job again after an internal error.
    "Restarting": JobState.PENDING,
    "Training": JobState.RUNNING,
    "Uploading": JobState.RUNNING,
    "Updating": JobState.RUNNING,
}

# A Stopped job stopped by SageMaker itself at a limit failed; tunepod's own stops are cancellations.
_LIMIT_SECONDARY_STATES = frozenset({"MaxRuntimeExceeded", "MaxWaitTimeExceeded"})

# A script error's FailureReason: "AlgorithmError: ExecuteUserScriptError:\nExitCode 1\nErrorMessage
# ...\nCommand ..., exit code: 1" (the sagemaker-training toolkit's ExecuteUserScriptError).
_EXIT_CODE = re.compile(r"exit\s*code\s*:?\s*(-?\d+)", re.IGNORECASE)


def map_training_job_state(status: str, secondary_status: str = "", *, trained: bool = False) -> JobState:
    """DescribeTrainingJob's ``TrainingJobStatus`` and ``SecondaryStatus`` -> ``JobState``; ``trained``:
    the job's training completed by itself before any stop (see ``trained_before_stop``).

    A Stopped job that had ``trained`` SUCCEEDED: the stop (tunepod's, or a limit's) reached it only
    while its output was uploaded, after its script had exited 0, so it stopped no training. An
    unknown status (a newer API) is logged once and read as RUNNING, so the job is followed until a
    known state (or the caller's timeout) ends it.
    """
    if status == "Stopped" and trained:
        return JobState.SUCCEEDED
    if status == "InProgress":
        mapped = IN_PROGRESS_SECONDARY_STATES.get(secondary_status)
        if mapped is None:
            warn_unknown_state("SageMaker training job", f"InProgress/{secondary_status}", JobState.RUNNING)
            return JobState.RUNNING
        return mapped
    if status == "Stopped" and secondary_status in _LIMIT_SECONDARY_STATES:
        return JobState.FAILED
    mapped = TRAINING_JOB_STATES.get(status)
    if mapped is None:
        warn_unknown_state("SageMaker training job", status, JobState.RUNNING)
        return JobState.RUNNING
    return mapped


def trained_before_stop(transitions: Iterable[Mapping[str, Any]]) -> bool:
    """Whether ``SecondaryStatusTransitions`` reached ``Uploading`` (the training is complete) before any
    ``Stopping``: an upload after a stop is the SIGTERM'd script's, which did not finish by itself."""
    for transition in transitions:
        status = transition.get("Status")
        if status == "Stopping":
            return False
        if status == "Uploading":
            return True
    return False


def exit_code_of(failure_reason: str) -> int | None:
    """The exit code in a FailureReason (``... ExitCode 1 ...``, ``exit code: 1``), or None."""
    match = _EXIT_CODE.search(failure_reason)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class TrainingJobStatus:
    """What DescribeTrainingJob says about one job (``NOT_FOUND`` when it knows no such job)."""

    status: str
    secondary_status: str = ""
    failure_reason: str = ""
    trained: bool = False
    """Its training completed by itself before any stop (``trained_before_stop``)."""

    @classmethod
    def from_describe(cls, response: Mapping[str, Any]) -> TrainingJobStatus:
        return cls(
            status=str(response.get("TrainingJobStatus", "")),
            secondary_status=str(response.get("SecondaryStatus", "")),
            failure_reason=str(response.get("FailureReason", "")),
            trained=trained_before_stop(response.get("SecondaryStatusTransitions") or []),
        )

    @classmethod
    def not_found(cls, job_id: str) -> TrainingJobStatus:
        return cls(
            NOT_FOUND,
            failure_reason=(
                f"SageMaker knows no training job {job_id} in this account and region; fix: check the "
                "launcher's region (and AWS_PROFILE), or the job id"
            ),
        )

    @property
    def job_state(self) -> JobState:
        return map_training_job_state(self.status, self.secondary_status, trained=self.trained)

    @property
    def exit_code(self) -> int | None:
        """The script's exit code when the FailureReason names one (a script error), else None."""
        return exit_code_of(self.failure_reason)

    @property
    def one_line_reason(self) -> str:
        # SageMaker's reasons for a script error span several lines.
        return " ".join(self.failure_reason.split())

    def reason_line(self) -> str | None:
        """The reason as a line of ``logs()``: SageMaker's FailureReason, or why there is no job."""
        if self.status == NOT_FOUND:
            return f"({self.one_line_reason})"
        return f"FailureReason: {self.one_line_reason}" if self.failure_reason else None

    def describe(self, job_id: str) -> str:
        """One line: ``sagemaker training job x Failed (exit code 1; Failed: AlgorithmError: ...)``."""
        details = [part for part in (self.secondary_status, self.one_line_reason) if part]
        code = "" if self.exit_code is None else f"exit code {self.exit_code}; "
        suffix = f" ({code}{': '.join(details)})" if details else ""
        return f"sagemaker training job {job_id} {self.status}{suffix}"
