"""The scale benchmark's harness (``make bench`` runs the real one: 100 and 1,000 trials beside Ray
Tune): ``python -m benchmarks.scale`` on 6 trials of 0.2 s, 3 in flight, on the session's Prefect
server. Ray Tune's side is left out here (``--no-ray``): a local Ray takes tens of seconds to start
on this machine, and its side has no logic of the benchmark's own beyond reading Ray's results.

Proves: every trial ran to its result, and the probe saw each piece of bookkeeping once per trial
(one ask, one tell, one wait for its MLflow run, one submission, the Prefect task run's start and
end, MLflow calls), so the
per-trial figures divide what was really measured. Speed is never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRIALS = 6
#: Against a hang only, never a speed check.
LIMIT_S = 240


@pytest.mark.usefixtures("prefect_api")
def test_the_probe_counts_every_piece_of_bookkeeping_once_per_trial(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    figures = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "benchmarks.scale", "--trials", str(TRIALS), "--parallel", "3"]
    argv += ["--sleep-s", "0.2", "--no-ray", "--prefect-api", str(PREFECT_API_URL.value())]
    argv += ["--json", str(figures)]
    done = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True,
        timeout=LIMIT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = json.loads(figures.read_text())
    assert result["side"] == "tunepod" and result["failed"] is None
    calls = {piece: figures["calls"] for piece, figures in result["pieces"].items()}
    assert calls["ask"] == calls["tell"] == calls["submission"] == calls["MLflow run wait"] == TRIALS
    assert calls["Prefect task run"] == 2 * TRIALS  # into the trial, and back out of it
    assert calls["MLflow writes"] >= 2 * TRIALS  # at least each trial run's start and end
    assert result["cpu_s"] > 0
    assert result["tail_s"] > 0 and result["max_rss_mb"] > 0  # the end of the study, and the memory
    assert result["pieces"]["MLflow writes"]["cpu_s"] > 0  # the calling threads' own CPU, beside the wall
    assert "bookkeeping on a trial's path <= 50 ms per trial" in done.stdout
