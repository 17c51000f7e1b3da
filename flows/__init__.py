"""Prefect flows. Deployments point at ``flows/pipeline.py:pipeline``."""
