"""A tiny study spec for runs of ``tunepod run`` in tests: stage a folder, tune the quadratic trainer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tunepod.launch.base import SUBMISSION_ID_ENV, Launcher
from tunepod.preview import TrialPreview, preview_trials
from tunepod.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]
QUADRATIC = REPO / "tests" / "fixtures" / "trainers" / "quadratic.py"


def write_tiny_study(
    tmp: Path,
    tracking_uri: str,
    num_trials: int,
    epochs: int = 4,
    *,
    launcher: dict[str, object] | None = None,
    trainer: Path = QUADRATIC,
) -> tuple[Path, Path, Path]:
    """A spec (stage a folder, then tune ``trainer``, by default the quadratic one, every trial at
    once, ``epochs`` of 1 s), every store but MLflow under ``tmp``, on the local launcher unless
    ``launcher`` (a launcher block, its root ``<tmp>/shared`` unless it names one) says otherwise;
    returns the spec, the study's jobs folder and its journal."""
    root, journal = Path(str((launcher or {}).get("root", tmp / "shared"))), tmp / "optuna.log"
    tune = {
        "train": {"entrypoint": str(trainer), "args": {"epochs": epochs, "sleep_s": 1.0}},
        "study": {"name": "tiny", "storage": f"journal://{journal}", "metric": "score"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "num_trials": num_trials, "num_parallel": num_trials, "sampler": "random", "seed": 7, "poll_s": 0.2,
    }  # fmt: skip
    spec = {
        "name": "tiny",
        "tracking": {"uri": tracking_uri, "experiment": "tiny"},
        "launcher": {"kind": "local", **(launcher or {}), "root": str(root)},
        "steps": {
            "data": {"uses": "stage", "with": {"source": str(REPO / "tests" / "fixtures" / "specs"),
                                               "target": "fsx:///datasets/x"}},
            "search": {"uses": "tune", "needs": ["data"], "with": tune},
        },
    }  # fmt: skip
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, root / "jobs" / "tiny", journal


def preview_first_trial(
    tmp: Path,
    launcher_block: dict[str, object],
    make_launcher: Callable[[Any], Launcher],
    trainer: Path = QUADRATIC,
) -> tuple[TrialPreview, Launcher]:
    """``tunepod render``'s preview of the tiny study's first trial on the launcher ``launcher_block``
    (its root ``<tmp>/shared`` unless it names one), and the launcher ``make_launcher`` builds from
    that block: submit the preview's job with it to compare what the backend receives with what the
    preview shows."""
    spec_path, _, _ = write_tiny_study(
        tmp, f"sqlite:///{tmp}/mlflow.db", 1, launcher=launcher_block, trainer=trainer
    )
    spec = load_spec(spec_path)
    launcher = make_launcher(spec.launcher)
    [preview] = preview_trials(spec, launcher)
    return preview, launcher


def as_submitted(text: str, preview: TrialPreview, submission_id: str) -> str:
    """``text`` of the preview with its drawn submission id replaced by the one a submit drew."""
    return text.replace(preview.job.env[SUBMISSION_ID_ENV], submission_id)
