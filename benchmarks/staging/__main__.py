"""``python -m benchmarks.staging``: tunepod's stage step against the plain tools, side by side in one run.

1. S3: a data set of many small files and a few large ones is uploaded to a real moto S3 server on
   loopback; ``aws s3 sync``, ``s5cmd`` and tunepod's S3 stage each copy it into a fresh folder (full
   copy), then run again over that folder with nothing changed (re-stage).
2. Folder: the same files, from a local folder, by ``cp -r``, ``rsync -a``, ``rsync -a --fsync`` and
   tunepod's folder stage.

Each side is a process of its own, timed from start to exit; tunepod's child times its call to
``tunepod.staging.stage`` (a stage step makes that call in a process that has tunepod imported), and
its start-to-exit time is shown beside. Medians over ``--repeats``, the order of the sides rotated
each repeat. Throughput is bytes / full-copy seconds; the ratio divides tunepod's by
the best baseline's. The first repeat's copies are compared byte by byte with the source. Exit 0, or 1
when a side failed (a command erred, a copy differs from the source); a missed goal is reported, not an
error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.staging import dataset, sides
from benchmarks.staging.dataset import DataSpec
from benchmarks.staging.sides import TUNEPOD, Figures, Side

console = Console(highlight=False, soft_wrap=True, width=max(170, Console().width))
#: The issue's goals: tunepod's throughput at least this fraction of the best baseline's ...
THROUGHPUT_GOAL = 0.9
#: ... and an unchanged re-stage at most this fraction of its own full copy.
RESTAGE_GOAL = 0.02
SHORT = DataSpec(small_files=800, small_kb=4, large_files=2, large_mb=64)
#: 256 MB files are downloaded in ranges by tunepod (tunepod.staging.s3.RANGED_MIN_BYTES).
LONG = DataSpec(small_files=10000, small_kb=4, large_files=3, large_mb=256)
REPEATS = {"short": 2, "long": 3}


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.staging", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--long", action="store_true", help=f"the long form: {LONG} (default: {SHORT})")
    parser.add_argument("--small-files", type=int, help="how many small files")
    parser.add_argument("--small-kb", type=float, help="their mean size, KB (each 0.5x-1.5x of it)")
    parser.add_argument("--large-files", type=int, help="how many large files")
    parser.add_argument("--large-mb", type=float, help="the size of each, MB")
    parser.add_argument("--repeats", type=int,
                        help=f"full copy + re-stage runs per side (default: {REPEATS})")  # fmt: skip
    parser.add_argument("--no-restage", action="store_true", help="full copies only (a quick smoke run)")
    parser.add_argument("--tables", default="s3,folder", help="which tables, comma-separated")
    parser.add_argument("--sides", help="only these sides (aws,s5cmd,cp,rsync,rsync-fsync; tunepod always)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on one command")
    parser.add_argument("--dir", type=Path, help="where the data and the copies go (default: a temp folder)")
    parser.add_argument("--json", type=Path, help="also write every figure there")
    parser.add_argument("--keep", action="store_true", help="keep the data and the last repeat's copies")
    args = parser.parse_args(argv)
    base = LONG if args.long else SHORT
    args.repeats = args.repeats or REPEATS["long" if args.long else "short"]
    args.spec = DataSpec(
        small_files=base.small_files if args.small_files is None else args.small_files,
        small_kb=args.small_kb or base.small_kb,
        large_files=base.large_files if args.large_files is None else args.large_files,
        large_mb=args.large_mb or base.large_mb,
    )
    args.tables = {t.strip() for t in args.tables.split(",") if t.strip()}
    if args.tables - {"s3", "folder"}:
        parser.error(f"unknown tables {sorted(args.tables - {'s3', 'folder'})}; valid: s3, folder")
    args.sides = None if args.sides is None else {s.strip() for s in args.sides.split(",")} | {TUNEPOD}
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    own_dir = args.dir is None
    base = args.dir or sides.REPO / ".tunepod"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-staging-", dir=base))
    started = time.monotonic()
    console.print(f"staging benchmark on {machine()}, 1-minute load {os.getloadavg()[0]:.2f}")
    figures: dict[str, Any] = {"machine": machine(), "dir": str(work), "spec": asdict(args.spec),
                               "repeats": args.repeats, "load_before": os.getloadavg()[0]}  # fmt: skip
    data = dataset.write_dataset(work / "source", args.spec)
    console.print(f"data: {describe(args.spec)}, {data.num_bytes / 1e6:.0f} MB in all, under {work}")
    failures: list[str] = []
    if "s3" in args.tables:
        figures["s3"] = s3_table(args, data, work, failures)
    if "folder" in args.tables:
        figures["folder"] = folder_table(args, data, work, failures)
    for failure in failures:
        console.print(f"[red]side failed: {failure}")
    figures["failures"] = failures
    figures["wall_s"] = round(time.monotonic() - started, 1)
    figures["load_after"] = os.getloadavg()[0]
    console.print(f"done in {figures['wall_s']:.0f} s, 1-minute load {figures['load_after']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    if args.keep:
        console.print(f"data and copies kept under {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        if own_dir:
            with contextlib.suppress(OSError):
                base.rmdir()  # leave no empty .tunepod behind that the benchmark itself made
    return 1 if failures else 0


def s3_table(
    args: argparse.Namespace, data: dataset.Dataset, work: Path, failures: list[str]
) -> dict[str, Any]:
    with dataset.moto_server(work / "moto.log") as server:
        started = time.monotonic()
        dataset.upload(data, server.url)
        console.print(f"uploaded to moto ({server.url}) in {time.monotonic() - started:.1f} s")
        chosen = chosen_sides(sides.s3_sides(server.url), args.sides)
        settings = run_settings(args, dataset.aws_env(work, server.url), server.pid)
        measured = sides.measure(chosen, data.root, work / "s3", settings)
        listing = [dataset.list_seconds(server.url) for _ in range(args.repeats)]
    title = (f"1. S3 stage: {describe(args.spec)} from moto on loopback, {data.num_bytes / 1e6:.0f} MB; "
             f"median of {args.repeats}")  # fmt: skip
    floor = median(listing)
    floors = {"listing alone (boto3 paginator)": floor}
    found = print_table(title, chosen, measured, data, failures, floors, server_cpu=True)
    print_goals(found, floor)
    console.print(
        "tunepod's times: its stage() call (StageReport.seconds); as a process: the child Python from start "
        "to exit, its imports included. tunepod fsyncs every file it writes and hashes it (sha256 in its "
        "manifest); aws and s5cmd do neither. s5cmd cp copies everything again, so its re-stage is "
        "s5cmd sync over the cp'd folder. CPU s: of a full copy, the side's own processes (user + "
        "system) and the moto server's meanwhile; on a busy machine a side's time follows the CPU it needs."
    )
    return {**found, "listing_s": listing, "listing_floor_s": floor, "endpoint": "moto"}


def folder_table(
    args: argparse.Namespace, data: dataset.Dataset, work: Path, failures: list[str]
) -> dict[str, Any]:
    chosen = chosen_sides(sides.folder_sides(data.root, sides.rsync_has_fsync()), args.sides)
    if shutil.which("rsync") is None:
        console.print("[yellow]no rsync (apt-get install rsync): its sides are left out[/yellow]")
    measured = sides.measure(chosen, data.root, work / "folder", run_settings(args, dict(os.environ), None))
    title = (f"2. Folder stage: {describe(args.spec)} from a local folder (page cache), "
             f"{data.num_bytes / 1e6:.0f} MB; median of {args.repeats}")  # fmt: skip
    found = print_table(title, chosen, measured, data, failures, {})
    print_goals(found, None, bar="the S3 bar, applied to folders")
    console.print(
        "tunepod and rsync --fsync make every file durable before going on; cp and plain rsync leave "
        "the writing to the kernel (the benchmark syncs between runs, untimed)."
    )
    return found


def run_settings(args: argparse.Namespace, env: dict[str, str], server_pid: int | None) -> sides.Settings:
    return sides.Settings(env=env, repeats=args.repeats, timeout_s=args.timeout_s, keep=args.keep,
                          restage=not args.no_restage, server_pid=server_pid)  # fmt: skip


def chosen_sides(available: list[Side], wanted: set[str] | None) -> list[Side]:
    return [side for side in available if wanted is None or side.name in wanted]


def print_table(
    title: str,
    chosen: list[Side],
    measured: dict[str, Figures],
    data: dataset.Dataset,
    failures: list[str],
    floors: dict[str, float],
    server_cpu: bool = False,
) -> dict[str, Any]:
    """The table of one kind of stage; returns its figures (the rows, the best baseline, the ratios)."""
    table = Table(title=title)
    cpu = "CPU s (side / moto)" if server_cpu else "CPU s"
    columns = ("side", "command", "full copy s", "MB/s", "ratio", cpu, "re-stage s", "re-stage % of full",
               "as a process s (full / re-stage)", "identical to source")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("side", "command") else "right")
    rows: dict[str, Any] = {}
    for side in chosen:
        found = measured[side.name]
        if found.error is not None or found.identical is False:
            failures.append(f"{side.what}: {found.error or 'its copy differs from the source'}")
        rows[side.name] = row_figures(side, found, data)
    baselines = {n: r for n, r in rows.items() if n != TUNEPOD and r.get("mb_per_s") and r["identical"]}
    best = max(baselines, key=lambda n: baselines[n]["mb_per_s"], default=None)
    best_mb_per_s = baselines[best]["mb_per_s"] if best else math.nan
    for side in chosen:
        row = rows[side.name]
        row["ratio"] = row.get("mb_per_s", math.nan) / best_mb_per_s
        if side.is_tunepod and "process_full_s" in row:
            row["process_ratio"] = data.num_bytes / 1e6 / row["process_full_s"] / best_mb_per_s
        table.add_row(*table_cells(side, row, server_cpu))
    for name, seconds in floors.items():
        table.add_row("floor", name, "", "", "", "", f"{seconds:.2f}", "", "", "")
    console.print(table)
    console.print(f"ratio: MB/s against the best baseline ({best or 'none measured'}).")
    return {"rows": rows, "best_baseline": best}


def table_cells(side: Side, row: dict[str, Any], server_cpu: bool) -> list[str]:
    kind = "tunepod" if side.is_tunepod else "baseline"
    if "full_s" not in row:
        return [kind, side.what, *["-"] * 7, f"FAILED: {row['error'][:60]}"]
    cpu = f"{row['cpu_s']:.1f}" + (f" / {row['server_cpu_s']:.1f}" if server_cpu else "")
    process = f"{row['process_full_s']:.2f} / {row['process_restage_s']:.2f}" if side.is_tunepod else ""
    return [kind, side.what, f"{row['full_s']:.2f}", f"{row['mb_per_s']:.1f}", f"{row['ratio']:.2f}", cpu,
            f"{row['restage_s']:.2f}", f"{row['restage_pct']:.1f}%", process,
            "yes" if row["identical"] else "NO"]  # fmt: skip


def row_figures(side: Side, found: Figures, data: dataset.Dataset) -> dict[str, Any]:
    row: dict[str, Any] = {"what": side.what, "identical": found.identical, "error": found.error,
                           "raw": asdict(found)}  # fmt: skip
    if found.error is not None or not found.full:
        return row
    full_s, restage_s = median(found.full), median(found.restage)
    row.update(full_s=full_s, restage_s=restage_s, mb_per_s=data.num_bytes / 1e6 / full_s,
               restage_pct=100 * restage_s / full_s, cpu_s=median(found.cpu_full),
               server_cpu_s=median(found.server_cpu_full))  # fmt: skip
    if side.is_tunepod:
        row.update(process_full_s=median(found.process_full), process_restage_s=median(found.process_restage),
                   restage_copied=found.restage_copied)  # fmt: skip
    return row


def print_goals(found: dict[str, Any], listing_floor: float | None, bar: str = "the issue's goals") -> None:
    tunepod = found["rows"].get(TUNEPOD, {})
    if "full_s" not in tunepod:
        console.print("[red]goals: tunepod's side failed, nothing to compare")
        return
    ratio = tunepod["ratio"]
    met = ratio >= THROUGHPUT_GOAL
    console.print(f"goal ({bar}): tunepod throughput >= {THROUGHPUT_GOAL}x the best baseline's: "
                  f"{ratio:.2f}x: {verdict(met)} (as a process, its imports included: "
                  f"{tunepod.get('process_ratio', math.nan):.2f}x)")  # fmt: skip
    pct = tunepod["restage_pct"]
    if math.isnan(pct):
        console.print(
            f"goal ({bar}): tunepod unchanged re-stage <= {RESTAGE_GOAL:.0%} of its full copy: not measured"
        )
        return
    floor = ""
    if listing_floor is not None:
        floor = (f" (listing the prefix alone takes {listing_floor:.2f} s, "
                 f"{100 * listing_floor / tunepod['full_s']:.1f}% of tunepod's full copy)")  # fmt: skip
    console.print(f"goal ({bar}): tunepod unchanged re-stage <= {RESTAGE_GOAL:.0%} of its full copy: "
                  f"{pct:.1f}%: {verdict(pct <= 100 * RESTAGE_GOAL)}{floor}")  # fmt: skip
    copied = tunepod.get("restage_copied", [])
    if any(copied):
        console.print(f"[red]tunepod's re-stages copied files although nothing changed: {copied}")


def verdict(met: bool) -> str:
    return "[green]met" if met else "[red]NOT met"


def describe(spec: DataSpec) -> str:
    return (f"{spec.small_files} files of ~{spec.small_kb:g} KB + {spec.large_files} of "
            f"{spec.large_mb:g} MB")  # fmt: skip


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.node()} ({platform.machine()}, {cpus} CPUs), {datetime.now():%Y-%m-%d %H:%M}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
