"""``num_parallel: auto``: the spec accepts it where a launcher can tell (and says how to fix it where
none can), the Slurm launcher reads the idle nodes of its partition from sinfo (canned output here;
the real sinfo in tests/integration/test_num_parallel.py), the local one this machine's CPUs, and the
tune step resolves it once, checking PBT's population against the number it got."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tunepod.errors import SpecError, TunepodError
from tunepod.hpo.num_parallel import resolve_num_parallel
from tunepod.launch.base import Launcher
from tunepod.launch.local import LocalLauncher
from tunepod.launch.slurm import SlurmLauncher
from tunepod.run_form import RunForm
from tunepod.spec import load_spec
from tunepod.spec.models import SlurmLauncherSpec, TuneSettings, TuneStep
from tunepod.spec.resources import Resources

REPO = Path(__file__).resolve().parents[2]

# sinfo -h -N -o '%N|%P|%t' on a cluster of two partitions, nodes in every kind of state.
SINFO = """\
vm|debug*|idle
n1|nodes|mix
n2|nodes|idle
n3|nodes|idle
n4|nodes|idle~
n5|nodes|idle*
n6|nodes|drain
n7|nodes|alloc
n8|nodes|idle-
"""


class CannedSinfo:
    """A ``CommandRunner`` that answers sinfo with ``SINFO`` and records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        return subprocess.CompletedProcess(list(argv), 0, stdout=SINFO, stderr="")


def slurm(tmp_path: Path, partition: str | None) -> tuple[SlurmLauncher, CannedSinfo]:
    runner = CannedSinfo()
    spec = SlurmLauncherSpec(kind="slurm", root=str(tmp_path), partition=partition)
    return SlurmLauncher(spec, runner), runner


@pytest.mark.parametrize(
    ("partition", "num_nodes", "count", "why"),
    [
        ("nodes", 1, 3, "3 idle nodes in partition nodes / 1 node per trial = 3"),
        ("nodes", 2, 1, "3 idle nodes in partition nodes / 2 nodes per trial = 1"),
        ("nodes", 4, 1, "3 idle nodes in partition nodes / 4 nodes per trial = 1 (at least 1)"),
        (None, 1, 1, "1 idle node in partition debug / 1 node per trial = 1"),
        ("nodes,debug", 2, 2, "4 idle nodes in partition nodes,debug / 2 nodes per trial = 2"),
    ],
)
def test_slurm_slots_are_the_idle_nodes_of_the_partition_per_trial(
    tmp_path: Path, partition: str | None, num_nodes: int, count: int, why: str
) -> None:
    """Idle: ``idle``, and ``idle~`` (powered down, started for a job); not a node that does not
    respond (``idle*``), that backfill holds for a pending job (``idle-``), drained, allocated or mixed."""
    launcher, runner = slurm(tmp_path, partition)
    slots = launcher.trial_slots(Resources(num_nodes=num_nodes))
    assert (slots.count, slots.why) == (count, why)
    assert runner.calls == [["sinfo", "-h", "-N", "-o", "%N|%P|%t"]]


def test_a_partition_sinfo_does_not_list_is_named_with_the_ones_it_does(tmp_path: Path) -> None:
    launcher, _ = slurm(tmp_path, "gpu")
    with pytest.raises(
        TunepodError, match=r"no partition gpu \(partitions: debug\*, nodes\); fix: set launcher"
    ):
        launcher.trial_slots(Resources())


