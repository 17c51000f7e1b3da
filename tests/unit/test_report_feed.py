"""``ReportFeed``: which of a trial's reports Optuna is told, and when the pruner is asked. A real tuner
on an Optuna journal, and the tracking outbox; the feed gets the reports the job driver would hand it,
poll by poll. MLflow is not under test here (the feed only hands the trial's mirror to the outbox):
the mirror is a double that counts the outbox's syncs, and no MLflow store is made."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import optuna
import pytest

from tunepod.hpo.tuner import ReportFeed, TuneContext, Tuner, next_step_to_tell
from tunepod.launch.local import LocalLauncher
from tunepod.outputs import Dataset
from tunepod.runtime import Report
from tunepod.spec.models import TuneSettings
from tunepod.tracking import MlflowTracker
from tunepod.tracking.mirror import RunMirror
from tunepod.tracking.outbox import TrackingOutbox


class CountingMirror:
    """What the outbox uses of a ``RunMirror``: ``sync`` (counted), ``run_id``, ``job_dir``."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.run_id = "run"
        self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1


@pytest.fixture
def outbox() -> Iterator[TrackingOutbox]:
    box = TrackingOutbox()
    yield box
    box.close()


def make_tuner(tmp_path: Path, outbox: TrackingOutbox, **pruner: Any) -> Tuner:
    settings = TuneSettings.model_validate(
        {
            "train": {"entrypoint": __file__},
            "study": {"name": "feed", "storage": f"journal://{tmp_path}/optuna.log", "metric": "score"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "num_trials": 2,
            "pruner": pruner or {"kind": "none"},
        }
    )
    data = str(tmp_path)
    dataset = Dataset(source="t", path=data, num_files=0, num_bytes=0, copied_files=0, copied_bytes=0)
    context = TuneContext(
        step="search",
        settings=settings,
        launcher=LocalLauncher(tmp_path / "shared"),
        dataset=dataset,
        jobs_dir=tmp_path / "jobs",
        tracker=cast(MlflowTracker, None),  # the feed never writes to MLflow itself
        outbox=outbox,
        parent_run_id="pipeline-run",
        pipeline="feed-tests",
    )
    return Tuner(context)


def feed_of(tuner: Tuner, number: int, mirror: CountingMirror | None = None) -> ReportFeed:
    """The feed of trial ``number`` as ``run_trial`` makes it, from the trial as the storage has it."""
    mirror = mirror or CountingMirror(tuner.ctx.jobs_dir / f"trial-{number}")
    return ReportFeed(tuner, tuner.trials.frozen(number), cast(RunMirror, mirror))


def reports(steps: Iterable[int], score: float = 0.0) -> list[Report]:
    return [Report(step=step, metrics={"score": score + step / 1e6}, time=1.0) for step in steps]


def fed(feed: ReportFeed, steps: list[int], poll: int = 100) -> None:
    """Hand ``steps`` to the feed ``poll`` at a time, as the driver does."""
    for start in range(0, len(steps), poll):
        feed(reports(steps[start : start + poll]))


def told(tuner: Tuner, number: int) -> dict[int, float]:
    return tuner.trials.frozen(number).intermediate_values


def test_the_steps_told_keep_three_significant_digits() -> None:
    assert [next_step_to_tell(t) for t in (-1, 0, 998, 999, 1000, 1005, 9990, 10_000, 123_456)] == [
        0, 1, 999, 1000, 1010, 1010, 10_000, 10_100, 124_000,
    ]  # fmt: skip
    steps, step = [], -1
    while (step := next_step_to_tell(step)) <= 1_000_000:
        steps.append(step)
    assert len(steps) == 1000 + 900 * 3 + 1  # the first 1,000, then 900 per tenfold, and 10**6


def test_optuna_is_told_the_steps_it_keeps_and_the_last_one_at_the_end(
    tmp_path: Path, outbox: TrackingOutbox
) -> None:
    tuner = make_tuner(tmp_path, outbox)
    number = tuner.study.ask().number
    mirror = CountingMirror(tmp_path / "trial")
    feed = feed_of(tuner, number, mirror)
    # Every step below 1,000 is told (every 50th is enough to show it), then every 10th.
    fed(feed, [*range(0, 1000, 50), *range(1000, 2500)])
    expected = [*range(0, 1000, 50), *range(1000, 2500, 10)]
    assert sorted(told(tuner, number)) == expected
    feed.tell_last_step()
    values = told(tuner, number)
    assert sorted(values) == [*expected, 2499]
    assert all(values[step] == step / 1e6 for step in values)  # each step's own value
    assert feed.last_step == 2499 and feed.latest == {"score": 2499 / 1e6}
    assert outbox.flush(timeout_s=30) and mirror.syncs >= 1  # every poll hands the mirror over


def test_a_restarted_orchestrator_tells_the_same_steps(tmp_path: Path, outbox: TrackingOutbox) -> None:
    tuner = make_tuner(tmp_path, outbox)
    steps = list(range(0, 3000, 7))  # steps off the grid: the first one past each point is told
    whole, restarted = tuner.study.ask().number, tuner.study.ask().number
    feed = feed_of(tuner, whole)
    fed(feed, steps)
    feed.tell_last_step()
    fed(feed_of(tuner, restarted), steps[: len(steps) // 2])  # then the orchestrator dies
    again = feed_of(tuner, restarted)
    fed(again, steps, poll=33)  # the new driver reads the metrics file from the top
    again.tell_last_step()
    assert sorted(told(tuner, restarted)) == sorted(told(tuner, whole))
    assert 1001 in told(tuner, whole) and 1008 not in told(tuner, whole)  # 1001: the first past 1000
    assert max(told(tuner, whole)) == steps[-1]


def tuner_under_the_median_pruner(tmp_path: Path, outbox: TrackingOutbox) -> Tuner:
    """A tuner whose study holds one completed trial that reported 1.0 at every step below 1,200."""
    tuner = make_tuner(tmp_path, outbox, kind="median")
    completed = optuna.trial.create_trial(
        params={"x": 0.5},
        distributions={"x": optuna.distributions.FloatDistribution(0.0, 1.0)},
        value=1.0,
        intermediate_values=dict.fromkeys(range(1200), 1.0),
    )
    tuner.study.add_trial(completed)
    return tuner


def test_the_pruner_is_asked_only_when_optuna_was_told_something(
    tmp_path: Path, outbox: TrackingOutbox
) -> None:
    tuner = tuner_under_the_median_pruner(tmp_path, outbox)
    number = tuner.study.ask().number
    feed = feed_of(tuner, number)
    assert feed(reports([0, 1000])) == "pruned"  # below the completed trial at step 1000: prune
    assert feed(reports(range(1001, 1006))) is None  # nothing told (1010 is next): nothing asked
    assert feed([]) is None
    assert feed(reports(range(1006, 1011))) == "pruned"
    assert sorted(told(tuner, number)) == [0, 1000, 1010]


def test_a_driver_that_takes_over_judges_the_value_optuna_holds_at_its_first_reports(
    tmp_path: Path, outbox: TrackingOutbox
) -> None:
    """The driver before it told step 1000's value and died before the pruner was asked: nothing is
    new to tell the next driver, which still asks once, at its first reports, and then only when
    told something again."""
    tuner = tuner_under_the_median_pruner(tmp_path, outbox)
    number = tuner.study.ask().number
    tuner.trials.live(number).report(0.0, 1000)  # told, never judged
    taking_over = feed_of(tuner, number)
    assert taking_over([]) is None  # no reports read yet: no look at the trial
    assert taking_over(reports([0, 1000])) == "pruned"
    assert taking_over(reports([0, 1000])) is None  # judged once: the same value is not judged again
