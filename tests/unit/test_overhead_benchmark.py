"""The overhead benchmark's reading of the local launcher's job dirs (``make bench`` runs the whole
benchmark; it is not run here: two sides of six torchrun jobs would add a minute to CI). Written
after the benchmark broke unseen when the exit-file parser moved to ``tunepod.launch.exit_code``."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.overhead import tunepod_jobs


def job_dir(study: Path, name: str, *, exit_text: str | None, result: bool, start: float, end: float) -> None:
    folder = study / name
    folder.mkdir(parents=True)
    (folder / "submission.json").write_text("{}")
    os.utime(folder / "submission.json", (start, start))
    if result:
        (folder / "result.json").write_text("{}")
        os.utime(folder / "result.json", (end - 1, end - 1))
    if exit_text is not None:
        (folder / "exit_code").write_text(exit_text)
        os.utime(folder / "exit_code", (end, end))


def test_each_trials_span_and_exit_code_come_from_its_job_dir(tmp_path: Path) -> None:
    job_dir(tmp_path, "trial-0", exit_text="0 0123456789abcdef\n", result=True, start=100.0, end=110.0)
    job_dir(tmp_path, "trial-1", exit_text="1 fedcba9876543210\n", result=True, start=101.0, end=112.0)
    job_dir(tmp_path, "trial-2", exit_text=None, result=True, start=102.0, end=115.0)  # wrapper killed
    job_dir(tmp_path, "trial-3.stale-5", exit_text="0 aaaaaaaaaaaaaaaa\n", result=True, start=1.0, end=2.0)

    spans = {job.trial: job for job in tunepod_jobs(tmp_path)}

    assert sorted(spans) == [0, 1, 2]  # a set-aside folder is no trial
    assert (spans[0].start, spans[0].end, spans[0].exit_code) == (100.0, 110.0, 0)
    assert spans[1].exit_code == 1 and spans[1].has_result
    # Without an exit file the job ended when its result was written.
    assert (spans[2].end, spans[2].exit_code) == (114.0, None)
