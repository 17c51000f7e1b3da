"""``python -m benchmarks.node_loss``: on the local Slurm cluster's namespaced nodes (``scripts/slurm-up``),
the time from a node's death to the trial's next trained step, split into its parts, side by side with
a planned ``scontrol requeue`` of the same job (the baseline: the same restart and checkpoint load,
with no node lost and nothing to detect).

Each run is one ``tunepod run`` of a one-trial study whose job spans two nodes (one rank per node,
``trainer.py``: an all-reduce, a report and a ``--state-mb`` checkpoint per step). After the third
report the fault strikes: the first node killed (``scripts/slurm-node kill``: the batch script and the
rendezvous die with it), the second node killed, or the job requeued. A poller reads Slurm every
0.2 s; the trainer records when its process group formed and its checkpoint was loaded.

Three more scenarios put the ways back from a lost node side by side (the issue's line ``node-loss
recovery: peer memory S s, shared file system S s, elastic S s``):

- ``peer-memory``: checkpoint tiers (every step to node memory, copied to the other node; every 10th
  to the shared file system), the first node killed; the requeued job's rank 0, on the restarted node
  with empty memory, fetches the newest step from the surviving node's memory;
- ``shared``: no memory tier (every step to the shared file system, as before tiers), the first node
  killed; the requeued job reads the shared file system;
- ``elastic``: the tiers of ``peer-memory`` and ``resources.min_nodes: 1``, the second node killed
  (the first runs the batch script and the rendezvous: an elastic job cannot outlive it); the
  survivor's torchrun agent re-forms the group alone in the same job, no requeue.

For ``peer-memory`` and ``shared`` the other two nodes are held by sleeping jobs and the killed node is
started again (empty memory, as a rebooted node) once Slurm has it down, so the requeued job comes back
to the same two nodes in both, and its peer's memory is there. For ``elastic`` detection, teardown and
queue wait are 0 by construction; restart is the fault to the re-formed group (torchrun's agent seeing
the failed all-reduce, stopping the worker, the rendezvous round, the script's start). The parts:

- detection: the fault -> the node DOWN (SlurmdTimeout; 0 for the requeue);
- teardown: DOWN -> the job back in the queue (the survivors' steps killed, KillWait);
- queue wait: queued -> running again (a requeued job waits for its credential to expire);
- restart: running -> the process group formed on the new nodes (srun, torchrun, imports, rendezvous);
- checkpoint load, and first step: to the first report after the restart.

Goal: under 60 s from the node's death to the next trained step. Every killed node is started again
before the next run (and on the way out). Exit 0, or 1 when a run failed; a missed goal is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from benchmarks.chaos import nodes
from benchmarks.chaos.faults import slurm_state
from benchmarks.chaos.nodes import job_nodes, node_states
from benchmarks.chaos.study import NODE_PARTITION
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.runtime import read_reports
from tunepod.runtime.restores import read_restores

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().parent / "trainer.py"
GOAL_S = 60.0
POLL_S = 0.2
RUN_LIMIT_S = 420.0
STARTUP_S = 600.0
"""How long the trial may take to report three steps: on a loaded 2-core host a temporary Prefect
server, the stage step and two nodes' torchrun start take minutes."""
ELASTIC = "elastic"
RECOVERIES = {"peer-memory": "peer memory", "shared": "shared file system", ELASTIC: "elastic"}
"""The scenarios of the ``node-loss recovery`` line, and how it names them."""
PEER_OVER_SHARED_GOAL = 1 / 3
TIERS = {"memory_every_steps": 1, "shared_every_steps": 10, "memory_replicas": 1}
"""Every step to node memory and to the other node's; every 10th (steps 0, 10) to the shared folder."""


@dataclass(frozen=True)
class Scenario:
    side: str
    what: str
    victim: int | None
    """The index of the killed node among the job's nodes; None: ``scontrol requeue``, no node lost."""
    tiers: bool = False
    elastic: bool = False
    held: bool = False
    """The other nodes held by sleeping jobs, the killed node started again once down."""


SCENARIOS = {
    "requeue": Scenario("baseline", "scontrol requeue of the running job (no node lost)", None),
    "kill-first": Scenario("tunepod", "first node killed: batch script and rendezvous with it", 0),
    "kill-second": Scenario("tunepod", "second node killed", 1),
    "peer-memory": Scenario("tunepod", "first node killed, restore from a peer's memory", 0, True, held=True),
    "shared": Scenario("tunepod", "first node killed, restore from the shared file system", 0, held=True),
    ELASTIC: Scenario("tunepod", "second node killed, elastic: the survivor goes on", 1, True, True),
}  # fmt: skip
PARTS = ("detection", "teardown", "queue wait", "restart", "checkpoint load", "first step")
console = Console(highlight=False, soft_wrap=True, width=max(170, Console().width))


