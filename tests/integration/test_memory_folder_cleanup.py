"""A local job with checkpoint tiers that ends without ``ctx.finish`` (here: SIGKILLed) leaves no
memory folder behind: the launcher removes it once the job has ended for good.

Before, only ``ctx.finish`` removed it, so every killed, failed or cancelled trial left its newest
memory steps in ``/dev/shm`` (the configured ``memory_dir``) until the machine rebooted. The kill is
real: SIGKILL to the job's process group (its wrapper, which records nothing, and the trainer).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from launcher_contract import finish, fixture_job, wait_until

from tunepod import runtime
from tunepod.launch.base import JobState
from tunepod.launch.local import LocalLauncher
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.runtime.memory_store import job_folder
from tunepod.runtime.tiers import CheckpointTiers

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(180)

LAST_STEP = 3


def test_a_killed_local_job_leaves_no_memory_folder(tmp_path: Path) -> None:
    """Fault: the job, holding memory steps 2 and 3 (the newest two it keeps), is SIGKILLed as a
    process group before it could call ``ctx.finish``.

    Proves: the job ends FAILED, and its memory folder is gone from its ``memory_dir`` once the
    launcher has seen it end; the shared folder keeps its shared step (0) for the next attempt."""
    memory_dir, out, job_dir = tmp_path / "shm", tmp_path / "out", tmp_path / "job"
    out.mkdir()
    tiers = CheckpointTiers(
        memory_every_steps=1, shared_every_steps=10, memory_replicas=0, memory_dir=str(memory_dir)
    )
    job = fixture_job(job_dir, "memory_tier.py", "whole", str(LAST_STEP), "hold").with_env(
        {runtime.CHECKPOINT_TIERS_ENV: tiers.to_json(), "TEST_OUT": str(out), "TEST_NODE": "a"}
    )
    handle = LocalLauncher(tmp_path / "root").submit(job)
    wait_until(lambda: (out / "ready-a.json").exists() or handle.state().is_terminal, "memory step 3")
    folder = job_folder(memory_dir, JobPaths(job_dir).checkpoints)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002", "step-000003"], handle.logs()

    record = read_submission(JobPaths(job_dir))
    assert record is not None
    os.killpg(int(record.details["pid"]), signal.SIGKILL)

    assert finish(handle) == JobState.FAILED
    assert not folder.exists()
    assert sorted(p.name for p in JobPaths(job_dir).checkpoints.iterdir()) == ["step-000000"]
