"""The real Tuner in simulated time, for the benchmarks (``run_quality_study``, see its module).

The quality run is test machinery: it lives in ``tests/simulation`` with the lifecycle simulation
whose scheduler, cluster, stores and backends it reuses, and ships with neither the package nor the
benchmarks. A benchmark imports it from here, the one place that puts ``tests/`` on ``sys.path``
(last, so that the test helpers there shadow no installed module).
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)

from simulation.quality import (  # noqa: E402 (found only once tests/ is on the path)
    CurveModel,
    JobSpan,
    QualityTrace,
    TraceReport,
    outcome_of,
    run_quality_study,
)

__all__ = ["CurveModel", "JobSpan", "QualityTrace", "TraceReport", "outcome_of", "run_quality_study"]
