"""benchmarks.quality.rung_ranking: the offline check of a rung's ranking against the final values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.quality.rung_ranking import full_curves, main, ranks, spearman


def write_trial(jobs: Path, number: int, curve: dict[int, float]) -> None:
    job = jobs / f"trial-{number}"
    job.mkdir(parents=True)
    lines = [json.dumps({"step": s, "metrics": {"loss": v}, "time": 1.0 + s}) for s, v in curve.items()]
    (job / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_ranks_share_ties_and_spearman_reads_order_only() -> None:
    assert ranks([3.0, 1.0, 3.0, 2.0]) == [2.5, 0.0, 2.5, 1.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_only_trials_trained_to_the_final_step_are_read(tmp_path: Path) -> None:
    jobs = tmp_path / "shared" / "jobs" / "study"
    write_trial(jobs, 0, {20: 30.0, 40: 20.0, 60: 18.0})
    write_trial(jobs, 1, {20: 30.0, 40: 25.0})  # stopped before the end: no final value
    assert full_curves(tmp_path, "loss", 60) == [{20: 30.0, 40: 20.0, 60: 18.0}]


def test_prints_each_rankings_correlation_and_where_the_winners_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = tmp_path / "shared" / "jobs" / "study"
    for number, scale in enumerate((1.0, 1.2, 1.5, 2.0)):
        write_trial(jobs, number, {20: 30.0 * scale, 40: 20.0 * scale, 60: 15.0 * scale})
    argv = [str(tmp_path), "--metric", "loss", "--minimize", "--rung-steps", "40", "--final-step", "60"]
    assert main([*argv, "--target", "16"]) == 0
    out = capsys.readouterr().out
    assert "rung step    40 by value   : spearman  1.000; reaching ranks [0], 1 in the top 1" in out
    assert "by forecast" in out


def test_a_root_without_finished_trials_is_refused_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "shared" / "jobs" / "study").mkdir(parents=True)
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--metric", "loss", "--rung-steps", "40", "--final-step", "60"])
    assert f"{tmp_path}: no trial reported loss at step 60" in capsys.readouterr().err
