"""The growth benchmark: how it cuts a run into tenths (from synthetic samples), and its short form
(``python -m benchmarks.growth`` as a user runs it, on 2,000 reports, through the library orchestrator
without Prefect's start-up, and without checkpoints): the harness reads a whole run, every report
consumed by the orchestrator, ten tenths and the trial's end. Speed is never asserted."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Against a hang only, never a speed check.
LIMIT_S = 300


def test_batches_of_reports_are_charged_for_the_time_they_took(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is not installed: imported from the checkout
    from benchmarks.growth.measure import Sample, tenths, trial_end

    # The job reports from 2 s on; the orchestrator works at 0.5 CPU s per second and says how far it
    # got every 5 s, 2,500 reports at once (as the MLflow mirror does, after each batch): each tenth of
    # 30,000 reports, most of them ending inside a batch, took it 6 s and 3 s of CPU, the first one too.
    samples = [
        Sample(t, 0.5 * max(0, t - 2), min(30_000, 2500 * (max(0, t - 2) // 5)), 1000 * max(0, t - 2), 0, 0)
        for t in range(0, 73)
    ]
    cut = tenths(samples, 30_000)
    assert [round(t.cpu_ms_per_1000) for t in cut] == [1000] * 10
    assert [round(t.wall_s) for t in cut] == [6] * 10
    assert trial_end(samples, 30_000, samples[-1]) == (5.0, 10.0)  # consumed all at 62 s, ended at 72 s


def test_the_short_form_reads_a_whole_run(tmp_path: Path) -> None:
    figures_file = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "benchmarks.growth", "--reports", "2000", "--rate", "2000"]
    argv += ["--state-mb", "0"]  # no checkpoint: no logged model to upload at the trial's end
    # The work folder where the benchmark puts it (tmpfs: a disk's fsync per report would be most of it).
    argv += ["--orchestrator", "library", "--json", str(figures_file)]
    done = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True,
        timeout=LIMIT_S, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Growth: the last tenth against the first" in done.stdout, output
    assert "goal: CPU per report flat, last tenth <= 1.2x the first" in done.stdout, output

    figures = json.loads(figures_file.read_text())
    assert figures["failed"] == ""
    assert figures["reports_written"] == figures["reports_consumed"] == 2000
    assert [t["reports"] for t in figures["tenths"]] == [200] * 10
    assert all(t["cpu_s"] >= 0 and t["wall_s"] >= 0 for t in figures["tenths"]), figures["tenths"]
    # None when the first tenth's 200 reports took less than /proc's 10 ms tick
    assert figures["ratio"] is None or math.isfinite(figures["ratio"])
    assert figures["trial_end_cpu_s"] >= 0
    last = figures["samples"][-1]
    assert (last["mirrored"], last["told"]) == (1999, 1999)  # MLflow and Optuna both have the last step
    folder = re.search(r"work folder (\S+)", done.stdout)
    assert folder is not None and not Path(folder.group(1)).exists()  # removed after a run that went well
