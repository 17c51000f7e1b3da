"""``num_parallel`` against real components: one cap for the whole study however many orchestrators
share it, and ``num_parallel: auto`` read from the machine (local launcher) or from the real Slurm
cluster's ``sinfo``. Jobs are real processes; the study is a journal file, MLflow a SQLite store.

How many trials ran at once is read from what the jobs themselves wrote: each trainer's start time
(``starts.log``) and the time its result was written (``result.json``). A job runs inside the time its
trial is in flight (asked before its job is submitted, counted until its driver has told Optuna after
the job ended), so the most jobs at once can only undercount the trials in flight, never overcount.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
from integration.test_tuner import make_tuner, run_together, settings

from tunepod.launch.slots import counted
from tunepod.launch.slurm import SlurmLauncher
from tunepod.outputs import TrialSet
from tunepod.spec.models import SlurmLauncherSpec

#: Long enough for a second orchestrator to see the first one's trials running (~1.5 s each).
TRIAL_ARGS = {"epochs": 3, "sleep_s": 0.3}


def windows(trials: TrialSet) -> list[tuple[float, float]]:
    """(start, end) of each trial's job, as the job wrote them."""
    return [
        (
            float(Path(t.job_dir, "starts.log").read_text().split()[0]),
            Path(t.job_dir, "result.json").stat().st_mtime,
        )
        for t in trials.trials
    ]


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one moment (an end before a start at the same instant)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = running = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def test_two_orchestrators_share_one_cap_of_num_parallel(tmp_path: Path) -> None:
    """Two tuners on one journal study, started together, num_parallel 2: never more than two trials'
    jobs run at once (each tuner capped alone, all three did), and the study still ends with
    num_trials trials, each trained once."""
    tune = settings(tmp_path, num_trials=3, num_parallel=2, train={"args": TRIAL_ARGS})
    results = run_together(make_tuner(tmp_path, tune), make_tuner(tmp_path, tune))

    trials = results[0]
    assert [t.number for t in trials.trials] == [0, 1, 2]
    assert all(t.outcome == "COMPLETE" for t in trials.trials)
    assert all(len(Path(t.job_dir, "starts.log").read_text().split()) == 1 for t in trials.trials)
    # Under one cap per orchestrator all three ran at once here (the second asked its own two).
    assert most_at_once(windows(trials)) <= 2, sorted(windows(trials))


def cpus() -> int:
    return len(os.sched_getaffinity(0))


def test_auto_on_the_local_launcher_runs_as_many_trials_as_the_cpus_allow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """num_parallel auto: the tuner runs as many trials at once as this machine has CPUs (one process
    each), says so, and hands the number to everything after it (its settings are the resolved copy).
    Dividing by processes per trial: tests/unit/test_auto_parallel.py."""
    expected = cpus()
    tune = settings(
        tmp_path, num_trials=min(expected + 1, 3), num_parallel="auto", train={"args": TRIAL_ARGS}
    )
    with caplog.at_level(logging.INFO, logger="tunepod"):
        tuner = make_tuner(tmp_path, tune)
    assert tuner.settings.num_parallel == expected
    assert f"num_parallel auto: {counted(expected, 'CPU')} / 1 process per trial = {expected}" in caplog.text
    trials = tuner.run()
    assert [t.outcome for t in trials.trials] == ["COMPLETE"] * tune.num_trials
    assert most_at_once(windows(trials)) <= expected


@pytest.mark.slurm
def test_auto_on_slurm_counts_the_idle_nodes_of_the_partition(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real sinfo of the test cluster (partition debug, one node): auto is 1, whether the node is
    idle or busy with another test's job (at least 1); the default partition is the one sinfo marks."""
    tune = settings(tmp_path, num_parallel="auto")
    for partition in ("debug", None):
        spec = SlurmLauncherSpec(kind="slurm", root=str(tmp_path), python=sys.executable, partition=partition)
        with caplog.at_level(logging.INFO, logger="tunepod"):
            tuner = make_tuner(tmp_path, tune, SlurmLauncher(spec))
        assert tuner.settings.num_parallel == 1
        assert "idle node" in caplog.text and "in partition debug / 1 node per trial" in caplog.text
        caplog.clear()
