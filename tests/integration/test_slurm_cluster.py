"""The local Slurm cluster from ``scripts/slurm-up`` does what the Slurm launcher relies on: jobs run
and report final states and exit codes through ``scontrol show job``, a requeued job runs again, and
1-core jobs share the node; its namespaced nodes are nodes of their own (hostname, address, slurmd,
memory), and a killed one comes back with its memory lost. Plus the skip-or-fail rule of the
``slurm`` marker and the scripts' argument errors, which need no cluster."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import (
    NODE_PARTITION,
    READY_NODE_STATES,
    kill_node,
    node_memory,
    node_states,
    restore_nodes,
    sbatch,
    scancel,
    show_job,
    slurm_node,
    wait_for_job,
    wait_for_node,
)

from tunepod.launch.base import JobState
from tunepod.launch.slurm import SlurmStatus, parse_squeue
from tunepod.launch.slurm.states import SQUEUE_FIELDS

TESTS_DIR = Path(__file__).resolve().parents[1]
SCRIPTS = TESTS_DIR.parent / "scripts"
# Small explicit requests: the node's default memory per CPU is half the host, and the tests must
# not depend on it.
ONE_CORE = ("--ntasks=1", "--cpus-per-task=1", "--mem=64M")


def queued_status(job_id: str) -> SlurmStatus:
    """What the launcher's squeue poll reads of ``job_id``."""
    argv = ["squeue", "-h", "-o", SQUEUE_FIELDS, "-j", job_id]
    listed = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout
    return parse_squeue(listed)[job_id]


