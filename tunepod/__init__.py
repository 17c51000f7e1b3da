"""tunepod: declarative training pipelines.

A YAML spec declares the steps (stage, tune, train, evaluate, register); Prefect runs them; Optuna
drives the tuning, each trial a distributed training job on a launcher (local processes, Slurm,
HyperPod, SageMaker); MLflow records every trial and holds the registered winner.

This package is the library and never imports Prefect: ``flows/`` and ``tasks/`` wrap it.
"""

__version__ = "0.1.0"
