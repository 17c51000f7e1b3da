"""A seeded study that a second orchestrator (or a rerun) opens continues the sampler's sequence."""

from __future__ import annotations

from pathlib import Path

from tunepod.hpo.study import distributions, open_study, reseed_for_next_trial
from tunepod.spec.models import TuneSettings


def settings(tmp_path: Path, sampler: str, seed: int = 7) -> TuneSettings:
    return TuneSettings.model_validate(
        {
            "train": {"entrypoint": "train.py"},
            "study": {"name": "s", "storage": f"journal://{tmp_path}/optuna.log", "metric": "m"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "num_trials": 4,
            "sampler": sampler,
            "seed": seed,
        }
    )


def ask(tune: TuneSettings, count: int) -> list[float]:
    """``count`` suggestions from a freshly opened study, as one orchestrator run would ask them."""
    study = open_study(tune)
    space = distributions(tune.space)
    suggested = []
    for _ in range(count):
        reseed_for_next_trial(study, tune, len(study.trials))
        suggested.append(float(study.ask(space).params["x"]))
    return suggested


def test_a_rerun_does_not_suggest_the_first_trials_again(tmp_path: Path) -> None:
    for sampler in ("random", "tpe"):
        tune = settings(tmp_path / sampler, sampler)
        first, rerun = ask(tune, 2), ask(tune, 2)
        assert len(set(first + rerun)) == 4, (sampler, first, rerun)


def test_one_orchestrator_with_a_seed_is_reproducible(tmp_path: Path) -> None:
    assert ask(settings(tmp_path / "a", "random"), 3) == ask(settings(tmp_path / "b", "random"), 3)


def test_neighbouring_seeds_draw_different_sequences(tmp_path: Path) -> None:
    """Seed 8 must not repeat seed 7's suggestions one trial later (it did with ``seed + n``)."""
    seven = ask(settings(tmp_path / "7", "random", seed=7), 4)
    eight = ask(settings(tmp_path / "8", "random", seed=8), 4)
    assert not set(seven) & set(eight), (seven, eight)