def wait_for_lines(path: Path, count: int, job_id: str, timeout_s: float = 60) -> list[str]:
    """Polls until ``path`` has ``count`` lines; ``timeout_s`` bounds a hang, it checks no speed."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        if time.monotonic() > deadline:
            pytest.fail(f"{path} has {len(lines)} of {count} lines after {timeout_s} s: {show_job(job_id)}")
        time.sleep(0.2)


@pytest.mark.slurm
@pytest.mark.timeout(180)
class TestLocalSlurmCluster:
    def test_a_job_that_writes_a_file_completes_with_exit_code_0(self, tmp_path: Path) -> None:
        written = tmp_path / "written.txt"
        job_id = sbatch(*ONE_CORE, f"--chdir={tmp_path}", "--output=job.log", f"--wrap=echo ran > {written}")

        fields = wait_for_job(job_id)

        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0")
        assert written.read_text() == "ran\n"

    def test_a_failing_job_reports_failed_with_its_exit_code(self, tmp_path: Path) -> None:
        job_id = sbatch(*ONE_CORE, f"--chdir={tmp_path}", "--output=job.log", "--wrap=exit 3")

        fields = wait_for_job(job_id)

        assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "3:0")

    def test_a_requeued_running_job_runs_again(self, tmp_path: Path) -> None:
        starts = tmp_path / "starts.txt"
        script = tmp_path / "job.sh"
        script.write_text(
            f'#!/bin/sh\necho "start ${{SLURM_RESTART_COUNT:-0}}" >> {starts}\nexec sleep 300\n'
        )
        job_id = sbatch(*ONE_CORE, "--requeue", f"--chdir={tmp_path}", "--output=job.log", str(script))
        try:
            wait_for_lines(starts, 1, job_id)
            first_run = queued_status(job_id)
            subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, timeout=30)

            # A requeued job waits for its revoked credential to expire: AuthInfo=cred_expire=10.
            lines = wait_for_lines(starts, 2, job_id)

            assert lines == ["start 0", "start 1"]
            assert show_job(job_id)["Restarts"] == "1"
            # The launcher's run mark (squeue's start time) tells the two runs apart, as a driver that
            # saw neither the requeue nor the job queued needs it to.
            second_run = queued_status(job_id)
            assert first_run.job_state is second_run.job_state is JobState.RUNNING
            assert first_run.start_time and second_run.start_time > first_run.start_time
        finally:
            scancel(job_id)

    def test_two_one_core_jobs_run_at_the_same_time(self, tmp_path: Path) -> None:
        # Each job marks that it started, then waits up to 60 s for the other's mark: both complete
        # with exit 0 only when both ran at once. Whole-node scheduling would hold one back until the
        # other gave up waiting (exit 7). The 60 s leave room for someone else's job on the node.
        script = tmp_path / "meet.sh"
        script.write_text(
            "#!/bin/sh\n"
            'touch "$1.started"\n'
            "for _ in $(seq 600); do\n"
            '  [ -e "$2.started" ] && exit 0\n'
            "  sleep 0.1\n"
            "done\n"
            "exit 7\n"
        )
        first = sbatch(*ONE_CORE, f"--chdir={tmp_path}", "--output=first.log", str(script), "first", "second")
        second = sbatch(
            *ONE_CORE, f"--chdir={tmp_path}", "--output=second.log", str(script), "second", "first"
        )
        try:
            results = [wait_for_job(job_id, timeout_s=120) for job_id in (first, second)]

            assert [(r["JobState"], r["ExitCode"]) for r in results] == [("COMPLETED", "0:0")] * 2
        finally:
            scancel(first)
            scancel(second)


@pytest.mark.slurm_nodes(4)
@pytest.mark.timeout(240)
class TestNamespacedNodes:
    def test_sinfo_lists_four_nodes_ready_in_partition_nodes(self) -> None:
        states = node_states()

        assert [f"n{i}" for i in range(1, 5)] == sorted(states)[:4], states
        assert all(state in READY_NODE_STATES for state in states.values()), states

    def test_the_tasks_of_a_four_node_job_run_on_four_nodes_with_their_own_name_and_address(
        self, tmp_path: Path
    ) -> None:
        job_id = sbatch(
            f"--partition={NODE_PARTITION}", "--nodes=4", "--ntasks-per-node=1", "--mem=16M",
            f"--chdir={tmp_path}", "--output=job.log",
            "--wrap=srun sh -c 'echo $SLURMD_NODENAME $(hostname) $(hostname -i)'",
        )  # fmt: skip

        assert wait_for_job(job_id)["JobState"] == "COMPLETED"
        lines = sorted(tuple(line.split()) for line in (tmp_path / "job.log").read_text().splitlines())
        assert lines == [(f"n{i}", f"n{i}", f"10.231.0.{10 + i}") for i in range(1, 5)], lines

    def test_a_killed_node_goes_down_and_takes_jobs_again_once_its_slurmd_starts(
        self, tmp_path: Path
    ) -> None:
        try:
            kill_node("n4")
            wait_for_node("n4", frozenset({"down*", "down"}))
            slurm_node("start", "n4")
            wait_for_node("n4", READY_NODE_STATES)
            job_id = sbatch(
                f"--partition={NODE_PARTITION}", "--nodelist=n4", "--mem=16M", f"--chdir={tmp_path}",
                "--output=job.log", "--wrap=hostname",
            )  # fmt: skip
            assert wait_for_job(job_id)["JobState"] == "COMPLETED"
            assert (tmp_path / "job.log").read_text().split() == ["n4"]
        finally:
            restore_nodes()

    def test_each_node_has_memory_of_its_own_and_a_killed_node_loses_it(self, tmp_path: Path) -> None:
        """What a job step writes to ``/dev/shm`` stays on its node: each node's is a tmpfs of its own
        (not this host's, not another node's); killing the node frees it, and the node starts again
        with an empty one while the other nodes keep theirs."""
        marker = f"tunepod-test-{os.getpid()}-{tmp_path.name}"
        nodes = [f"n{i}" for i in range(1, 5)]
        job_id = sbatch(
            f"--partition={NODE_PARTITION}", "--nodes=4", "--ntasks-per-node=1", "--mem=16M",
            f"--chdir={tmp_path}", "--output=job.log",
            # Every task writes its mark, then (once all have) lists the marks it sees.
            f"--wrap=srun sh -c 'touch /dev/shm/{marker}-$SLURMD_NODENAME; sleep 2; "
            f"echo $SLURMD_NODENAME $(cd /dev/shm && ls -d {marker}-*)'",
        )  # fmt: skip
        try:
            assert wait_for_job(job_id)["JobState"] == "COMPLETED"
            seen = sorted(tuple(line.split()) for line in (tmp_path / "job.log").read_text().splitlines())
            assert seen == [(node, f"{marker}-{node}") for node in nodes], seen
            assert not list(Path("/dev/shm").glob(f"{marker}-*")), "a node wrote to this host's /dev/shm"
            devices = {node_memory(node).stat().st_dev for node in nodes} | {Path("/dev/shm").stat().st_dev}
            assert len(devices) == 5, "two nodes, or a node and this host, share one /dev/shm"

            killed_slurmd = node_memory("n4").parent.parent
            kill_node("n4")
            deadline = time.monotonic() + 30
            while killed_slurmd.exists():  # its slurmd gone: the node's port is free for the next one
                assert time.monotonic() < deadline, "node n4's slurmd outlived SIGKILL for 30 s"
                time.sleep(0.1)
            slurm_node("start", "n4")

            assert not (node_memory("n4") / f"{marker}-n4").exists(), "node n4's memory outlived its kill"
            assert (node_memory("n3") / f"{marker}-n3").exists(), "node n3 lost its memory with n4"
        finally:
            for node in nodes:
                with contextlib.suppress(OSError, pytest.fail.Exception):
                    (node_memory(node) / f"{marker}-{node}").unlink(missing_ok=True)
            restore_nodes()


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["slurm-up", "--nodes", "two"], "--nodes must be a whole number from 0 to 64, not 'two'"),
        (["slurm-up", "--nodes", "65"], "--nodes must be a whole number from 0 to 64, not '65'"),
        (["slurm-up", "--fast"], "unknown argument '--fast'"),
        (["slurm-node", "kill"], "usage:"),
        (["slurm-node", "reboot", "n1"], None),
    ],
)
def test_the_cluster_scripts_refuse_bad_arguments_and_say_why(
    command: list[str], message: str | None
) -> None:
    """Refused before anything is touched (no root needed, no cluster changed)."""
    done = subprocess.run(
        [str(SCRIPTS / command[0]), *command[1:]], capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode != 0, done.stdout
    if message is None:  # an unknown command, or an unknown node where the namespaced nodes are down
        assert "unknown command 'reboot'" in done.stderr or "no namespaced node 'n1'" in done.stderr, (
            done.stderr
        )
    else:
        assert message in done.stderr, done.stderr


CONFTEST_USING_THE_RECIPE = """
import pytest
from slurm_cluster import apply_slurm_marker

