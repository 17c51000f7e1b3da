"""The SageMaker launcher: jobs as SageMaker training jobs, created and followed with boto3.

``render`` (the pure CreateTrainingJob request), ``states`` (what DescribeTrainingJob's statuses mean),
``logs`` (CloudWatch), ``clients`` (boto3 and its errors), ``launcher`` (the ``LauncherBase`` hooks).
"""

from tunepod.launch.sagemaker.clients import INSTALL_HINT, aws_client, sagemaker_client
from tunepod.launch.sagemaker.launcher import SageMakerJob, SageMakerLauncher
from tunepod.launch.sagemaker.logs import LOG_GROUP, CloudWatchLogReader, log_hint
from tunepod.launch.sagemaker.render import (
    REQUEST_FILE,
    checkpoint_s3_uri,
    render_training_job,
    training_job_name,
)
from tunepod.launch.sagemaker.states import (
    IN_PROGRESS_SECONDARY_STATES,
    NOT_FOUND,
    TRAINING_JOB_STATES,
    TrainingJobStatus,
    exit_code_of,
    map_training_job_state,
)

__all__ = [
    "INSTALL_HINT",
    "IN_PROGRESS_SECONDARY_STATES",
    "LOG_GROUP",
    "NOT_FOUND",
    "REQUEST_FILE",
    "TRAINING_JOB_STATES",
    "CloudWatchLogReader",
    "SageMakerJob",
    "SageMakerLauncher",
    "TrainingJobStatus",
    "aws_client",
    "checkpoint_s3_uri",
    "exit_code_of",
    "log_hint",
    "map_training_job_state",
    "render_training_job",
    "sagemaker_client",
    "training_job_name",
]
