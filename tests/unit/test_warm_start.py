"""``enqueue`` and ``warm_start`` against real Optuna journal storages: what runs first, what is never
run twice, what does not fit the space and is said so, and what the spec refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from pydantic import ValidationError

from tunepod.errors import TunepodError
from tunepod.hpo.study import distributions, enqueue_first_trials, open_study
from tunepod.spec.models import TuneSettings


def settings(storage: Path, name: str = "now", **extra: Any) -> TuneSettings:
    return TuneSettings.model_validate(
        {
            "train": {"entrypoint": "train.py"},
            "study": {"name": name, "storage": f"journal://{storage}", "metric": "acc"},
            "space": {
                "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
                "hidden": {"type": "int", "low": 16, "high": 256, "step": 16},
            },
            "num_trials": 8,
            **extra,
        }
    )


def ask_all(tune: TuneSettings, count: int) -> list[dict[str, Any]]:
    study = open_study(tune)
    asked = []
    for _ in range(count):
        trial = study.ask(distributions(tune.space))
        study.tell(trial, 0.5)
        asked.append(trial.params)
    return asked


def test_enqueued_configurations_run_first_in_order_and_never_twice(tmp_path: Path) -> None:
    tune = settings(tmp_path / "o.log", enqueue=[{"lr": 0.01, "hidden": 64}, {"lr": 0.001}])
    study = open_study(tune)
    assert enqueue_first_trials(study, tune) == [
        "enqueue: 2 of 2 configurations queued (the rest ran before)"
    ]
    first, second, third = ask_all(tune, 3)
    assert first == {"lr": 0.01, "hidden": 64}
    assert second["lr"] == 0.001 and 16 <= second["hidden"] <= 256  # hidden left out: sampled
    assert third["lr"] not in (0.01, 0.001)
    # A rerun (or a second orchestrator) finds them in the study: nothing is queued again.
    assert enqueue_first_trials(open_study(tune), tune)[0].startswith("enqueue: 0 of 2")


def test_warm_start_runs_the_best_earlier_trials_that_fit_and_names_the_rest(tmp_path: Path) -> None:
    earlier = optuna.create_study(
        study_name="v1", storage=f"sqlite:///{tmp_path}/v1.db", direction="maximize"
    )  # another storage than the new study's
    for lr, hidden, acc in [(0.01, 64, 0.9), (0.5, 32, 0.95), (0.001, 128, 0.8), (0.02, 48, 0.5)]:
        earlier.enqueue_trial({"lr": lr, "hidden": hidden, "dropout": 0.1})
        trial = earlier.ask()
        trial.suggest_float("lr", 1e-4, 1.0, log=True)
        trial.suggest_int("hidden", 16, 256, step=16)
        trial.suggest_float("dropout", 0.0, 0.5)
        earlier.tell(trial, acc)

    warm = [{"study": "v1", "storage": f"sqlite:///{tmp_path}/v1.db", "top_k": 3}]
    tune = settings(tmp_path / "o.log", warm_start=warm)
    said = enqueue_first_trials(open_study(tune), tune)
    # The best three: lr 0.5 (outside this space), lr 0.01, lr 0.001; dropout is dropped (not searched).
    assert said == [
        "warm start from v1: 2 of its best 3 queued; not carried: trial 1 (0.5 is outside [0.0001, 0.1])"
    ]
    assert ask_all(tune, 2) == [{"lr": 0.01, "hidden": 64}, {"lr": 0.001, "hidden": 128}]


def test_a_warm_start_study_that_does_not_exist_is_named_with_the_fix(tmp_path: Path) -> None:
    tune = settings(tmp_path / "o.log", warm_start=[{"study": "nope"}])
    with pytest.raises(TunepodError, match=r"warm_start: no study 'nope' in journal://.*fix: name a study"):
        enqueue_first_trials(open_study(tune), tune)


@pytest.mark.parametrize(
    ("enqueue", "message"),
    [
        ([{"lr": 0.5}], r"enqueue\[0\]\.lr: 0.5 is outside \[0.0001, 0.1\]"),
        ([{}, {"hidden": 20}], r"enqueue\[1\]\.hidden: 20 is off the step 16 from 16"),
        ([{"depth": 3}], r"enqueue\[0\]\.depth: depth is not in space \(lr, hidden\)"),
        ([{"hidden": "wide"}], r"enqueue\[0\]\.hidden: 'wide' is not an integer"),
    ],
)
def test_enqueued_values_outside_the_space_are_refused(tmp_path: Path, enqueue: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        settings(tmp_path / "o.log", enqueue=enqueue)


def test_a_resumed_study_takes_a_wider_range_and_refuses_other_choices_with_the_warm_start_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = settings(tmp_path / "o.log")
    ask_all(first, 3)
    wider = first.model_copy(deep=True)
    wider.space["lr"] = wider.space["lr"].model_copy(update={"high": 0.5})
    narrower = first.model_copy(deep=True)
    narrower.space["hidden"] = narrower.space["hidden"].model_copy(update={"high": 16})
    assert len(ask_all(wider, 1)) == 1  # Optuna's samplers take the earlier trials as they are
    with caplog.at_level("WARNING"):
        open_study(narrower)
    assert "earlier trial(s) have hidden outside the space's new range; kept" in caplog.text

    other = TuneSettings.model_validate(
        first.model_dump(by_alias=True)
        | {
            "space": {
                "lr": {"type": "categorical", "choices": [0.01, 0.1]},
                "hidden": {"type": "int", "low": 16, "high": 256, "step": 16},
            }
        }
    )
    with pytest.raises(TunepodError) as raised:
        open_study(other)
    message = str(raised.value)
    assert "lr: was float [0.0001, 0.1], log, the spec says choices [0.01, 0.1]" in message
    assert "Fix: give the study a new name and add warm_start: [{study: now}]" in message
