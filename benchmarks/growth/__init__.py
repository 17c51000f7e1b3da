"""Work that grows with a trial: the orchestrator's CPU per report across a 100,000-report trial.

``python -m benchmarks.growth`` (see ``__main__``).
"""