@dataclass
class Timeline:
    """Wall-clock times (this host's clock, which the nodes share) of one run's events."""

    scenario: str
    victim: str
    fault_at: float
    seen: dict[str, float] = field(default_factory=dict)
    """First time the poller saw: ``down`` (the victim node), ``queued``, ``running`` (the job again)."""
    started_at: float = 0.0
    loaded_at: float = 0.0
    resumed_from: int = -1
    step_at: float = 0.0
    reached: int = -1
    """The newest step reported before the fault: the steps after ``resumed_from`` up to it are lost."""
    restored_from: str = "-"
    """The tier of the job's last restore (its restores file); ``-`` without checkpoint tiers."""

    def parts(self) -> dict[str, float]:
        if self.scenario == ELASTIC:  # no requeue: the job never left its nodes nor the queue
            return {
                "detection": 0.0, "teardown": 0.0, "queue wait": 0.0,
                "restart": self.started_at - self.fault_at,
                "checkpoint load": self.loaded_at - self.started_at,
                "first step": self.step_at - self.loaded_at,
            }  # fmt: skip
        detected = self.seen.get("down", self.fault_at) if self.scenario != "requeue" else self.fault_at
        queued = self.seen["queued"]
        return {
            "detection": detected - self.fault_at,
            "teardown": queued - detected,
            "queue wait": self.seen["running"] - queued,
            "restart": self.started_at - self.seen["running"],
            "checkpoint load": self.loaded_at - self.started_at,
            "first step": self.step_at - self.loaded_at,
        }

    @property
    def total_s(self) -> float:
        return self.step_at - self.fault_at


def checked(failure: str) -> None:
    """A node command's outcome (``benchmarks.chaos.nodes``: '' or why it failed) as an error."""
    if failure:
        raise RuntimeError(failure)


def restore(node: str) -> None:
    """The node back in service, idle, before the next run."""
    checked(nodes.start(node))
    deadline = time.monotonic() + 90
    while node_states().get(node) != "idle":
        if node_states().get(node, "").startswith(("down", "drain")):
            nodes.resume(node)
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {node} is {node_states().get(node)} 90 s after its slurmd started")
        time.sleep(0.5)


def write_spec(folder: Path, steps: int, state_mb: float, scenario: Scenario) -> Path:
    train: dict[str, object] = {
        "entrypoint": str(TRAINER),
        "args": {"steps": steps, "sleep_s": 1.0, "state_mb": state_mb},
        "resources": {"num_nodes": 2, "procs_per_node": 1} | ({"min_nodes": 1} if scenario.elastic else {}),
        "max_restarts": 1,
    }
    if scenario.tiers:
        train["checkpoints"] = TIERS
    spec = {
        "name": "node-loss",
        "tracking": {"uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": "node-loss"},
        "launcher": {
            "kind": "slurm", "root": str(folder / "shared"), "python": sys.executable,
            "poll_cache_s": 0.2, "partition": NODE_PARTITION, "exclusive": True,
        },
        "steps": {
            "data": {"uses": "stage", "with": {"source": str(TRAINER.parent), "target": "fsx:///datasets/x"}},
            "search": {
                "uses": "tune", "needs": ["data"],
                "with": {
                    "train": train,
                    "study": {
                        "name": "loss", "storage": f"journal://{folder / 'optuna.log'}", "metric": "loss",
                        "direction": "minimize",
                    },
                    "space": {"unused": {"type": "float", "low": 0.0, "high": 1.0}},
                    "num_trials": 1, "num_parallel": 1, "sampler": "random", "seed": 1, "poll_s": 0.2,
                },
            },
        },
    }  # fmt: skip
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class Poller(threading.Thread):
    """Records when the victim node is first DOWN, and when the job is first back in the queue and
    then running again, after the fault."""

    def __init__(self, job_id: str, victim: str) -> None:
        super().__init__(daemon=True)
        self.job_id, self.victim = job_id, victim
        self.seen: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.time()
            if node_states().get(self.victim, "").startswith("down"):
                self.seen.setdefault("down", now)
            state = slurm_state(self.job_id)
            if state in ("PENDING", "REQUEUED", "CONFIGURING"):
                self.seen.setdefault("queued", now)
            elif state == "RUNNING" and "queued" in self.seen:
                self.seen.setdefault("running", now)
            time.sleep(POLL_S)


