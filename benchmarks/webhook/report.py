"""The tables and lines the benchmark prints, and the figures it writes with ``--json``."""

from __future__ import annotations

import argparse
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.webhook import load
from benchmarks.webhook.load import Load, Race
from benchmarks.webhook.run import ACCEPTED, BASELINE, DUPLICATE, SIDES, race_correct

console = Console(highlight=False, soft_wrap=True, width=max(200, Console().width))
#: The issue's goal: the receiver adds at most this many milliseconds at p95 to a bare endpoint.
GOAL_ADDED_P95_MS = 5.0
PERCENTILES = ("p50", "p95", "p99")
COLUMNS = ("side", "server", "requests", "p50 ms", "p95 ms", "p99 ms", "req/s", "CPU ms", "+p95 ms",
           "ratio p95", "ratio req/s", "ratio CPU", "answers")  # fmt: skip
NOTES = (
    "+p95: tunepod's p95 minus the baseline's; ratios: tunepod / baseline. CPU ms: the server's CPU time "
    "(all threads, with its publisher process) per request, the figure least moved by other load on the "
    "machine (Prefect's own is in none). same overrides: every delivery fills the same num_trials, so the"
    " spec check's verdict is reused; new overrides: each delivery a num_trials of its own, so the spec "
    "file is loaded and validated for each. sink alone: the publisher's call (a worker thread, a POST to "
    "Prefect's /api/events) made by the load generator itself: what each delivery costs after its 202, "
    "off the answer."
)


def print_level(concurrency: int, sides: dict[str, Load], args: argparse.Namespace) -> dict[str, Any]:
    """The table of one concurrency level and its goal lines; returns their figures."""
    rows = {name: figures_of(measured) for name, measured in sides.items()}
    base = rows[BASELINE]
    for row in rows.values():
        row["added"] = {k: row[k] - base[k] for k in (*PERCENTILES, "cpu_ms")}
        # A baseline figure of 0 (a few requests inside one CPU clock tick) has no ratio.
        keys = (*PERCENTILES, "req_s", "cpu_ms")
        row["ratio"] = {k: row[k] / base[k] if base[k] else math.nan for k in keys}
    table = Table(
        title=f"Signed deliveries, {concurrency} in flight: {args.requests} per side after {args.warmup} "
        f"of warm-up, in {args.rounds} rounds, the sides' order rotating"
    )
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("side", "server", "answers") else "right")
    for side in SIDES:
        table.add_row(*cells(side.name, side.what, side.kind == "tunepod", rows[side.name], sides[side.name]))
    console.print(table)
    for side in SIDES:
        if side.kind == "tunepod":
            rows[side.name]["goal_met"] = print_goal(side.name, concurrency, rows[side.name], base)
    return {"rows": rows, "goal_ms": GOAL_ADDED_P95_MS}


def cells(name: str, what: str, compared: bool, row: dict[str, Any], measured: Load) -> list[str]:
    answers = ", ".join(f"{status} x{n}" for status, n in sorted(measured.statuses.items()))
    cpu = "-" if math.isnan(row["cpu_ms"]) else f"{row['cpu_ms']:.2f}"
    comparison = ["", "", "", ""]
    if compared:
        added, ratio = row["added"], row["ratio"]
        comparison = [f"{added['p95']:+.2f}", f"{ratio['p95']:.2f}", f"{ratio['req_s']:.2f}",
                      f"{ratio['cpu_ms']:.2f}"]  # fmt: skip
    latencies = [f"{row[k]:.2f}" for k in PERCENTILES]
    return [name, what, str(row["requests"]), *latencies, f"{row['req_s']:.0f}", cpu, *comparison, answers]


def print_goal(name: str, concurrency: int, row: dict[str, Any], base: dict[str, Any]) -> bool:
    met = bool(row["added"]["p95"] <= GOAL_ADDED_P95_MS)
    console.print(
        f"goal: {name} adds at most {GOAL_ADDED_P95_MS:g} ms at p95, {concurrency} in flight: "
        f"{row['added']['p95']:+.2f} ms (p95 {row['p95']:.2f} against {base['p95']:.2f} ms, ratio "
        f"{row['ratio']['p95']:.2f}): {'[green]met' if met else '[red]NOT met'}"
    )
    return met


def figures_of(measured: Load) -> dict[str, Any]:
    latencies = measured.latencies_ms
    return {
        "requests": measured.requests,
        "p50": load.percentile(latencies, 50),
        "p95": load.percentile(latencies, 95),
        "p99": load.percentile(latencies, 99),
        "max": max(latencies, default=math.nan),
        "req_s": measured.throughput,
        "cpu_ms": measured.cpu_ms_per_delivery,
        "statuses": {str(status): n for status, n in measured.statuses.items()},
        "errors": measured.errors[:10],
    }


def print_race(race: Race | None, events: int) -> dict[str, Any]:
    if race is None:
        return {}
    copies = sum(race.statuses.values()) + len(race.errors)
    correct = race_correct(race, events)
    console.print(
        f"same-id race: {copies} concurrent copies of delivery {race.delivery_id}: "
        f"{race.statuses[ACCEPTED]} accepted (202), {race.statuses[DUPLICATE]} duplicates (200), "
        f"{len(race.errors)} errors, {len(race.event_ids)} distinct event id(s) answered; events stored at "
        f"Prefect for it: {events} (expected: 1 accepted, {copies - 1} duplicates, 1 event): "
        + ("[green]correct" if correct else "[red]WRONG")
    )
    return {"delivery_id": race.delivery_id, "statuses": {str(s): n for s, n in race.statuses.items()},
            "event_ids": sorted(race.event_ids), "errors": list(race.errors), "events_stored": events,
            "correct": correct}  # fmt: skip
