"""Tuning quality on LCBench (YAHPO Gym's surrogate) in simulated time: normalized regret per arm.

    .venv/bin/python -m benchmarks.quality --workload lcbench --instances 3945,7593 --seeds 2
    .venv/bin/python -m benchmarks.lcbench --plot benchmarks/results/lcbench.png  # 8 dev instances, 10 seeds
    .venv/bin/python -m benchmarks.lcbench --arms random,dehb --budget-trials 50 --json /tmp/lcbench.json

See benchmarks/README.md ("LCBench") for what is measured and how. Exit 1 only when a run failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from benchmarks.lcbench.arms import ARMS, BASELINE, OPT_IN_ARMS, REQUIRES
from benchmarks.lcbench.metrics import RunSummary, overall, per_instance
from benchmarks.lcbench.problem import Budget
from benchmarks.lcbench.reference import load_references
from benchmarks.lcbench.report import emit
from benchmarks.lcbench.runner import Task, run_all
from benchmarks.lcbench.surrogate import NUM_EPOCHS

# Settings are chosen on these only; the other 26 instances are the test set (README "LCBench").
DEV_INSTANCES = ("3945", "7593", "34539", "126025", "146212", "167104", "168330", "189862")
# As benchmarks/quality: tunepod reseeds a study's trial n with seed + n, so seeds 0, 1, 2 would share
# draws shifted by one trial. Seeds this far apart share none within a budget.
SEED_STRIDE = 1000

console = Console(highlight=False, soft_wrap=True, width=170)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lcbench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--instances",
        type=lambda text: text.split(","),
        default=list(DEV_INSTANCES),
        help="comma-separated OpenML task ids of LCBench (default: the 8 development instances)",
    )
    parser.add_argument("--seeds", type=int, default=10, help="seeds per arm and instance (10)")
    parser.add_argument("--first-seed", type=int, default=0, help=f"seeds: this, + {SEED_STRIDE}, ...")
    parser.add_argument(
        "--arms",
        type=lambda text: text.split(","),
        help=f"comma-separated, of {', '.join(ARMS)} (default: all but the opt-in {', '.join(OPT_IN_ARMS)}; "
        f"{BASELINE} is always run)",
    )
    parser.add_argument(
        "--budget-trials",
        type=float,
        default=100,
        help=f"the budget in full trials' worth of epochs ({NUM_EPOCHS} each; default 100)",
    )
    parser.add_argument("--workers", type=int, default=4, help="trials training at once in each run (4)")
    parser.add_argument("--startup-s", type=float, default=5.0, help="simulated seconds per job start (5)")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="runs at once, one process each (CPUs)"
    )
    parser.add_argument("--plot", type=Path, help="write the regret-over-budget PNG there")
    parser.add_argument("--json", type=Path, help="write every run's numbers there")
    parser.add_argument("--markdown", action="store_true", help="also print the overall table as Markdown")
    args = parser.parse_args(argv)
    args.arms = choose_arms(parser, args.arms)
    known = load_references()
    unknown = [i for i in args.instances if i not in known]
    if unknown:
        parser.error(f"unknown instances {unknown}; valid (data/reference.json): {', '.join(known)}")
    return args


def choose_arms(parser: argparse.ArgumentParser, asked: list[str] | None) -> list[str]:
    """The arms to run, the baseline first. Asked for by name, an arm whose package is missing is an
    error; by default, it is left out with a warning."""
    unknown = sorted(set(asked or []) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; valid: {', '.join(ARMS)}")
    default = [arm for arm in ARMS if arm not in OPT_IN_ARMS]
    arms = [BASELINE, *[arm for arm in (asked or default) if arm != BASELINE]]
    missing = {arm: absent for arm in arms if (absent := missing_modules(arm))}
    if missing and asked:
        modules = sorted({module for absent in missing.values() for module in absent})
        parser.error(f"arms {sorted(missing)} need {modules}: pip install 'tunepod[bench]'")
    for arm, absent in missing.items():
        console.print(
            f"[yellow]leaving out {arm}: no {', '.join(absent)} (pip install 'tunepod[bench]')[/yellow]"
        )
    return [arm for arm in arms if arm not in missing]


def missing_modules(arm: str) -> list[str]:
    return [module for module in REQUIRES.get(arm, ()) if importlib.util.find_spec(module) is None]


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    budget = Budget(
        total_epochs=round(args.budget_trials * NUM_EPOCHS), n_workers=args.workers, startup_s=args.startup_s
    )
    seeds = [args.first_seed + i * SEED_STRIDE for i in range(args.seeds)]
    tasks = [Task(arm, one, seed, budget) for one in args.instances for seed in seeds for arm in args.arms]
    console.print(
        f"{len(tasks)} runs: {len(args.arms)} arms x {len(args.instances)} instances x {len(seeds)} seeds, "
        f"{args.jobs} at a time; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    started = time.time()

    def progress(run: RunSummary, done: int, total: int) -> None:
        console.print(
            f"  [{done}/{total}] {run.arm} {run.instance} seed {run.seed}: regret {run.regret[-1]:.4f}, "
            f"{run.num_trials} trials, {run.cpu_s:.1f} CPU s",
            style="dim",
        )

    try:
        runs = run_all(tasks, args.jobs, progress)
    except RuntimeError as exc:  # a run failed: runner.run_task says which and how to replay it
        traceback.print_exception(exc)
        console.print(f"[red]FAILED: {exc}[/red]")
        return 1
    rows = per_instance(runs, BASELINE)
    arms = overall(rows)
    emit(
        console,
        runs,
        rows,
        arms,
        budget,
        baseline=BASELINE,
        seeds=len(seeds),
        markdown=args.markdown,
        plot=args.plot,
        json_file=args.json,
    )
    cpu = sum(run.cpu_s for run in runs)
    console.print(f"{time.time() - started:.0f} s in all ({cpu:.0f} CPU s in the runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
