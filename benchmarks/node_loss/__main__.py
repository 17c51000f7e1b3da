"""``python -m benchmarks.node_loss``: on the local Slurm cluster's namespaced nodes (``scripts/slurm-up``),
the time from a node's death to the trial's next trained step, split into its parts, side by side with
a planned ``scontrol requeue`` of the same job (the baseline: the same restart and checkpoint load,
with no node lost and nothing to detect).

Each run is one ``tunepod run`` of a one-trial study whose job spans two nodes (one rank per node,
``trainer.py``: an all-reduce, a report and a ``--state-mb`` checkpoint per step). After the third
report the fault strikes: the first node killed (``scripts/slurm-node kill``: the batch script and the
rendezvous die with it), the second node killed, or the job requeued. A poller reads Slurm every
0.2 s; the trainer records when its process group formed and its checkpoint was loaded. The parts:

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

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().parent / "trainer.py"
GOAL_S = 60.0
POLL_S = 0.2
RUN_LIMIT_S = 420.0
SCENARIOS = {  # name -> (side, what)
    "requeue": ("baseline", "scontrol requeue of the running job (no node lost)"),
    "kill-first": ("tunepod", "first node killed: batch script and rendezvous with it"),
    "kill-second": ("tunepod", "second node killed"),
}
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

    def parts(self) -> dict[str, float]:
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


def write_spec(folder: Path, steps: int, state_mb: float) -> Path:
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
                    "train": {
                        "entrypoint": str(TRAINER),
                        "args": {"steps": steps, "sleep_s": 1.0, "state_mb": state_mb},
                        "resources": {"num_nodes": 2, "procs_per_node": 1},
                        "max_restarts": 1,
                    },
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


def run_once(scenario: str, folder: Path, steps: int, state_mb: float) -> Timeline:
    spec = write_spec(folder, steps, state_mb)
    paths = JobPaths(folder / "shared" / "jobs" / "loss" / "trial-0")
    log = folder / "tunepod-run.log"
    with log.open("wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "tunepod.cli", "run", str(spec)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    victim = ""
    try:
        job_id = wait_for_reports(paths, run, log)
        held = job_nodes(job_id)
        victim = {"kill-first": held[0], "kill-second": held[1]}.get(scenario, "")
        poller = Poller(job_id, victim)
        poller.start()
        fault_at = time.time()
        if victim:
            checked(nodes.kill(victim))
        else:
            subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, timeout=30)
        code = run.wait(timeout=RUN_LIMIT_S)
        poller.done.set()
        if code != 0:
            raise RuntimeError(f"`tunepod run` exited {code}; its output: {log}")
        return timeline(scenario, victim, fault_at, poller.seen, paths)
    finally:
        if run.poll() is None:
            run.kill()
        if victim:
            restore(victim)


def wait_for_reports(paths: JobPaths, run: subprocess.Popen[bytes], log: Path) -> str:
    """The job id once the trial has reported three steps (it is then mid-training, checkpointed)."""
    deadline = time.monotonic() + 180
    while True:
        record = read_submission(paths) if paths.job_dir.exists() else None
        if record is not None and record.job_id and len(read_reports(paths.metrics)) >= 3:
            return record.job_id
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the trial never reported 3 steps; `tunepod run` output: {log}")
        time.sleep(POLL_S)


def timeline(
    scenario: str, victim: str, fault_at: float, seen: dict[str, float], paths: JobPaths
) -> Timeline:
    starts = [line.split() for line in (paths.job_dir / "starts.log").read_text().splitlines()]
    if len(starts) < 2 or "queued" not in seen or "running" not in seen:
        raise RuntimeError(f"{scenario}: the job was not seen requeued and started again: {seen}, {starts}")
    started, loaded, step = starts[-1]
    after = [r for r in read_reports(paths.metrics) if r.time > float(loaded)]
    return Timeline(scenario, victim, fault_at, seen, float(started), float(loaded), int(step), after[0].time)


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
    for column in ("side", "fault", "runs", *PARTS, "total", "vs requeue"):
        table.add_column(column, justify="left" if column in ("side", "fault") else "right")
    for scenario, runs in by_scenario.items():
        side, what = SCENARIOS[scenario]
        parts = [statistics.median(t.parts()[part] for t in runs) for part in PARTS]
        total = statistics.median(t.total_s for t in runs)
        ratio = f"{total / baseline:.2f}x" if baseline else "-"
        table.add_row(side, what, str(len(runs)), *(f"{p:.1f}" for p in parts), f"{total:.1f}", ratio)
    console.print(table)
    killed = [t.total_s for t in timelines if t.scenario != "requeue"]
    if killed:
        worst = max(killed)
        verdict = "met" if worst < GOAL_S else "MISSED"
        console.print(
            f"goal: a node's death to the next trained step under {GOAL_S:.0f} s: {verdict} "
            f"(worst {worst:.1f} s)"
        )


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
    for _ in range(repeats):
        for scenario in scenarios:
            with tempfile.TemporaryDirectory(
                prefix=f"node-loss-{scenario}-", dir=REPO / ".tunepod"
            ) as folder:
                try:
                    found = run_once(scenario, Path(folder), steps=20, state_mb=args.state_mb)
                except (RuntimeError, subprocess.SubprocessError) as error:
                    console.print(f"[red]{scenario}: {error}[/red]")
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
