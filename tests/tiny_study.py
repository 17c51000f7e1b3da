"""A tiny study spec for runs of ``tunepod run`` in tests: stage a folder, tune the quadratic trainer."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def write_tiny_study(
    tmp: Path, tracking_uri: str, num_trials: int, epochs: int = 4
) -> tuple[Path, Path, Path]:
    """A spec (stage a folder, then tune the quadratic trainer, every trial at once, ``epochs`` of
    1 s), every store but MLflow under ``tmp``; returns the spec, the study's jobs folder and its
    journal."""
    root, journal = tmp / "shared", tmp / "optuna.log"
    trainer = REPO / "tests" / "fixtures" / "trainers" / "quadratic.py"
    tune = {
        "train": {"entrypoint": str(trainer), "args": {"epochs": epochs, "sleep_s": 1.0}},
        "study": {"name": "tiny", "storage": f"journal://{journal}", "metric": "score"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "num_trials": num_trials, "num_parallel": num_trials, "sampler": "random", "seed": 7, "poll_s": 0.2,
    }  # fmt: skip
    spec = {
        "name": "tiny",
        "tracking": {"uri": tracking_uri, "experiment": "tiny"},
        "launcher": {"kind": "local", "root": str(root)},
        "steps": {
            "data": {"uses": "stage", "with": {"source": str(REPO / "tests" / "fixtures" / "specs"),
                                               "target": "fsx:///datasets/x"}},
            "search": {"uses": "tune", "needs": ["data"], "with": tune},
        },
    }  # fmt: skip
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, root / "jobs" / "tiny", journal
