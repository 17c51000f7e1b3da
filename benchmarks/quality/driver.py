"""Run one pipeline spec the way ``flows.pipeline`` does, minus Prefect: the benchmark's default driver.

    .venv/bin/python -m benchmarks.quality.driver SPEC [dotted.key=value ...]

``flows.pipeline.pipeline`` opens a ``PipelineRun``, runs its steps in DAG order (each a Prefect task,
each trial a Prefect task run) and finishes it. This does the same with the steps in order on this
thread and the trials on the tuner's own threads. What is measured (a study's trials, from its first
to the one that reaches the target) is the same code either way; what drops out is Prefect's
temporary server, which also timed out starting (after 60 s) on this machine under load 7-10.
``--driver cli`` in the benchmark runs the real ``tunepod run`` instead.
"""

from __future__ import annotations

import logging
import sys

from tunepod.outputs import StepOutput
from tunepod.pipeline import PipelineRun


def run_pipeline(spec_path: str, overrides: list[str]) -> None:
    """Every step of the spec in order; the pipeline run ends FAILED when a step raises."""
    run = PipelineRun.start(spec_path, overrides)
    outputs: dict[str, StepOutput] = {}
    try:
        for name in run.dag.order:
            needs = run.spec.steps[name].needs
            outputs[name] = run.run_step(name, {need: outputs[need] for need in needs})
    except BaseException:
        run.finish(ok=False)
        raise
    run.finish(ok=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_pipeline(sys.argv[1], sys.argv[2:])
