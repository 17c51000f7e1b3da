"""The chaos soak's rule for a restarted training script (benchmarks/chaos/checks.py,
``resume_problems``): each start resumes from the newest checkpoint saved before it, then reports the
epochs after it, each once. Its trainer reports an epoch, then saves its checkpoint, and keeps the
newest three, so the rule reads both the checkpoints left and the reports."""

from __future__ import annotations

from benchmarks.chaos.checks import Start, resume_problems
from benchmarks.chaos.faults import Fault, kinds_for
from tunepod.runtime import Report


def reports(*steps_at: tuple[int, float]) -> list[Report]:
    return [Report(step, {"score": 0.1}, at) for step, at in steps_at]


def test_a_start_that_resumed_from_the_last_checkpoint_and_went_on_holds() -> None:
    starts = [Start(0.0, -1), Start(10.0, 2)]
    reported = reports((0, 1.0), (1, 2.0), (2, 3.0), (3, 11.0), (4, 12.0), (5, 13.0))
    saved = [(3, 11.1), (4, 12.1), (5, 13.1)]  # 0-2 pruned: the reports bound what it loaded
    assert resume_problems(starts, reported, saved) == []


def test_an_epoch_reported_again_after_a_kill_before_its_checkpoint_holds() -> None:
    starts = [Start(0.0, -1), Start(10.0, 1)]
    reported = reports((0, 1.0), (1, 2.0), (2, 3.0), (2, 11.0), (3, 12.0))  # killed before step-2 saved
    assert resume_problems(starts, reported, [(1, 2.1), (2, 11.1), (3, 12.1)]) == []


def test_a_start_that_loaded_an_older_checkpoint_than_the_newest_is_a_problem() -> None:
    starts = [Start(0.0, -1), Start(10.0, 0)]
    reported = reports((0, 1.0), (1, 2.0), (2, 3.0), (1, 11.0), (2, 12.0), (3, 13.0))
    [problem] = resume_problems(starts, reported, [(2, 3.1), (3, 13.1)])
    assert "start 2 (+10.0 s) resumed from step 0, the newest saved before it: 2" in problem


def test_an_epoch_trained_twice_after_the_checkpoint_it_resumed_from_is_a_problem() -> None:
    starts = [Start(0.0, -1), Start(10.0, 2)]
    reported = reports((0, 1.0), (1, 2.0), (2, 3.0), (2, 11.0), (3, 12.0))  # step 2 again, past step-2
    [problem] = resume_problems(starts, reported, [(2, 3.1), (3, 12.1)])
    assert "then reported steps [2, 3], want [3, 4]" in problem


def test_a_first_start_that_found_a_checkpoint_is_a_problem() -> None:
    [problem] = resume_problems([Start(0.0, 3)], reports((4, 1.0)), [(4, 1.1)])
    assert "resumed from step 3, the newest saved before it: -1" in problem


def test_node_loss_is_a_fault_of_multi_node_slurm_studies_only() -> None:
    node_faults = {Fault.NODE_KILLED, Fault.NODE_DOWN, Fault.NODE_CUT}
    assert node_faults <= set(kinds_for("slurm", 2))
    assert not node_faults & {*kinds_for("slurm", 1), *kinds_for("local", 2)}
