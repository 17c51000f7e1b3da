"""The MLflow side of a pipeline run: one parent run, a child run per trial, checkpoints as logged
models, evaluation metrics linked to them, and the registry.

Every call names its run explicitly: MLflow's "active run" is per thread, and trials report from
several threads at once.
"""

from tunepod.tracking.mlflow_tracker import MlflowTracker, RunTracker, artifact_root_for

__all__ = ["MlflowTracker", "RunTracker", "artifact_root_for"]