def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster")

def pytest_runtest_setup(item):
    apply_slurm_marker(item)
"""

MARKED_TEST = """
import pytest

@pytest.mark.slurm
def test_needs_slurm():
    pass

def test_unmarked():
    pass
"""


def run_marked_test_without_slurm(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    """Runs a slurm-marked test in a child pytest whose PATH has no sinfo, as on a machine without
    the cluster."""
    (tmp_path / "conftest.py").write_text(CONFTEST_USING_THE_RECIPE)
    (tmp_path / "test_marked.py").write_text(MARKED_TEST)
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    env |= {"PATH": str(tmp_path), "PYTHONPATH": str(TESTS_DIR), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_slurm_test_skips_with_the_reason_when_the_cluster_is_not_up(tmp_path: Path) -> None:
    child = run_marked_test_without_slurm(tmp_path, ci=None)

    assert child.returncode == 0, child.stdout
    assert "1 passed, 1 skipped" in child.stdout
    assert "no sinfo on PATH" in child.stdout


def test_a_slurm_test_fails_under_ci_when_the_cluster_is_not_up(tmp_path: Path) -> None:
    child = run_marked_test_without_slurm(tmp_path, ci="true")

    # pytest.fail in setup reports an error, not a failure: either way the run fails.
    assert child.returncode == 1, child.stdout
    assert "1 passed, 1 error" in child.stdout
    assert "CI=true: the Slurm cluster is not up" in child.stdout
