"""The local test Slurm cluster that ``scripts/slurm-up`` starts: is it up, and how tests reach it.

The cluster is this host (partition ``debug``, the default) plus namespaced nodes ``n1..nN`` (partition
``nodes``): each a slurmd in network, UTS and mount namespaces of its own, with its own address and
hostname (``scripts/slurm/common.sh``). Clients find its config at Slurm's default path
(``/etc/slurm/slurm.conf``), so plain ``sbatch``/``scontrol`` reach it. Jobs run as the submitting
user on this host's file systems, so a test's ``tmp_path`` is a shared filesystem, as FSx is to
cluster nodes.

Marker recipe (``tests/conftest.py``)::

    from slurm_cluster import apply_slurm_marker

    def pytest_runtest_setup(item: pytest.Item) -> None:
        apply_slurm_marker(item)

A test marked ``@pytest.mark.slurm`` then skips with the reason when the cluster is not up, and fails
instead when ``CI=true``: CI starts the cluster (``.ci/run``), so a skip there would hide a broken one.
``@pytest.mark.slurm_nodes(N)`` does the same for N namespaced nodes; such a test may kill nodes
(``kill_node``), and ``restore_nodes`` brings every node back after it.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from needs import skip_or_fail

SLURM_UP = "scripts/slurm-up"
SLURM_NODE = Path(__file__).resolve().parents[1] / "scripts" / "slurm-node"
PARTITION = "debug"
NODE_PARTITION = "nodes"
LOG_DIR = "/var/log/tunepod-slurm"
RUN_DIR = "/run/tunepod-slurm"
#: Node states in which a job can start now.
# A node busy with someone's jobs (allocated, completing) still serves the tests: they wait in the queue.
READY_NODE_STATES = frozenset({"idle", "mixed", "allocated", "completing"})
#: States a job never leaves (``scontrol show job`` keeps them for MinJobAge = 1 h).
FINAL_JOB_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


def slurm_available() -> str | None:
    """None when ``sinfo`` answers with a usable node, else why the cluster is not usable."""
    if shutil.which("sinfo") is None:
        return f"Slurm is not installed (no sinfo on PATH); start the test cluster with {SLURM_UP}"
    try:
        answer = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format=%N %T"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer within 15 s; is slurmctld up? ({SLURM_UP}, logs in {LOG_DIR})"
    if answer.returncode != 0:
        return f"sinfo failed: {answer.stderr.strip()} ({SLURM_UP}, logs in {LOG_DIR})"
    nodes = [line.split() for line in answer.stdout.splitlines() if line.strip()]
    if any(state in READY_NODE_STATES for _, state in nodes):
        return None
    listed = ", ".join(f"{name} {state}" for name, state in nodes) or "no nodes"
    return f"no usable Slurm node ({listed}); logs in {LOG_DIR}"


@functools.cache
def _cached_slurm_available() -> str | None:
    # Asked once per session: sinfo costs a process start, and the cluster is not expected to change.
    return slurm_available()


def apply_slurm_marker(item: pytest.Item) -> None:
    """For a test marked ``slurm`` or ``slurm_nodes(N)``: skip it when the cluster (or N namespaced
    nodes) is not up, or fail it when ``CI=true``.

    Call from ``pytest_runtest_setup``; a no-op for unmarked tests.
    """
    nodes = item.get_closest_marker("slurm_nodes")
    if item.get_closest_marker("slurm") is None and nodes is None:
        return
    reason = _cached_slurm_available()
    if reason is not None:
        skip_or_fail(f"the Slurm cluster is not up: {reason}")
    if nodes is not None:
        wanted = nodes.args[0] if nodes.args else 2
        found = namespaced_nodes()
        if len(found) < wanted:
            skip_or_fail(
                f"the test needs {wanted} namespaced Slurm nodes (partition {NODE_PARTITION}), the "
                f"cluster has {len(found)}; start them with {SLURM_UP} --nodes {max(wanted, 4)}"
            )


def node_states() -> dict[str, str]:
    """State of each namespaced node (partition ``nodes``), e.g. ``{"n1": "idle", "n2": "down*"}``."""
    listed = subprocess.run(
        ["sinfo", "--noheader", "--Node", f"--partition={NODE_PARTITION}", "--format=%N %T"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return dict(line.split() for line in listed.stdout.splitlines() if len(line.split()) == 2)


def namespaced_nodes() -> list[str]:
    """The namespaced nodes Slurm knows (``n1``, ``n2``, ...), in order."""
    return sorted(node_states(), key=lambda name: int(name.removeprefix("n")))


def job_nodes(job_id: str) -> list[str]:
    """The nodes a running job holds (``scontrol show hostnames`` of its node list)."""
    node_list = show_job(job_id).get("NodeList", "")
    if not node_list or node_list == "(null)":
        return []
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", node_list], capture_output=True, text=True, timeout=30, check=True
    )
    return hosts.stdout.split()


def slurm_node(command: str, node: str) -> str:
    """``scripts/slurm-node COMMAND NODE`` (kill, start, cut, mend); returns what it printed."""
    done = subprocess.run(
        [str(SLURM_NODE), command, node], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"slurm-node {command} {node} failed: {done.stdout}{done.stderr}"
    return done.stdout


def kill_node(node: str) -> None:
    """A node's power cut: SIGKILL every process in its namespaces (its slurmd, job steps, trainers)."""
    slurm_node("kill", node)


