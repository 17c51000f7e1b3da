"""Tuning quality: wall time until a study first reaches a target, TPE + Hyperband against random search.

    .venv/bin/python -m benchmarks.quality                  # short form: digits, 1 seed per arm
    .venv/bin/python -m benchmarks.quality --workload lcbench --instances 3945,7593 --seeds 2   # LCBench
    .venv/bin/python -m benchmarks.quality --long           # 7 seeds, epochs of 1 s, + tiny LLM, + Ray ASHA
    .venv/bin/python -m benchmarks.quality --ray            # the short form plus Ray Tune's ASHA
    .venv/bin/python -m benchmarks.quality --driver cli     # through `tunepod run` (Prefect) instead

See benchmarks/README.md ("quality/") for what is measured and how. Exit 1 only when a study failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.table import Table

from benchmarks.quality.study import StudyFailed, StudyRun, run_study
from benchmarks.quality.workloads import (
    ARMS,
    LONG_RANDOM,
    PBT,
    RANDOM,
    RAY_ARMS,
    RAY_ASHA,
    RAY_PBT,
    TPE_ASHA,
    TPE_HYPERBAND,
    Workload,
    digits,
    tiny_llm,
)

GOAL_RATIO = 0.5
WORKLOADS = ("digits", "lcbench")
# tunepod seeds the sampler of trial n with seed + n (tunepod.hpo.study.reseed_for_next_trial), so the
# studies of seeds s and s + 1 would draw the same parameters, shifted by one trial. Seeds this far
# apart share none within a budget of fewer trials.
SEED_STRIDE = 1000
BUSY_LOAD = 1.0
SIDES = {
    RANDOM: "baseline",
    TPE_HYPERBAND: "tunepod",
    TPE_ASHA: "tunepod",
    PBT: "tunepod",
    LONG_RANDOM: "control",
    RAY_ASHA: "baseline 2",
    RAY_PBT: "baseline 2",
}

console = Console(highlight=False, soft_wrap=True, width=160)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="digits",
        help="digits: the real studies below (digits; the tiny LLM with --llm), the default; lcbench: the "
        "LCBench surrogate in simulated time, whose options are python -m benchmarks.lcbench --help's",
    )
    parser.add_argument("--long", action="store_true", help="7 seeds, epochs of 1 s, tiny LLM, Ray ASHA")
    parser.add_argument("--seeds", type=int, help="seeds per arm (short 1, long 7)")
    parser.add_argument("--trials", type=int, help="digits trials per study (40)")
    parser.add_argument("--parallel", type=int, default=2, help="trials in flight per study (2)")
    parser.add_argument("--epochs", type=int, default=6, help="digits epochs per trial (6)")
    parser.add_argument(
        "--epoch-s", type=float, help="digits epoch_sleep_s, the epoch's weight (short 0.25, long 1.0)"
    )
    parser.add_argument("--target", type=float, help="digits val_accuracy to reach (0.974)")
    parser.add_argument("--llm", action="store_true", help="add the tiny LLM workload (on with --long)")
    parser.add_argument("--no-digits", action="store_true", help="leave the digits workload out")
    parser.add_argument("--llm-seeds", type=int, default=3, help="tiny LLM seeds per arm (3)")
    parser.add_argument("--llm-trials", type=int, default=40, help="tiny LLM trials per study (40)")
    parser.add_argument("--llm-steps", type=int, default=120, help="tiny LLM optimizer steps per trial")
    # Calibrated as digits' target: 5 of 80 random draws (seeds 90000, 91000) reach 13.0 within 120
    # steps (14.0: 20 of 80, a target random search hits within a few trials, whatever the tuner).
    parser.add_argument(
        "--llm-target", type=float, default=13.0, help="tiny LLM val_perplexity to reach (13.0)"
    )
    parser.add_argument("--ray", action="store_true", help="add Ray Tune's ASHA arm (on with --long)")
    parser.add_argument(
        "--arms",
        type=lambda text: text.split(","),
        default=[RANDOM, TPE_HYPERBAND],
        help=f"comma-separated, of {', '.join([*ARMS, *RAY_ARMS])} (default: the first two)",
    )
    parser.add_argument(
        "--driver",
        choices=("library", "cli"),
        default="library",
        help="library: PipelineRun as flows.pipeline drives it, minus Prefect; cli: tunepod run",
    )
    parser.add_argument("--prefect-api", help="with --driver cli: a running Prefect server's API URL")
    parser.add_argument(
        "--full-budget",
        action="store_true",
        help="run every study to its last trial instead of stopping it at its target",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run a seed's arms one after the other instead of side by side (more wall time; each "
        "arm then has the CPUs to itself)",
    )
    parser.add_argument("--first-seed", type=int, default=0, help=f"seeds: this, + {SEED_STRIDE}, ...")
    parser.add_argument("--json", type=Path, help="write every study's outcome there")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder of every study")
    parser.add_argument("--root", type=Path, help="put every study's stores in this new folder (kept)")
    args = parser.parse_args(argv)
    # Short: one seed (3 minutes here) keeps `make bench` under its 15 minutes (2 seeds: 6.4 of 17.8; 3:
    # 10-13). It shows that every arm runs and what one seed gives; no median of a few seeds can show
    # the goal (one unlucky seed moves it by 0.1-0.3): --seeds 15 and the long form give the figures.
    args.seeds = args.seeds or (7 if args.long else 1)
    # A budget random search rarely exhausts before the target: a censored baseline is a lower bound,
    # which pulls the ratio toward 1 (16 trials left random censored in most seeds at 0.974).
    args.trials = args.trials or 40
    # Short: lighter epochs for the short form's 2 seeds x 2 arms of up to 40 trials (7 minutes here).
    args.epoch_s = args.epoch_s if args.epoch_s is not None else (1.0 if args.long else 0.25)
    args.target = args.target or 0.974
    args.llm = args.llm or args.long
    if (args.ray or args.long) and RAY_ASHA not in args.arms:
        args.arms.append(RAY_ASHA)
    unknown = sorted(set(args.arms) - {*ARMS, *RAY_ARMS})
    if unknown:
        parser.error(f"unknown arms {unknown}; valid: {', '.join([*ARMS, *RAY_ARMS])}")
    return args


def workloads(args: argparse.Namespace) -> list[Workload]:
    chosen = []
    if not args.no_digits:
        chosen.append(digits(args.trials, args.parallel, args.epochs, args.epoch_s, args.target))
    if args.llm:
        chosen.append(tiny_llm(args.llm_trials, args.parallel, args.llm_steps, 20, args.llm_target))
    return chosen


def run_arms(workload: Workload, seeds: int, args: argparse.Namespace, root: Path) -> list[StudyRun]:
    """Every arm once per seed. Side by side (the default), a seed's arms run at the same time, so both
    meet the same load and a seed costs its slower arm's time, not the sum; one after the other, the
    arms take turns going first, so slow drift of the machine's load does not always fall on one arm."""
    arms = args.arms
    runs = []
    for index in range(seeds):
        seed = args.first_seed + index * SEED_STRIDE
        shift = index % len(arms)
        order = arms[shift:] + arms[:shift]
        if args.one_at_a_time:
            seed_runs = [run_one(workload, arm, seed, root, args) for arm in order]
        else:
            seed_runs = run_side_by_side(workload, order, seed, root, args)
        for run in seed_runs:
            mark = "" if run.reached else " (not reached: censored)"
            console.print(
                f"  {workload.name} {run.arm} seed {seed}: {run.time_s:.1f} s{mark}, {run.trials_started} "
                f"trials started, best {run.best:.4g}  [load {os.getloadavg()[0]:.1f}]"
            )
        runs += seed_runs
    return runs


