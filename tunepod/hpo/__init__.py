"""Hyperparameter search: an Optuna study whose trials are training jobs on a launcher."""