def node_memory(node: str) -> Path:
    """Node ``node``'s own ``/dev/shm`` (a tmpfs in its mount namespace, ``scripts/slurm/common.sh``),
    seen from this host through its slurmd's ``/proc/<pid>/root``: what a job step on the node sees
    as ``/dev/shm``. The node's slurmd must be running."""
    pid_file = Path(RUN_DIR) / f"slurmd-{node}.pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        pytest.fail(f"node {node}'s slurmd is not running (no pid in {pid_file}); its memory is gone")
    return Path(f"/proc/{pid}/root/dev/shm")


def wait_for_node(node: str, states: frozenset[str], timeout_s: float = 90) -> str:
    """Polls until the node's state (``idle``, ``down*``, ...) is one of ``states``; returns it. The
    timeout is a bound against a hang, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = node_states().get(node, "unknown")
        if state in states:
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"node {node} is still {state} after {timeout_s} s, not one of {sorted(states)}")
        time.sleep(0.5)


def restore_nodes() -> None:
    """Every namespaced node back in service: its slurmd started, its link up, resumed when Slurm still
    holds it down or drained, and idle (or busy with someone's jobs)."""
    for node in namespaced_nodes():
        slurm_node("mend", node)
        slurm_node("start", node)
    for node, state in node_states().items():
        if state.startswith(("down", "drain")):
            subprocess.run(
                ["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=30
            )
    for node in namespaced_nodes():
        wait_for_node(node, READY_NODE_STATES)


def sbatch(*options: str) -> str:
    """Submits a job with ``sbatch --parsable`` plus ``options``; returns its job id."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", *options], capture_output=True, text=True, timeout=30, check=False
    )
    assert submitted.returncode == 0, f"sbatch {' '.join(options)} failed: {submitted.stderr}"
    return submitted.stdout.strip().split(";")[0]


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol --oneliner show job`` as a dict (JobState, ExitCode, Restarts, NodeList, ...).

    The line is split at spaces, so a value holding one (a path with a space) is cut short; the
    state, exit code and count fields never hold one.
    """
    shown = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job_id],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert shown.returncode == 0, f"scontrol show job {job_id} failed: {shown.stderr}"
    fields = {}
    for token in shown.stdout.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def wait_for_job(
    job_id: str, states: frozenset[str] = FINAL_JOB_STATES, timeout_s: float = 60
) -> dict[str, str]:
    """Polls until the job's state is one of ``states``; returns its fields. Fails after ``timeout_s``,
    which is a bound against hanging, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while True:
        fields = show_job(job_id)
        if fields.get("JobState") in states:
            return fields
        if time.monotonic() > deadline:
            pytest.fail(f"slurm job {job_id} is still {fields.get('JobState')} after {timeout_s} s: {fields}")
        time.sleep(0.2)


def scancel(job_id: str) -> None:
    """Cancels a job; a job that already ended is not an error."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
