"""Storage faults injected for real into what a job and the orchestrator write: a checkpoint save
SIGKILLed mid-write, and a full filesystem (a size-limited tmpfs the test mounts and fills) under a
checkpoint, the metrics file and the Optuna study journal. Each time the earlier state stays whole."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from tmpfs import MiB, fill, mounted_tmpfs

from tunepod.errors import DiskFullError
from tunepod.hpo.study import make_storage
from tunepod.runtime.checkpoints import copy_newest_checkpoint, load_latest_checkpoint, save_checkpoint
from tunepod.runtime.metrics import append_report, read_reports

REPO = Path(__file__).resolve().parents[2]
STATE_BYTES = 160 * MiB  # pickling and hashing it takes about a second: long enough to be killed in


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted after the test."""
    with mounted_tmpfs(tmp_path / "fs", 4 * MiB) as folder:
        yield folder


def disk_full_message(path: Path, mount: Path) -> str:
    """The start of the error for a write to ``path`` on the full filesystem mounted at ``mount``."""
    return f"no space left writing {path}: " + r"\d+\.\d MiB free on " + f"{mount}; fix: free space"


# ---------------------------------------------------------------------------------------------- kill

SAVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from tunepod.runtime.checkpoints import save_checkpoint
    folder, size = Path(sys.argv[2]), int(sys.argv[3])
    save_checkpoint(folder, b"\\1" * size, 1, keep=3)
    save_checkpoint(folder, b"\\2" * size, 2, keep=3)
    """
)


def half_written_state(checkpoints: Path, saver: subprocess.Popen[bytes]) -> Path:
    """Wait until the save of step 2 has written most of its state, not yet its metadata; its folder."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for temp in checkpoints.glob(".tmp-step-000002-*"):
            state = temp / "state.pt"
            written = state.stat().st_size if state.exists() else 0
            if written >= 0.7 * STATE_BYTES and not (temp / "metadata.json").exists():
                return temp
        assert saver.poll() is None, "the saver ended before it could be killed mid-save"
        time.sleep(0.005)
    raise AssertionError("the save of step 2 never got going")


def test_a_save_killed_mid_write_leaves_the_last_step_and_room_for_the_next_save(tmp_path: Path) -> None:
    # Room for two states and not for a third: the killed save's leftover must not cost the next save
    # its space, nor be taken for a checkpoint.
    with mounted_tmpfs(tmp_path / "fs", int(2.4 * STATE_BYTES)) as fs:
        checkpoints = fs / "checkpoints"
        command = [sys.executable, "-c", SAVER, str(REPO), str(checkpoints), str(STATE_BYTES)]
        saver = subprocess.Popen(command, start_new_session=True)
        try:
            leftover = half_written_state(checkpoints, saver)
            os.killpg(saver.pid, signal.SIGKILL)
        finally:
            if saver.poll() is None:
                os.killpg(saver.pid, signal.SIGKILL)
            saver.wait()
        assert saver.returncode == -signal.SIGKILL
        assert leftover.exists() and not (checkpoints / "step-000002").exists()

        resumed = load_latest_checkpoint(checkpoints)
        assert resumed is not None and resumed.step == 1
        assert resumed.state == b"\1" * STATE_BYTES
        del resumed

        save_checkpoint(checkpoints, b"\3" * STATE_BYTES, 2, keep=3)
        latest = load_latest_checkpoint(checkpoints)
        assert latest is not None and latest.step == 2 and latest.state == b"\3" * STATE_BYTES
        assert sorted(path.name for path in checkpoints.iterdir()) == ["step-000001", "step-000002"]


# ---------------------------------------------------------------------------------------------- full disk


def torch_state() -> Any:
    torch = pytest.importorskip("torch")
    return {"weights": torch.ones(1 << 20, dtype=torch.uint8)}


@pytest.mark.parametrize("make_state", [lambda: b"\7" * MiB, torch_state], ids=["pickle", "torch"])
def test_a_checkpoint_that_does_not_fit_is_explained_and_the_last_step_still_loads(
    small_fs: Path, make_state: Any
) -> None:
    checkpoints = small_fs / "checkpoints"
    save_checkpoint(checkpoints, b"first", 1, keep=3)
    filler = fill(small_fs)

    # torch reports the failed write as a RuntimeError raised from the ENOSPC: found all the same.
    expected = disk_full_message(checkpoints / "step-000002", small_fs) + r".*TUNEPOD_KEEP_CHECKPOINTS, now 3"
    with pytest.raises(DiskFullError, match=expected):
        save_checkpoint(checkpoints, make_state(), 2, keep=3)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-000001"]  # nothing half written
    loaded = load_latest_checkpoint(checkpoints)
    assert loaded is not None and (loaded.step, loaded.state) == (1, b"first")

    filler.unlink()
    save_checkpoint(checkpoints, b"second", 2, keep=3)
    loaded = load_latest_checkpoint(checkpoints)
    assert loaded is not None and (loaded.step, loaded.state) == (2, b"second")


def test_a_donor_copy_that_does_not_fit_raises_and_leaves_nothing(tmp_path: Path, small_fs: Path) -> None:
    """PBT's copy of a donor's step gives up a step its job pruned mid-copy and takes the next; a copy
    that fails while the donor's files are all there (here a full disk) is no prune and must raise,
    not be retried until it reads as "the donor has no checkpoint"."""
    donor = tmp_path / "donor"
    save_checkpoint(donor, b"\5" * (8 * MiB), 1, keep=1)
    with pytest.raises(shutil.Error, match="No space left on device"):
        copy_newest_checkpoint(donor, small_fs / "seed")
    assert list((small_fs / "seed").iterdir()) == []  # the partial copy is gone


def test_a_report_that_does_not_fit_is_cut_off_whole_and_explained(small_fs: Path) -> None:
    metrics = small_fs / "metrics.jsonl"
    for step in range(3):
        append_report(metrics, step, {"loss": 1.0 / (step + 1)})
    before = metrics.read_bytes()
    filler = fill(small_fs)

    # Longer than what is left of the file's last page: the write comes up short, then fails.
    wide = {f"metric_{index}": float(index) for index in range(400)}
    with pytest.raises(DiskFullError, match=disk_full_message(metrics, small_fs)):
        append_report(metrics, 3, wide)
    assert metrics.read_bytes() == before  # no half line
    assert [report.step for report in read_reports(metrics)] == [0, 1, 2]

    filler.unlink()
    append_report(metrics, 3, wide)
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]


def finish_trial(study: optuna.Study, value: float) -> None:
    trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    study.tell(trial, value)


def test_a_study_journal_on_a_full_disk_is_explained_and_still_loads_every_trial(small_fs: Path) -> None:
    journal = small_fs / "optuna.log"
    study = optuna.create_study(study_name="s", storage=make_storage(f"journal://{journal}"))
    for value in (0.3, 0.2):
        finish_trial(study, value)
    filler = fill(small_fs)

    trial = study.ask()  # a short line still fits in the journal's last page
    before = journal.read_bytes()
    with pytest.raises(DiskFullError, match=disk_full_message(journal, small_fs) + ".*study.storage"):
        trial.set_user_attr("notes", "n" * 8192)
    assert journal.read_bytes() == before  # the part of the line that fitted was cut back off

    filler.unlink()
    finish_trial(study, 0.1)  # appends after the failed one must not be glued onto a torn line
    reloaded = optuna.load_study(study_name="s", storage=make_storage(f"journal://{journal}"))
    completed = [t.value for t in reloaded.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert completed == [0.3, 0.2, 0.1]
    assert "notes" not in reloaded.trials[2].user_attrs
