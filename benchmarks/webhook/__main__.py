"""``python -m benchmarks.webhook``: signed deliveries to tunepod's webhook receiver against a bare
FastAPI endpoint that does nothing, side by side in one run, on 127.0.0.1.

1. Latency p50/p95/p99 and throughput, at each ``--concurrency`` level (deliveries in flight): the
   same fixed number of deliveries, each signed and with an id of its own, to each server, in rounds
   of rotating order after a warm-up. Goal: tunepod adds at most 5 ms at p95.
2. The same-id race: ``--race-copies`` concurrent copies of one delivery must give one 202, the rest
   200 duplicates, and exactly one event stored at the sink (Prefect).

Both servers are uvicorn processes started as a user starts them (``servers``); the receiver's events
go to a real Prefect server (``sink``); ``run`` says what each side is. Exit 0, or 1 when a side
failed (a server did not start, a request errored or got another answer than 202, or 204 from
Prefect, the race gave more or fewer than one event); a missed latency goal is reported, not an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.webhook import report, servers
from benchmarks.webhook.report import console
from benchmarks.webhook.run import run

# Per side and concurrency level. Most of a run's CPU time is Prefect's (its API and its storing of
# every event): the short form is sized to end within ~3 minutes on 2 idle cores.
SHORT = {"requests": 500, "warmup": 50, "rounds": 4}
LONG = {"requests": 5000, "warmup": 500, "rounds": 10}
LEVELS = [1, 8]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.webhook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--long", action="store_true", help=f"the long form: {LONG} (default: {SHORT})")
    parser.add_argument("--requests", type=int, help="measured requests per side and concurrency level")
    parser.add_argument("--warmup", type=int, help="requests per side before measuring")
    parser.add_argument("--rounds", type=int, help="rounds per level; the sides' order rotates")
    parser.add_argument("--concurrency", type=int, nargs="+", default=LEVELS,
                        help=f"requests in flight at once, one table each (default: {LEVELS})")  # fmt: skip
    parser.add_argument("--race-copies", type=int, default=20,
                        help="concurrent copies of one delivery (0: no race)")  # fmt: skip
    parser.add_argument("--prefect-api", help="a running Prefect server's API URL (default: a temporary one)")
    parser.add_argument("--no-settle", dest="settle", action="store_false",
                        help="do not wait for Prefect to store a batch's events before the next batch "
                        "(quicker; the sides then share the machine with Prefect's storing)")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="bound on a server's start and on Prefect storing events")  # fmt: skip
    parser.add_argument("--dir", type=Path, help="where the server logs and the receiver's dedupe log go "
                        "(default: a temp folder under the repository's .tunepod, on its disk)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every figure there")
    parser.add_argument("--keep", action="store_true", help="keep the servers' logs and the dedupe log")
    args = parser.parse_args(argv)
    for name, default in (LONG if args.long else SHORT).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if min(args.requests, args.rounds, *args.concurrency) < 1 or min(args.warmup, args.race_copies) < 0:
        parser.error("--requests, --rounds and --concurrency must be at least 1")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    base = args.dir or servers.REPO / ".tunepod"
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-webhook-", dir=base))
    started = time.monotonic()
    console.print(f"webhook intake benchmark on {machine()}, 1-minute load {os.getloadavg()[0]:.2f}")
    figures: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    failures: list[str] = []
    try:
        measured = run(args, folder)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
    else:
        levels = measured.levels.items()
        figures["levels"] = {str(c): report.print_level(c, sides, args) for c, sides in levels}
        console.print(report.NOTES)
        figures["race"] = report.print_race(measured.race, measured.race_events)
        figures["sink_catch_up_s"] = measured.catch_up_s
        failures += measured.failures()
    for failure in failures:
        console.print(f"[red]side failed: {failure}")
    figures["failures"] = failures
    figures["wall_s"] = round(time.monotonic() - started, 1)
    console.print(f"done in {figures['wall_s']:.0f} s, 1-minute load {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if failures or args.keep:
        console.print(f"server logs and the dedupe log kept under {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
        if args.dir is None:
            with contextlib.suppress(OSError):  # leave no empty .tunepod behind
                base.rmdir()
    return 1 if failures else 0


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.node()} ({platform.machine()}, {cpus} CPUs), {datetime.now():%Y-%m-%d %H:%M}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