def run_side_by_side(
    workload: Workload, arms: list[str], seed: int, root: Path, args: argparse.Namespace
) -> list[StudyRun]:
    """The studies of ``arms`` for one seed at once, one thread watching each. A failure in one (or a
    signal to this process) aborts the others: their watchers kill their studies' processes."""
    abort = threading.Event()
    with ThreadPoolExecutor(max_workers=len(arms), thread_name_prefix="arm") as pool:
        futures = [pool.submit(run_one, workload, arm, seed, root, args, abort) for arm in arms]
        try:
            return [future.result() for future in futures]
        except BaseException:
            abort.set()
            raise


def run_one(
    workload: Workload,
    arm: str,
    seed: int,
    root: Path,
    args: argparse.Namespace,
    abort: threading.Event | None = None,
) -> StudyRun:
    if arm in RAY_ARMS:
        from benchmarks.quality.ray_tune import run_ray_study  # Ray only when asked for

        return run_ray_study(workload, arm, seed, root, stop_at_target=not args.full_budget, abort=abort)
    return run_study(
        workload,
        arm,
        seed,
        root,
        driver=args.driver,
        stop_at_target=not args.full_budget,
        prefect_api=args.prefect_api,
        abort=abort,
    )


# ---------------------------------------------------------------------------------------------- report


def seconds(run: StudyRun) -> str:
    return f"{run.time_s:.1f}" if run.reached else f">{run.time_s:.1f}"


def median_time(runs: list[StudyRun]) -> float:
    """The median time to target, a study that never reached it counted as never (infinite): its time
    is a lower bound only, and an arm with a small budget (PBT's population) must not look fast by
    running out of trials early. Infinite when half the studies or more were censored."""
    return statistics.median(r.time_s if r.reached else math.inf for r in runs)


def shown(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.1f}"


def ratio_of(value: float, baseline: float) -> str:
    """``value / baseline``; "n/a" when either never reached the target (no ratio is meaningful)."""
    if math.isinf(value) or math.isinf(baseline):
        return "n/a"
    return f"{value / baseline:.2f}"


def as_factor(ratio: str) -> str:
    """A ``ratio_of`` for a sentence: "0.97x", or why there is none."""
    return "n/a: a median never reached the target" if ratio == "n/a" else f"{ratio}x"


