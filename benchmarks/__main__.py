"""Every benchmark, one after the other, each side by side with its baseline: ``make bench``.

    .venv/bin/python -m benchmarks                      # the short forms (under 15 minutes on 2 cores)
    .venv/bin/python -m benchmarks --long               # the long forms
    .venv/bin/python -m benchmarks --only scale,staging

Each benchmark runs as a process of its own and prints its own tables (see benchmarks/README.md for
what each figure means); this runner adds a last table: how long each took and whether it ran. Exit 1
when a benchmark failed (a side errored), never because a goal was missed: the tables say that.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Benchmark:
    name: str
    command: tuple[str, ...]
    """Arguments after ``python``: the short form."""
    long: tuple[str, ...]
    what: str


BENCHMARKS = (
    Benchmark(
        "overhead",
        ("benchmarks/overhead.py",),
        ("benchmarks/overhead.py", "--repeats", "3"),
        "tunepod run's fixed and per-trial cost against bare torchrun",
    ),
    Benchmark(
        "scale",
        # 50 in the short form: Ray Tune's side of 100 took 3.4 minutes of a 20-minute make bench on
        # a host stealing a third of the CPU (2026-12-03); the figures at 100 and 1,000 are the long form's.
        ("-m", "benchmarks.scale", "--trials", "50"),
        ("-m", "benchmarks.scale", "--trials", "100,1000"),
        "50 (long: 100 and 1,000) trivial trials, 16 in flight, against the ideal and Ray Tune",
    ),
    Benchmark(
        "growth",
        ("-m", "benchmarks.growth"),
        ("-m", "benchmarks.growth", "--long"),
        "orchestrator CPU per report over a trial of 100,000 reports",
    ),
    Benchmark(
        "quality",
        # One seed of 30 trials (python -m benchmarks.quality alone: 40): a short form shows every arm
        # running and one seed's outcome, which no short form can make the goal's figure of.
        ("-m", "benchmarks.quality", "--trials", "30"),
        ("-m", "benchmarks.quality", "--long"),
        "time to a target accuracy: TPE + Hyperband against random search",
    ),
    Benchmark(
        "staging",
        ("-m", "benchmarks.staging"),
        ("-m", "benchmarks.staging", "--long"),
        "S3 and folder staging against aws s3 sync, s5cmd, cp -r and rsync",
    ),
    Benchmark(
        "webhook",
        ("-m", "benchmarks.webhook", "--requests", "300"),
        ("-m", "benchmarks.webhook", "--long"),
        "signed webhook deliveries against a bare FastAPI endpoint",
    ),
    Benchmark(
        "checkpoints",
        ("-m", "benchmarks.checkpoints"),
        ("-m", "benchmarks.checkpoints", "--long"),
        "checkpoint stall, kill -> resume and write throughput against torch.save, dd and cp",
    ),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--long", action="store_true", help="the long forms")
    names = ",".join(b.name for b in BENCHMARKS)
    parser.add_argument("--only", help=f"comma-separated subset of {names}")
    args = parser.parse_args(argv)
    chosen = _chosen(args.only, parser)
    console = Console(highlight=False, soft_wrap=True)
    outcomes: list[tuple[Benchmark, float, int]] = []
    for benchmark in chosen:
        command = [sys.executable, *(benchmark.long if args.long else benchmark.command)]
        console.rule(f"{benchmark.name}: {benchmark.what}")
        console.print(f"[dim]$ {' '.join(command[1:])}[/dim]")
        started = time.perf_counter()
        code = subprocess.run(command, cwd=REPO, check=False).returncode
        outcomes.append((benchmark, time.perf_counter() - started, code))
    table = Table(title="make bench" + (" (long forms)" if args.long else ""))
    for column in ("benchmark", "minutes", "outcome"):
        table.add_column(column, justify="right" if column == "minutes" else "left")
    for benchmark, seconds, code in outcomes:
        table.add_row(benchmark.name, f"{seconds / 60:.1f}", "ran" if code == 0 else f"FAILED (exit {code})")
    console.print(table)
    return 1 if any(code for _, _, code in outcomes) else 0


def _chosen(only: str | None, parser: argparse.ArgumentParser) -> list[Benchmark]:
    if not only:
        return list(BENCHMARKS)
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    known = {b.name: b for b in BENCHMARKS}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return [known[name] for name in wanted]


if __name__ == "__main__":
    sys.exit(main())
