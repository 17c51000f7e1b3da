"""``python -m benchmarks.chaos``: run the soak on one launcher or both and print what held.

Exit 0 when every check held on every launcher, 1 on any violation, 2 when it could not run (Slurm
asked for and not up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.chaos import nodes
from benchmarks.chaos.faults import JOB_FAULTS, Fault, kinds_for
from benchmarks.chaos.soak import SoakConfig, SoakReport, describe, run_soak

console = Console(highlight=False, soft_wrap=True)
#: Bound on a study's start (Prefect's temporary server, MLflow, staging): against a hang only.
STARTUP_S = 300.0


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__)
    parser.add_argument("--launcher", choices=["local", "slurm", "both"], default="both")
    parser.add_argument("--seed", type=int, default=1, help="seeds the fault kinds, gaps and targets")
    parser.add_argument(
        "--minutes", type=float, default=10.0,
        help="faults are injected for this long (split between launchers), from each study's first "
        "trial on; each study then gets --drain-minutes more to finish before the soak gives up on it",
    )  # fmt: skip
    parser.add_argument("--drain-minutes", type=float, default=10.0)
    parser.add_argument("--trials", type=int, default=20, help="num_trials of each launcher's study")
    parser.add_argument("--parallel", type=int, default=2, help="num_parallel of each study")
    parser.add_argument("--epochs", type=int, default=6, help="epochs (reports, checkpoints) per trial")
    parser.add_argument("--sleep-s", type=float, default=0.5, help="pause per epoch")
    parser.add_argument("--gap-s", type=float, default=10.0, help="mean seconds between two faults")
    parser.add_argument(
        "--outage-s", type=float, nargs=2, default=(3.0, 10.0), metavar=("MIN", "MAX"),
        help="an MLflow outage lasts between MIN and MAX seconds (drawn)",
    )  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=3, help="the spec's train.max_restarts")
    parser.add_argument(
        "--nodes", type=int, default=1,
        help="nodes per trial of the Slurm study: 2 or more runs each trial as one job over that many "
        "namespaced nodes (partition nodes, scripts/slurm-up --nodes N) and adds node loss to the faults",
    )  # fmt: skip
    parser.add_argument(
        "--node-outage-s", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN", "MAX"),
        help="a lost node stays out between MIN and MAX seconds (drawn; a killed one at least until "
        "the controller marks it DOWN)",
    )  # fmt: skip
    parser.add_argument("--prefect-api", help="a running Prefect server (default: a temporary one per run)")
    parser.add_argument(
        "--overlap", action="store_true",
        help="also kill the orchestrator while MLflow is down (a known failure: see the README)",
    )  # fmt: skip
    parser.add_argument("--folder", type=Path, help="where stores, job dirs and logs go (kept)")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    launchers = ["local", "slurm"] if args.launcher == "both" else [args.launcher]
    if "slurm" in launchers and (reason := slurm_down() or too_few_nodes(args.nodes)):
        console.print(f"[red]the Slurm cluster is not usable: {reason} (start it with scripts/slurm-up)")
        return 2
    folder = args.folder or Path(tempfile.mkdtemp(prefix="tunepod-chaos-"))
    console.print(f"chaos soak, seed {args.seed}, {' and '.join(launchers)}, on {machine()}")
    console.print(f"files under {folder}")
    reports = [run_soak(config(args, launcher, folder, len(launchers))) for launcher in launchers]
    for report in reports:
        print_report(report)
    (folder / "report.json").write_text(json.dumps([summary(r) for r in reports], indent=2))
    held = all(report.held for report in reports)
    console.print(f"[{'green' if held else 'red'}]{'every check held' if held else 'VIOLATIONS'}")
    if held and args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        console.print(f"logs, job dirs and stores kept under {folder}")
    return 0 if held else 1


def config(args: argparse.Namespace, launcher: str, folder: Path, num_launchers: int) -> SoakConfig:
    return SoakConfig(
        launcher=launcher,
        folder=folder / launcher,
        seed=args.seed,
        inject_s=args.minutes * 60 / num_launchers,
        drain_s=args.drain_minutes * 60,
        startup_s=STARTUP_S,
        num_trials=args.trials,
        num_parallel=args.parallel,
        epochs=args.epochs,
        sleep_s=args.sleep_s,
        gap_s=args.gap_s,
        max_restarts=args.max_restarts,
        prefect_api=args.prefect_api,
        overlap=args.overlap,
        outage_s=(args.outage_s[0], args.outage_s[1]),
        num_nodes=args.nodes if launcher == "slurm" else 1,
        node_outage_s=(args.node_outage_s[0], args.node_outage_s[1]),
    )


def slurm_down() -> str | None:
    try:
        shown = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    states = shown.stdout.split()
    usable = {"idle", "mixed", "allocated", "completing"}
    return None if shown.returncode == 0 and usable & set(states) else f"sinfo: {shown.stderr or states}"


def too_few_nodes(num_nodes: int) -> str | None:
    """Why the namespaced nodes cannot run trials of ``num_nodes`` nodes (None when they can)."""
    if num_nodes < 2:
        return None
    states = nodes.node_states()
    serving = sorted(node for node, state in states.items() if nodes.in_service(state))
    if len(serving) >= num_nodes:
        return None
    listed = ", ".join(f"{node} {state}" for node, state in states.items()) or "none"
    return f"--nodes {num_nodes} needs {num_nodes} namespaced nodes in service (partition nodes: {listed})"


# ------------------------------------------------------------------------------------------ the tables


def print_report(report: SoakReport) -> None:
    launcher = report.config.launcher
    settings = ", ".join(f"{k} {v}" for k, v in describe(report.config).items())
    console.print(
        f"\n[bold]{launcher}[/bold]: {report.wall_s:.0f} s, {settings}; tunepod run started "
        f"{report.orchestrator_starts}x, MLflow server {report.mlflow_starts}x"
    )
    console.print(fault_table(report))
    console.print(check_table(report))
    for injection in report.injected:
        target = f"trial {', '.join(map(str, injection.trials))}" if injection.trials else "-"
        effect = "".join(f" -> {n}: {report.effects.get(n, '?')}" for n in injection.trials)
        console.print(
            f"  {injection.at_s:7.1f} s  {injection.kind:<20} {target:<9} {injection.detail}{effect}"
        )
    for outage in report.outages:
        back = f"back at {outage.back_at_s:.1f} s" if outage.back_at_s is not None else "NOT BACK"
        console.print(
            f"  node {outage.node}: {outage.kind.value} at {outage.out_at_s:.1f} s (trials "
            f"{', '.join(map(str, outage.trials))}), {back}{f' ({outage.problem})' if outage.problem else ''}"
        )


def fault_table(report: SoakReport) -> Table:
    table = Table(title=f"{report.config.launcher}: faults injected")
    for column in ("fault", "injected", "trials hit", "outcome"):
        table.add_column(column)
    everything_held = report.held
    for kind in kinds_for(report.config.launcher, report.config.num_nodes):
        hits = [i for i in report.injected if i.kind is kind]
        trials = sorted({n for i in hits for n in i.trials})
        hit = "; ".join(f"{n} ({report.effects.get(n, '?')})" for n in trials) or "-"
        table.add_row(kind.value, str(len(hits)), hit,
                      outcome(report, kind, trials, everything_held))  # fmt: skip
    return table


def outcome(report: SoakReport, kind: Fault, trials: list[int], everything_held: bool) -> str:
    """Held, or violated with what went wrong: on the trials a job-level fault hit, or (for the
    study-wide faults) anywhere."""
    if kind in JOB_FAULTS:
        problems = [f"trial {n}: {p}" for n in trials for p in report.verdict.trial_problems.get(n, [])]
        return "held" if not problems else "violated: " + "; ".join(problems)
    return "held" if everything_held else "violated: see the checks"


def check_table(report: SoakReport) -> Table:
    table = Table(title=f"{report.config.launcher}: what must hold")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    for check in [*report.verdict.checks, report.leftover]:
        result = "[green]held" if check.held else "[red]VIOLATED"
        table.add_row(check.name, result, "; ".join(check.problems) or check.detail)
    return table


def summary(report: SoakReport) -> dict[str, object]:
    """What a test or a later comparison reads back (``report.json`` beside the launchers' folders)."""
    return {
        "launcher": report.config.launcher,
        "held": report.held,
        "wall_s": round(report.wall_s, 1),
        "nodes": report.config.num_nodes,
        "injected": {
            kind.value: sum(i.kind is kind for i in report.injected)
            for kind in kinds_for(report.config.launcher, report.config.num_nodes)
        },
        "nodes_taken_out": [
            {
                "node": o.node,
                "how": o.kind.value,
                "out_at_s": o.out_at_s,
                "back_at_s": o.back_at_s,
                "trials": list(o.trials),
                "problem": o.problem,
            }
            for o in report.outages
        ],
        "checks": {c.name: c.problems for c in [*report.verdict.checks, report.leftover]},
        "orchestrator_starts": report.orchestrator_starts,
        "mlflow_starts": report.mlflow_starts,
        "effects": report.effects,
    }


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.node()} ({platform.machine()}, {cpus} CPUs), {datetime.now():%Y-%m-%d %H:%M}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