def test_local_slots_are_the_cpus_per_trials_processes(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    launcher = LocalLauncher(tmp_path)
    two = launcher.trial_slots(Resources(procs_per_node=2))
    assert two.count == max(1, cpus // 2)
    assert two.why.endswith(f"/ 2 processes per trial = {two.count}" + (" (at least 1)" if cpus < 2 else ""))
    many = launcher.trial_slots(Resources(procs_per_node=cpus + 1))
    assert many.count == 1 and many.why.endswith("= 1 (at least 1)")


def tune(**overrides: Any) -> TuneSettings:
    raw: dict[str, Any] = {
        "train": {"entrypoint": "train.py", "resources": {"num_nodes": 2}},
        "study": {"name": "s", "metric": "score"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "num_trials": 8,
        "num_parallel": "auto",
    }
    return TuneSettings.model_validate(raw | overrides)


def test_the_tune_step_resolves_auto_once_into_a_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = tune()
    launcher, runner = slurm(tmp_path, "nodes")
    with caplog.at_level("INFO", logger="tunepod"):
        resolved = resolve_num_parallel("search", settings, launcher)
    assert (resolved.num_parallel, resolved.max_parallel, settings.num_parallel) == (1, 1, "auto")
    assert "num_parallel auto: 3 idle nodes in partition nodes / 2 nodes per trial = 1" in caplog.text
    assert resolve_num_parallel("search", resolved, launcher) is resolved  # a number is kept as it is
    assert len(runner.calls) == 1
    with pytest.raises(AssertionError, match="resolved when the tune step starts"):
        _ = settings.max_parallel


def test_pbt_with_auto_loads_and_is_checked_against_the_number_auto_became(tmp_path: Path) -> None:
    settings = tune(pbt={"population": 4, "interval": 2}, num_trials=4)  # not refused at load
    launcher, _ = slurm(tmp_path, "nodes")
    with pytest.raises(TunepodError) as caught:
        resolve_num_parallel("search", settings, launcher)
    message = str(caught.value)
    assert message.startswith("steps.search.with.num_parallel is auto, which is 1 now (3 idle nodes"), message
    assert "num_parallel 1 is below pbt.population 4" in message
    assert "fix: set num_parallel to 4 or lower the population" in message
    fits = tune(pbt={"population": 2, "interval": 2}, num_trials=2, train={"entrypoint": "train.py"})
    assert resolve_num_parallel("search", fits, launcher).num_parallel == 3  # 3 idle nodes, 1 per trial


def test_a_launcher_that_cannot_tell_is_refused_naming_the_field() -> None:
    class Elsewhere:
        kind = "sagemaker"

    launcher: Launcher = Elsewhere()  # type: ignore[assignment]
    with pytest.raises(TunepodError, match=r"steps.search.with.num_parallel is auto, and the sagemaker"):
        resolve_num_parallel("search", tune(), launcher)


@pytest.mark.parametrize(
    "spec", ["examples/digits/pipeline-sagemaker.yaml", "examples/digits/pipeline-hyperpod-eks.yaml"]
)
def test_auto_is_refused_at_load_for_launchers_that_cannot_tell(spec: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(REPO / spec, ["steps.search.with.num_parallel=auto"], base_dir=REPO)
    message = str(caught.value)
    assert "steps.search.with.num_parallel is auto" in message and "cannot tell" in message, message
    assert "fix: give a number, e.g. --set steps.search.with.num_parallel=4" in message, message


@pytest.mark.parametrize("launcher", ["examples/digits/pipeline.yaml", "examples/digits/pipeline-slurm.yaml"])
def test_auto_loads_for_the_local_and_slurm_launchers_through_set_and_the_run_form(launcher: str) -> None:
    overrides = RunForm(num_parallel="auto").overrides(REPO / launcher)
    assert overrides == ["steps.search.with.num_parallel=auto"]
    step = load_spec(REPO / launcher, overrides, base_dir=REPO).steps["search"]
    assert isinstance(step, TuneStep) and step.with_.num_parallel == "auto"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "steps.search.with.num_parallel: must be greater than or equal to 1, got 0"),
        ("ten", "steps.search.with.num_parallel: expected a number of trials or auto, got 'ten'"),
        ("Auto", "expected a number of trials or auto, got 'Auto'"),
    ],
)
def test_a_wrong_num_parallel_says_a_number_or_auto(value: str, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(
            REPO / "examples/digits/pipeline.yaml", [f"steps.search.with.num_parallel={value}"], base_dir=REPO
        )
    assert message in str(caught.value), caught.value
    assert "or auto" in str(caught.value)