def run_once(name: str, folder: Path, steps: int, state_mb: float) -> Timeline:
    scenario = SCENARIOS[name]
    spec = write_spec(folder, steps, state_mb, scenario)
    paths = JobPaths(folder / "shared" / "jobs" / "loss" / "trial-0")
    log = folder / "tunepod-run.log"
    with log.open("wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "tunepod.cli", "run", str(spec)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    victim = ""
    held: list[str] = []
    try:
        job_id = wait_for_reports(paths, run, log)
        trial_nodes = job_nodes(job_id)
        victim = "" if scenario.victim is None else trial_nodes[scenario.victim]
        if scenario.held:
            held = hold_others(trial_nodes, folder)
        poller = Poller(job_id, victim)
        poller.start()
        reached = max(report.step for report in read_reports(paths.metrics))
        fault_at = time.time()
        if victim:
            checked(nodes.kill(victim))
        else:
            subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, timeout=30)
        if scenario.held:
            restart_when_down(victim, poller)
        code = run.wait(timeout=RUN_LIMIT_S)
        poller.done.set()
        if code != 0:
            raise RuntimeError(f"`tunepod run` exited {code}; its output: {log}")
        return timeline(name, victim, fault_at, poller.seen, paths, reached)
    finally:
        if run.poll() is None:
            run.kill()
        for job in held:
            subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
        if victim:
            restore(victim)


def hold_others(trial_nodes: list[str], folder: Path) -> list[str]:
    """A sleeping job on every node of the partition but the trial's, running before the fault: the
    requeued trial can only come back to its own nodes, where its peer's memory is. Their job ids."""
    held = []
    for node in node_states():
        if node in trial_nodes:
            continue
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--partition={NODE_PARTITION}", "--exclusive", "--mem=16M",
             f"--nodelist={node}", "--job-name=node-loss-hold", f"--chdir={folder}", "--output=/dev/null",
             "--wrap=sleep 900"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        held.append(submitted.stdout.strip().split(";")[0])
    deadline = time.monotonic() + 60
    while not all(slurm_state(job) == "RUNNING" for job in held):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the holding jobs {held} did not start in 60 s")
        time.sleep(POLL_S)
    return held


def restart_when_down(victim: str, poller: Poller) -> None:
    """Once Slurm has the killed node down, start it again (a rebooted node: its memory empty), so the
    requeued job can come back to it. Started earlier, Slurm might never see it down."""
    deadline = time.monotonic() + 120
    while "down" not in poller.seen:
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {victim} was not seen down 120 s after its kill")
        time.sleep(POLL_S)
    restore(victim)


