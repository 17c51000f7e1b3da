"""The ``train.checkpoints`` block: checked at spec load with a fix for each mistake, handed to the job
as ``TUNEPOD_CHECKPOINT_TIERS`` / the contract's ``checkpoint_tiers``, and the rule that sends each
save to memory, to the shared folder, to both or to neither."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tunepod import runtime
from tunepod.errors import SpecError
from tunepod.launch.contract import contract_env
from tunepod.launch.paths import JobPaths
from tunepod.runtime import restores
from tunepod.runtime.contract import read_contract
from tunepod.runtime.tiers import CheckpointTiers, SaveTargets, TierSchedule
from tunepod.spec.loader import parse_spec
from tunepod.spec.models import TrainJob


def pipeline(checkpoints: dict[str, Any]) -> str:
    train = {"entrypoint": "train.py", "checkpoints": checkpoints}
    study = {"name": "s", "metric": "loss", "direction": "minimize"}
    settings = {"train": train, "study": study, "space": {"lr": {"type": "float", "low": 0.1, "high": 1}}}
    spec = {
        "name": "p",
        "tracking": {"experiment": "e"},
        "steps": {
            "data": {"uses": "stage", "with": {"source": "builtin://digits", "target": "fsx:///d"}},
            "search": {"uses": "tune", "needs": ["data"], "with": {**settings, "num_trials": 2}},
        },
    }
    return yaml.safe_dump(spec, sort_keys=False)


def train_job(checkpoints: dict[str, Any]) -> TrainJob:
    job = parse_spec(pipeline(checkpoints), "p.yaml", check_files=False).steps["search"].with_.train
    assert isinstance(job, TrainJob)
    return job


def refusal(checkpoints: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as caught:
        train_job(checkpoints)
    return str(caught.value)


def test_the_block_defaults_to_one_replica_in_dev_shm_and_reaches_the_job(tmp_path: Path) -> None:
    job = train_job({"memory_every_steps": 10, "shared_every_steps": 100})
    assert job.checkpoints is not None
    tiers = job.checkpoints.tiers()
    assert tiers == CheckpointTiers(10, 100, memory_replicas=1, memory_dir="/dev/shm")
    env = contract_env(JobPaths(tmp_path), params={}, data_dir="/d", trial="1", checkpoint_tiers=tiers)
    assert read_contract(env).checkpoint_tiers == tiers
    # Absent: no variable, no tiers, every save to the shared folder as before.
    plain = contract_env(JobPaths(tmp_path), params={}, data_dir="/d", trial="1")
    assert runtime.CHECKPOINT_TIERS_ENV not in plain and read_contract(plain).checkpoint_tiers is None


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (
            {"memory_every_steps": 10, "shared_every_steps": 5},
            "checkpoints.shared_every_steps 5 is below memory_every_steps 10",
        ),
        ({"memory_every_steps": 0, "shared_every_steps": 5}, "memory_every_steps"),
        ({"memory_every_steps": 1, "shared_every_steps": 5, "memory_replicas": -1}, "memory_replicas"),
        (
            {"memory_every_steps": 1, "shared_every_steps": 5, "memory_dir": "shm"},
            "checkpoints.memory_dir 'shm' is not an absolute path",
        ),
        ({"memory_every_steps": 1}, "shared_every_steps"),
        (
            {"memory_every_steps": 1, "shared_every_steps": 5, "replicas": 1},
            "did you mean 'memory_replicas'?",
        ),
    ],
)
def test_each_mistake_is_refused_naming_the_field_and_the_fix(block: dict[str, Any], expected: str) -> None:
    message = refusal(block)
    assert "steps.search.with.train" in message and expected in message
    assert "fix:" in message


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("{not json", "TUNEPOD_CHECKPOINT_TIERS is not a checkpoint tiers object"),
        ('{"memory_every_steps": 4, "shared_every_steps": 2}', "fix: set shared_every_steps to at least 4"),
        ('{"memory_every_steps": 1, "shared_every_steps": 2, "memory_dir": "x"}', "absolute path"),
        ('{"memory_every_steps": 1, "shared_every_steps": 2, "bogus": 1}', "unexpected keyword"),
    ],
)
def test_a_malformed_variable_is_refused_at_init(raw: str, expected: str) -> None:
    with pytest.raises(ValueError, match="TUNEPOD_CHECKPOINT_TIERS") as caught:
        runtime.init(environ={runtime.CHECKPOINT_TIERS_ENV: raw})
    assert expected in str(caught.value)


def test_saves_go_to_memory_every_n_and_to_shared_every_m_steps_counted_not_matched() -> None:
    schedule = TierSchedule(CheckpointTiers(memory_every_steps=2, shared_every_steps=5))
    seen = {}
    for step in [0, 1, 2, 3, 4, 5, 7, 9, 10, 11]:
        targets = schedule.targets(step, stopping=False)
        schedule.saved(step, targets)
        seen[step] = targets
    nothing, memory, both = SaveTargets(False, False), SaveTargets(False, True), SaveTargets(True, True)
    assert seen == {
        0: both,  # a first save goes to both: a job has a shared step early
        1: nothing,
        2: memory,
        3: nothing,
        4: memory,
        5: both,  # shared due: memory too, though saved at 4 (the newest step is always in memory)
        7: memory,
        9: memory,
        10: both,
        11: nothing,
    }


def test_an_agreed_stop_sends_the_next_save_to_shared_and_a_restore_resets_the_counts() -> None:
    schedule = TierSchedule(CheckpointTiers(memory_every_steps=10, shared_every_steps=100))
    schedule.restored(57, newest_shared=0)
    assert schedule.targets(58, stopping=False) == SaveTargets(False, False)
    assert schedule.targets(67, stopping=False) == SaveTargets(False, True)
    assert schedule.targets(58, stopping=True) == SaveTargets(True, True)
    schedule.restored(57, newest_shared=None)  # restored from memory, no shared step at all
    assert schedule.targets(58, stopping=False) == SaveTargets(True, True)


# ------------------------------------------------------------------------------ the restores file


@pytest.mark.parametrize(
    ("sources", "tier"),
    [
        (["own memory", "peer memory (10.231.0.12:4711)"], "peer memory"),
        (["own memory", "own memory"], "own memory"),
        (["shared file system"], "shared file system"),
    ],
)
def test_a_restore_is_the_jobs_from_a_peer_when_any_rank_needed_one(sources: list[str], tier: str) -> None:
    assert restores.job_tier(sources) == tier


def test_the_restores_file_lies_beside_the_metrics_file_and_reads_back_whole_lines_only(
    tmp_path: Path,
) -> None:
    paths = JobPaths(tmp_path / "trial-3")
    path = restores.restores_file(paths.metrics)
    assert path == paths.restores
    assert restores.read_restores(path) == []
    first = restores.record_restore(path, 4, ["shared file system"])
    with path.open("a") as handle:
        handle.write("not json\n")
    second = restores.record_restore(path, 9, ["own memory", "peer memory (10.231.0.12:4711)"])
    with path.open("a") as handle:
        handle.write('{"step": 12')  # still being written

    assert restores.read_restores(path) == [first, second]
    assert second.tier == "peer memory" and second.sources == ("own memory", "peer memory (10.231.0.12:4711)")
