"""One LCBench table from the JSON files of several runs: arms run apart, or instances run in parts.

    .venv/bin/python -m benchmarks.lcbench.merge peers.json tunepod.json --plot all.png --markdown
    .venv/bin/python -m benchmarks.lcbench.merge part-*.json --instances test --json test.json

Each file's per-instance rows (each arm's medians over its seeds on an instance, its budget to random
search's final measured against the random runs of that file) are pooled, and the aggregate over
instances, its ranks among every arm pooled, is computed again. An (arm, instance) pair in two files
is taken from the first; the files must share a budget, and each instance's arms must have run on
the same seeds (the random arm's rows of two files must then be equal, which is checked).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.lcbench.__main__ import DEV_INSTANCES
from benchmarks.lcbench.arms import BASELINE
from benchmarks.lcbench.metrics import ArmOnInstance, overall
from benchmarks.lcbench.problem import Budget
from benchmarks.lcbench.report import emit

console = Console(highlight=False, soft_wrap=True, width=170)


def read(path: Path) -> tuple[Budget, list[ArmOnInstance], list[dict[str, Any]]]:
    """A run's budget, per-instance rows and runs, from the file ``--json`` wrote."""
    document = json.loads(path.read_text())
    rows = [
        ArmOnInstance(
            arm=row["arm"],
            instance=row["instance"],
            seeds=row["seeds"],
            regret=tuple(row["regret"]),
            fraction_to_random=float("inf")
            if row["fraction_to_random"] is None
            else row["fraction_to_random"],
            end_s=row["end_s"],
            num_trials=row["num_trials"],
            grid_regret=np.array(row["grid_regret"]),
        )
        for row in document["per_instance"]
    ]
    return Budget(**document["budget"]), rows, document["runs"]


def pooled(paths: Sequence[Path]) -> tuple[Budget, list[ArmOnInstance], list[dict[str, Any]]]:
    budget: Budget | None = None
    rows: dict[tuple[str, str], ArmOnInstance] = {}
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    for path in paths:
        its_budget, its_rows, its_runs = read(path)
        if budget is not None and its_budget != budget:
            raise SystemExit(f"{path} ran under {its_budget}, the files before it under {budget}")
        budget = its_budget
        for row in its_rows:
            earlier = rows.setdefault((row.arm, row.instance), row)
            if row.arm == BASELINE and earlier is not row and earlier.regret != row.regret:
                raise SystemExit(
                    f"{path}: {BASELINE} on {row.instance} differs from an earlier file's "
                    f"({row.regret} against {earlier.regret}): the files ran other seeds"
                )
        for run in its_runs:
            runs.setdefault((run["arm"], run["instance"], run["seed"]), run)
    if budget is None:
        raise SystemExit("no file given")
    return budget, list(rows.values()), list(runs.values())


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lcbench.merge", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "files", nargs="+", type=Path, help="JSON files of `python -m benchmarks.lcbench --json`"
    )
    parser.add_argument(
        "--instances", default="all", help="dev (the 8 development instances), test (the other 26), or all"
    )
    parser.add_argument("--arms", type=lambda text: text.split(","), help="comma-separated, in this order")
    parser.add_argument("--plot", type=Path, help="write the regret-over-budget PNG there")
    parser.add_argument("--json", type=Path, help="write the pooled rows, aggregates and runs there")
    parser.add_argument("--markdown", action="store_true", help="also print the overall table as Markdown")
    args = parser.parse_args(argv)
    if args.instances not in ("dev", "test", "all"):
        parser.error(f"--instances must be dev, test or all, got {args.instances!r}")
    budget, rows, runs = pooled(args.files)
    keep = {
        "dev": lambda i: i in DEV_INSTANCES,
        "test": lambda i: i not in DEV_INSTANCES,
        "all": lambda i: True,
    }
    rows = [row for row in rows if keep[args.instances](row.instance)]
    if args.arms:
        unknown = sorted(set(args.arms) - {row.arm for row in rows})
        if unknown:
            parser.error(f"no rows of arms {unknown} in the files")
        rows = sorted((row for row in rows if row.arm in args.arms), key=lambda row: args.arms.index(row.arm))
    missing = _missing_pairs(rows)
    if missing:
        parser.error(f"some arms lack some instances ({'; '.join(missing)}): their ranks would not compare")
    order = _instance_order(rows)
    rows.sort(key=lambda row: order.index(row.instance))  # stable: each instance's arms in their order
    arms = overall(rows)
    kept_runs = [run for run in runs if keep[args.instances](run["instance"])]
    seeds = max(row.seeds for row in rows)
    emit(
        console,
        kept_runs,
        rows,
        arms,
        budget,
        baseline=BASELINE,
        seeds=seeds,
        markdown=args.markdown,
        plot=args.plot,
        json_file=args.json,
    )
    return 0


def _instance_order(rows: Sequence[ArmOnInstance]) -> list[str]:
    return list(dict.fromkeys(row.instance for row in rows))


def _missing_pairs(rows: Sequence[ArmOnInstance]) -> list[str]:
    instances = set(_instance_order(rows))
    found = []
    for arm in dict.fromkeys(row.arm for row in rows):
        absent = instances - {row.instance for row in rows if row.arm == arm}
        if absent:
            found.append(f"{arm} on {', '.join(sorted(absent))}")
    return found


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