def wait_for_reports(paths: JobPaths, run: subprocess.Popen[bytes], log: Path) -> str:
    """The job id once the trial has reported three steps (it is then mid-training, checkpointed)."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        record = read_submission(paths) if paths.job_dir.exists() else None
        if record is not None and record.job_id and len(read_reports(paths.metrics)) >= 3:
            return record.job_id
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the trial never reported 3 steps; `tunepod run` output: {log}")
        time.sleep(POLL_S)


def timeline(
    name: str, victim: str, fault_at: float, seen: dict[str, float], paths: JobPaths, reached: int
) -> Timeline:
    starts = [line.split() for line in (paths.job_dir / "starts.log").read_text().splitlines()]
    if len(starts) < 2:
        raise RuntimeError(f"{name}: the trial's script did not start again: {starts}")
    if name == ELASTIC and "queued" in seen:
        raise RuntimeError(f"{name}: the elastic job was requeued: {seen}")
    if name != ELASTIC and ("queued" not in seen or "running" not in seen):
        raise RuntimeError(f"{name}: the job was not seen requeued and started again: {seen}, {starts}")
    started, loaded, step = starts[-1]
    after = [r for r in read_reports(paths.metrics) if r.time > float(loaded)]
    restores = read_restores(paths.restores)
    return Timeline(
        name, victim, fault_at, seen, float(started), float(loaded), int(step), after[0].time, reached,
        restores[-1].tier if restores else "-",
    )  # fmt: skip


def print_report(timelines: list[Timeline]) -> None:
    by_scenario: dict[str, list[Timeline]] = {}
    for found in timelines:
        by_scenario.setdefault(found.scenario, []).append(found)
    baseline = (
        statistics.median(t.total_s for t in by_scenario.get("requeue", []))
        if "requeue" in by_scenario
        else None
    )
    table = Table(title="node loss -> next trained step, seconds (median of the runs)")
    for column in ("side", "fault", "runs", *PARTS, "total", "vs requeue", "restored from", "steps lost"):
        table.add_column(column, justify="left" if column in ("side", "fault", "restored from") else "right")
    for scenario, runs in by_scenario.items():
        parts = [statistics.median(t.parts()[part] for t in runs) for part in PARTS]
        total = statistics.median(t.total_s for t in runs)
        ratio = f"{total / baseline:.2f}x" if baseline else "-"
        table.add_row(
            SCENARIOS[scenario].side, SCENARIOS[scenario].what, str(len(runs)), *(f"{p:.1f}" for p in parts),
            f"{total:.1f}", ratio, ",".join(sorted({t.restored_from for t in runs})),
            ",".join(str(t.reached - t.resumed_from) for t in runs),
        )  # fmt: skip
    console.print(table)
    killed = [t.total_s for t in timelines if t.scenario != "requeue"]
    if killed:
        worst = max(killed)
        verdict = "met" if worst < GOAL_S else "MISSED"
        console.print(
            f"goal: a node's death to the next trained step under {GOAL_S:.0f} s: {verdict} "
            f"(worst {worst:.1f} s)"
        )
    print_recovery(by_scenario)


def print_recovery(by_scenario: dict[str, list[Timeline]]) -> None:
    """The issue's line, and its goals: peer memory at most a third of the shared file system, elastic
    faster than either. Printed only when every one of the three ran."""
    if not all(name in by_scenario for name in RECOVERIES):
        return
    medians = {name: statistics.median(t.total_s for t in by_scenario[name]) for name in RECOVERIES}
    console.print(
        "node-loss recovery: " + ", ".join(f"{RECOVERIES[name]} {s:.1f} s" for name, s in medians.items())
    )
    peer, shared, elastic = (medians[name] for name in RECOVERIES)
    console.print(
        f"goal: peer memory at most a third of shared file system: "
        f"{'met' if peer <= shared * PEER_OVER_SHARED_GOAL else 'MISSED'} ({peer / shared:.2f}x); "
        f"elastic faster than either: {'met' if elastic < min(peer, shared) else 'MISSED'}"
    )


def keep_logs(folder: Path) -> Path:
    """A failed run's logs (``tunepod run``'s, the job's), copied out of its folder, which goes."""
    kept = REPO / ".tunepod" / f"{folder.name}-logs"
    kept.mkdir(exist_ok=True)
    for log in [folder / "tunepod-run.log", *folder.glob("shared/jobs/*/*/*.log")]:
        if log.is_file():
            shutil.copy(log, kept / log.name)
    return kept


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.node_loss", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each scenario (long form: 3)")
    parser.add_argument("--long", action="store_true", help="3 runs of each scenario")
    parser.add_argument("--state-mb", type=float, default=64.0, help="checkpoint size (default 64 MB)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--json", type=Path, help="write every run's timeline here")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    states = node_states()
    if sum(state == "idle" for state in states.values()) < 3:
        console.print(
            f"needs 3 idle nodes in partition {NODE_PARTITION} (scripts/slurm-up --nodes 4); sinfo: {states}"
        )
        return 2
    scenarios = args.only.split(",") if args.only else list(SCENARIOS)
    repeats = 3 if args.long else args.repeats
    timelines: list[Timeline] = []
    failed = False
    (REPO / ".tunepod").mkdir(exist_ok=True)
    for _ in range(repeats):
        for scenario in scenarios:
            with tempfile.TemporaryDirectory(
                prefix=f"node-loss-{scenario}-", dir=REPO / ".tunepod"
            ) as folder:
                try:
                    found = run_once(scenario, Path(folder), steps=20, state_mb=args.state_mb)
                except (RuntimeError, subprocess.SubprocessError) as error:
                    kept = keep_logs(Path(folder))
                    console.print(f"[red]{scenario}: {error} (logs kept: {kept})[/red]")
                    failed = True
                    continue
            timelines.append(found)
            console.print(
                f"{scenario}: {found.total_s:.1f} s "
                + ", ".join(f"{k} {v:.1f}" for k, v in found.parts().items())
            )
    print_report(timelines)
    if args.json:
        args.json.write_text(
            json.dumps([asdict(t) | {"parts": t.parts(), "total_s": t.total_s} for t in timelines], indent=2)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
