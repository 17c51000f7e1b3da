"""``python -m benchmarks.growth.orchestrate <spec>``: the pipeline through the library entry point that
``tunepod run`` wraps in a Prefect flow (``PipelineRun``, one step after another), without Prefect.

The benchmark's ``--orchestrator library``: the same tuner, job driver and MLflow mirror as under
``tunepod run``, without the temporary Prefect server's start-up (its short-form test uses it).
"""

from __future__ import annotations

import sys

from tunepod.outputs import StepOutput
from tunepod.pipeline import PipelineRun


def main(spec: str) -> None:
    run = PipelineRun.start(spec)
    outputs: dict[str, StepOutput] = {}
    ok = False
    try:
        for name in run.dag.order:
            needs = run.spec.steps[name].needs
            outputs[name] = run.run_step(name, {need: outputs[need] for need in needs})
        ok = True
    finally:
        run.finish(ok)


if __name__ == "__main__":
    main(sys.argv[1])
