"""Every MLflow tag name tunepod writes, defined once. Tests and other tools read them by these names."""

from __future__ import annotations

PREFIX = "tunepod."
PARENT_RUN = "mlflow.parentRunId"
RUN_NAME = "mlflow.runName"

# The pipeline run.
PIPELINE = "tunepod.pipeline"
SPEC = "tunepod.spec"
SPEC_HASH = "tunepod.spec_hash"
OVERRIDES = "tunepod.overrides"
GIT_SHA = "tunepod.git_sha"

# A trial's run, or a train step's run.
KEY = "tunepod.key"
"""Identity of the run (``<study>/trial-<n>``, ``<pipeline>/<step>/<job key>``): looked up before a
run is created, so a lost reply from MLflow never leaves two runs for one trial."""
TRIAL = "tunepod.trial"
STUDY = "tunepod.study"
STEP = "tunepod.step"
STATE = "tunepod.state"
"""RUNNING, then COMPLETE, PRUNED or FAIL."""
LAUNCHER = "tunepod.launcher"
RESERVED = "tunepod.reserved"
"""``true`` on a run made ahead of its trial (``tunepod.tracking.reserve``) until a trial takes it and
names it, then ``false``."""
JOB_ID = "job_id"
JOB_DIR = "job_dir"
ATTEMPT = "attempt"
REFUSED_METRICS = "refused_metrics"
RESTORED_FROM = "restored_from"
RESTORED_STEP = "restored_step"
RESTORES = "restores"
WORLD_SIZE = "world_size"
"""With ``world_size`` (a tag, and a metric of that name at each world's first step), the world
sizes of a job whose group changed: an elastic job re-formed with fewer nodes (``tunepod.runtime.worlds``)."""
"""Suffixes of the job tags, under ``tunepod.`` for the run's own job, under ``tunepod.<step>.`` for a
job that runs in another job's run (an evaluation in its trial's run). ``refused_metrics``: the names
(a JSON list) of the job's metrics MLflow refuses, whose points the mirror set aside. With checkpoint
tiers, ``restored_from`` and ``restored_step``: the tier (``own memory``, ``peer memory``, ``shared
file system``) and step of the job's latest restore; ``restores``: every restore, a JSON list of the
job's restores file (``tunepod.runtime.restores``), oldest first."""
MODEL_ID = "tunepod.model_id"
CHECKPOINTS = "tunepod.checkpoints"
PRUNED_AT_STEP = "tunepod.pruned_at_step"
PROMOTIONS = "tunepod.promotions"  # ASHA: how often the trial was resumed after a pause
PAUSED_AT_RUNG = "tunepod.paused_at_rung"  # ASHA: the rung it was last paused at
# PBT: the trial's member (the number of its lineage's first trial) and generation (0 for the first);
# a continuation's donor trial, the donor's checkpoint step it started from, and the member's trial it
# replaced; on an exploited trial, the trial its member went on in.
PBT_MEMBER = "tunepod.pbt.member"
PBT_GENERATION = "tunepod.pbt.generation"
PBT_PARENT = "tunepod.pbt.parent"
PBT_FROM_STEP = "tunepod.pbt.from_step"
PBT_REPLACES = "tunepod.pbt.replaces"
PBT_CONTINUED_IN = "tunepod.pbt.continued_in"
PARETO_FRONT = "tunepod.pareto_front"
FEASIBLE = "tunepod.feasible"  # a completed trial of a study with constraints: true or false
"""true or false on each completed trial of a multi-objective study."""
CHECKPOINT_S3 = "tunepod.checkpoint_s3"

# Logged models (a checkpoint folder).
MODEL_STEP = "tunepod.step"
MODEL_CHECKPOINT = "tunepod.checkpoint"

# Registered model versions.
METRIC = "tunepod.metric"
VALUE = "tunepod.value"
DIRECTION = "tunepod.direction"
PIPELINE_RUN = "tunepod.pipeline_run"
TRIAL_RUN = "tunepod.trial_run"
SOURCE_MODEL = "tunepod.source_model_id"


def job_tags(prefix: str) -> tuple[str, str, str]:
    """The job id, job dir and attempt tags under ``prefix`` (``tunepod.`` or ``tunepod.<step>.``)."""
    return f"{prefix}{JOB_ID}", f"{prefix}{JOB_DIR}", f"{prefix}{ATTEMPT}"


def step_tag(step: str, name: str) -> str:
    """A tag of the pipeline run about one of its steps: ``tunepod.<step>.<name>``."""
    return f"{PREFIX}{step}.{name}"