def print_table(workload: Workload, runs: list[StudyRun]) -> dict[str, float]:
    """The table of one workload; returns each arm's median time to target."""
    by_arm = {arm: [r for r in runs if r.arm == arm] for arm in SIDES if any(r.arm == arm for r in runs)}
    medians = {arm: median_time(arm_runs) for arm, arm_runs in by_arm.items()}
    length = ", ".join(f"{k} {v}" for k, v in workload.train_args.items())
    table = Table(
        title=f"{workload.name}: seconds from the study's start to the first {workload.goal.describe()} "
        f"({workload.trials} trials at most, pbt and long random a population of {workload.parallel}; "
        f"{length}, "
        f"{workload.parallel} at a time; "
        f"{len({r.seed for r in runs})} seeds)"
    )
    for column in ("arm", "side", "median s", "per seed s", "reached", "trials started", "pruned", "ratio"):
        table.add_column(column, justify="left" if column in ("arm", "side") else "right")
    for arm, arm_runs in by_arm.items():
        table.add_row(
            arm,
            SIDES[arm],
            shown(medians[arm]),
            ", ".join(seconds(r) for r in arm_runs),
            f"{sum(r.reached for r in arm_runs)}/{len(arm_runs)}",
            ", ".join(str(r.trials_started) for r in arm_runs),
            ", ".join(str(r.pruned) for r in arm_runs),
            ratio_of(medians[arm], medians[RANDOM]) if RANDOM in medians else "",
        )
    console.print(table)
    console.print(
        "per seed: '>' marks a study that never reached the target (censored: the whole budget's wall "
        "time); the median counts it as never. trials started: by the first hit. pruned: trials stopped "
        "early by the study's end (or by its hit, when it was stopped there)."
    )
    return medians


def print_goals(workload: Workload, medians: dict[str, float]) -> None:
    """For each tunepod arm that ran beside random: its median <= GOAL_RATIO x random's, and ahead of
    Ray Tune's ASHA where that ran too; PBT against its control where both ran."""
    if PBT in medians and LONG_RANDOM in medians:
        # What PBT's exploit and explore add over members as long that never copy one another.
        ratio = as_factor(ratio_of(medians[PBT], medians[LONG_RANDOM]))
        console.print(f"{workload.name}: {PBT} against its control, {LONG_RANDOM}: {ratio}")
    if RANDOM not in medians:
        return
    for arm in (a for a in medians if SIDES[a] == "tunepod"):
        ratio = ratio_of(medians[arm], medians[RANDOM])
        met = ratio != "n/a" and float(ratio) <= GOAL_RATIO
        verdict = f"<= {GOAL_RATIO}x random's: {'MET' if met else 'MISSED'} ({as_factor(ratio)})"
        if RAY_ASHA in medians:
            ahead = medians[arm] < medians[RAY_ASHA]
            verdict += f"; ahead of {RAY_ASHA}: {'MET' if ahead else 'MISSED'}"
            verdict += f" ({as_factor(ratio_of(medians[arm], medians[RAY_ASHA]))})"
        console.print(f"[bold]Goal ({workload.name}, {arm}): median time to target {verdict}[/bold]")


def stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds through run_study, which stops the study's processes on its way out.
    raise SystemExit(128 + signum)


def lcbench_argv(argv: Sequence[str]) -> list[str] | None:
    """The arguments for benchmarks.lcbench when ``--workload lcbench`` is among ``argv``, else None. The
    LCBench benchmark has options of its own, so its arguments are handed over whole."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workload", choices=WORKLOADS, default="digits")
    known, rest = parser.parse_known_args(argv)
    return rest if known.workload == "lcbench" else None


def main(argv: Sequence[str]) -> int:
    lcbench = lcbench_argv(argv)
    if lcbench is not None:
        from benchmarks.lcbench.__main__ import main as lcbench_main  # onnxruntime only when asked for

        return lcbench_main(lcbench)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    load = os.getloadavg()[0]
    console.print(f"1-minute load average at the start: {load:.2f} on {os.cpu_count()} CPUs")
    if load > BUSY_LOAD:
        console.print(f"[yellow]warning: load above {BUSY_LOAD}: other work shares the CPUs[/yellow]")
    if args.root:
        args.root.mkdir(parents=True)
        args.keep = True
    root = args.root or Path(tempfile.mkdtemp(prefix="tunepod-quality-"))
    started = time.time()
    all_runs: list[StudyRun] = []
    try:
        for workload in workloads(args):
            seeds = args.llm_seeds if workload.goal.metric == "val_perplexity" else args.seeds
            runs = run_arms(workload, seeds, args, root)
            all_runs += runs
            print_goals(workload, print_table(workload, runs))
    except StudyFailed as exc:
        console.print(f"[red]FAILED: {exc}[/red]")
        args.keep = True
        return 1
    finally:
        if args.json:
            outcomes = [{**asdict(r), "time_s": r.time_s, "reached": r.reached} for r in all_runs]
            args.json.write_text(json.dumps(outcomes, default=str, indent=1))
        if args.keep:
            console.print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        console.print(f"{time.time() - started:.0f} s in all; load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
