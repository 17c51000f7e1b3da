"""The checkpoint benchmark's short form (``make bench-checkpoints`` runs the real one): ``python -m
benchmarks.checkpoints`` as a user runs it, on a state of a few MB, each figure once.

Proves: the three tables print, each with its baseline and tunepod rows, and every ratio is a finite
number: the stall job under the training contract (its ranks started directly, with the variables
torchrun sets, to spare the agent's start-up four times) saved by every method, the memory tier's
two included, whose ratio line and goal print, and whose memory folders are removed; a job SIGKILLed after a
committed checkpoint resumed by tunepod's sharded load up to its first step (the other loaders, one
more job each, run in ``make bench-checkpoints``), and every writer of the throughput table wrote.
Speed is never asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
#: Against a hang only, never a speed check.
LIMIT_S = 300
#: Where the benchmark's jobs keep the memory tier's folders.
SHM = Path("/dev/shm")


def test_every_table_prints_both_sides_with_finite_ratios(tmp_path: Path) -> None:
    figures_file = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "benchmarks.checkpoints", "--dir", str(tmp_path / "checkpoints")]
    argv += ["--stall-mb", "4", "--resume-mb", "4", "--throughput-mb", "4", "--interval", "2"]
    argv += ["--saves", "1", "--rounds", "1", "--throughput-repeats", "1", "--json", str(figures_file)]
    argv += ["--launcher", "direct"]  # the ranks without torchrun's agent: each job starts ~2 s sooner
    # One loader (the sharded one, the most involved) of table 2: each loader is one more 2-rank job.
    argv += ["--resume-methods", "tunepod-sharded"]
    memory_before = set(SHM.glob("tunepod-bench-*"))
    done = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True,
        timeout=LIMIT_S, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for title in (
        "1. Training stall per checkpoint",
        "2. Kill -> first training step",
        "3. Checkpoint write",
    ):
        assert title in done.stdout, output
    assert "goal: async stall <= 0.3x" in done.stdout, output
    assert "memory-tier stall ratio: " in done.stdout and " at 4 MB (whole-state" in done.stdout, output
    assert "goal: memory-tier stall <= 0.1x" in done.stdout, output

    figures = json.loads(figures_file.read_text())
    assert figures["failures"] == []
    (stall_job,) = figures["stall"]
    assert stall_job["size_mb"] == 4
    stall = stall_job["rows"]
    assert {row["side"] for row in stall.values()} == {"baseline", "floor", "tunepod"}
    assert set(stall) == {"torch.save", "torch.save+fsync", "copy", "tunepod", "tunepod-sharded",
                          "tunepod-async", "tunepod-async-process", "tunepod-memory",
                          "tunepod-memory-sharded"}  # fmt: skip
    assert all(math.isfinite(row["ratio"]) and row["bytes"] > 0 for row in stall.values()), stall
    memory = figures["memory_tier"]["ratios"]["4"]
    assert all(math.isfinite(ratio) and ratio > 0 for ratio in memory.values()), memory
    assert set(SHM.glob("tunepod-bench-*")) <= memory_before, "the jobs' memory folders were left behind"

    resumes = figures["resume"]["rows"]
    assert {row["method"] for row in resumes} == {"tunepod-sharded"}
    # No baseline loader ran, so there is no ratio: the phases must still all be measured.
    assert all(math.isnan(row["ratio"]) for row in resumes), resumes
    assert all(all(math.isfinite(s) and s >= 0 for s in row["phases"].values()) for row in resumes), resumes
    # each resume loaded a committed checkpoint (the stall job's last save of that method), not a fresh start
    assert all(raw["step"] > 0 for raw in figures["resume"]["raw"]), figures["resume"]["raw"]

    writers = figures["throughput"]["rows"]
    assert {row["side"] for row in writers.values()} == {"baseline", "tunepod"}
    measured = {name: row for name, row in writers.items() if "error" not in row}
    assert set(writers) - set(measured) <= {"dd oflag=direct"}, writers  # O_DIRECT: not on every filesystem
    assert all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in measured.values()), writers
