"""``python -m benchmarks.checkpoints``: tunepod's checkpoints against plain torch.save, torch.load,
dd and cp, side by side in one run, as ratios (``make bench-checkpoints``).

1. Training stall per checkpoint: a 2-rank DDP job under torchrun saves every ``--interval`` steps
   by each method, the memory tier's among them; the stall is the save call's wall time until every
   rank can train again. One job per state size.
2. Kill -> first step after resume: the job is SIGKILLed after a committed checkpoint and started
   again; from the kill to the first training step, split into phases, per state size.
3. Write throughput: MB/s of tunepod's writers against dd and cp of the same bytes.

Everything is written under ``--dir`` (default: a temp folder on the repository's disk). Exit 0, or
1 when a side failed (a job died, a writer failed); a missed goal is reported, not an error.
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

from benchmarks.checkpoints import jobs, throughput
from benchmarks.checkpoints.jobs import JobsReport, ResumeFigures, StallFigures

console = Console(highlight=False, soft_wrap=True, width=max(170, Console().width))
#: The issue's goal: an async save stalls training at most this fraction of a synchronous torch.save.
STALL_GOAL = 0.3
#: Issue 45's goal: a memory-tier save stalls training at most this fraction of a synchronous torch.save.
MEMORY_GOAL = 0.1
BASELINE_SAVE = "torch.save"
FSYNC_SAVE = "torch.save+fsync"
ASYNC_METHODS = ("tunepod-async", "tunepod-async-process")
MEMORY_METHODS = ("tunepod-memory", "tunepod-memory-sharded")
STALL_ROWS = {  # method -> (side, what)
    "torch.save": ("baseline", "torch.save, rank 0 (no fsync)"),
    "torch.save+fsync": ("baseline", "torch.save + fsync, rank 0"),
    "copy": ("floor", "bare copy into kept buffers, rank 0"),
    "tunepod": ("tunepod", "save_checkpoint: rank 0, sync"),
    "tunepod-sharded": ("tunepod", "sharded, sync"),
    "tunepod-async": ("tunepod", "sharded, async (thread)"),
    "tunepod-async-process": ("tunepod", "sharded, async (process)"),
    "tunepod-memory": ("tunepod", "memory tier, whole-state (rank 0)"),
    "tunepod-memory-sharded": ("tunepod", "memory tier, sharded"),
}
RESUME_ROWS = {
    "torch.save": ("baseline", "torch.load of a torch.save file"),
    "tunepod": ("tunepod", "load_latest_checkpoint()"),
    "tunepod-sharded": ("tunepod", "sharded: load_latest_checkpoint(into=)"),
}
PHASES = ("process start", "imports", "rendezvous", "model build", "checkpoint load", "first step")
SHORT = {"stall_mb": [64.0, 256.0], "resume_mb": [64.0, 256.0], "throughput_mb": 256.0}
LONG = {"stall_mb": [1024.0], "resume_mb": [256.0, 1024.0, 2048.0], "throughput_mb": 1024.0}


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--long", action="store_true",
                        help=f"the long form: sizes {LONG} (default: {SHORT})")  # fmt: skip
    parser.add_argument(
        "--dir", type=Path, help="where checkpoints are written (FSx for Lustre: a folder on it)"
    )
    parser.add_argument("--stall-mb", type=float, nargs="+", help="state sizes of the stall jobs (table 1)")
    parser.add_argument("--resume-mb", type=float, nargs="+", help="state sizes of the resumes (table 2)")
    parser.add_argument("--throughput-mb", type=float, help="bytes written per writer (table 3)")
    parser.add_argument("--interval", type=int, default=5, help="training steps between two saves")
    parser.add_argument("--saves", type=int, default=3, help="saves per method and round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of every method's saves (order rotated)"
    )
    parser.add_argument("--resume-repeats", type=int, default=1, help="kill/resume chains per size")
    parser.add_argument("--resume-methods", default=",".join(jobs.RESUME_METHODS),
                        help="the loaders of table 2, comma-separated")  # fmt: skip
    parser.add_argument("--throughput-repeats", type=int, default=3, help="writes per writer")
    parser.add_argument("--batch", type=int, default=16, help="training batch per rank")
    parser.add_argument("--launcher", choices=["torchrun", "direct"], default="torchrun",
                        help="direct: the ranks without torchrun's agent")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on one job's phase")
    parser.add_argument("--tables", default="stall,resume,throughput", help="which tables, comma-separated")
    parser.add_argument("--json", type=Path, help="also write every figure there")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and job logs")
    args = parser.parse_args(argv)
    sizes = LONG if args.long else SHORT
    args.stall_mb = args.stall_mb or sizes["stall_mb"]
    args.resume_mb = args.resume_mb or sizes["resume_mb"]
    args.throughput_mb = args.throughput_mb or sizes["throughput_mb"]
    args.tables = {t.strip() for t in args.tables.split(",") if t.strip()}
    unknown = args.tables - {"stall", "resume", "throughput"}
    if unknown:
        parser.error(f"unknown tables {sorted(unknown)}; valid: stall, resume, throughput")
    args.resume_methods = [m.strip() for m in args.resume_methods.split(",") if m.strip()]
    if not args.resume_methods or set(args.resume_methods) - set(jobs.RESUME_METHODS):
        parser.error(f"--resume-methods takes some of: {', '.join(jobs.RESUME_METHODS)}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    own_dir = args.dir is None
    base = args.dir or jobs.REPO / ".tunepod"
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-checkpoints-", dir=base))
    started = time.monotonic()
    console.print(f"checkpoint benchmark on {machine()}, 1-minute load {os.getloadavg()[0]:.2f}")
    console.print(f"writing under {folder} ({filesystem_of(folder)})")
    failures: list[str] = []
    figures: dict[str, Any] = {"machine": machine(), "dir": str(folder), "args": vars_of(args)}
    if args.tables & {"stall", "resume"}:
        report = jobs.run_jobs(
            folder,
            args.stall_mb if "stall" in args.tables else [],
            args.resume_mb if "resume" in args.tables else [],
            interval=args.interval,
            saves=args.saves,
            rounds=args.rounds,
            resume_repeats=args.resume_repeats,
            resume_methods=args.resume_methods,
            batch=args.batch,
            launcher=args.launcher,
            timeout_s=args.timeout_s,
        )
        failures += report.failures
        if "stall" in args.tables:
            figures["stall"] = [print_stall(report, size, args) for size in args.stall_mb]
            figures["memory_tier"] = print_memory_tier(figures["stall"])
        if "resume" in args.tables:
            figures["resume"] = print_resume(report, args.launcher)
    if "throughput" in args.tables:
        measured = throughput.measure(folder / "throughput", args.throughput_mb, args.throughput_repeats)
        figures["throughput"] = print_throughput(measured, args.throughput_mb)
        failures += [f"{t.writer}: {t.error}" for t in measured if t.error and t.writer != "dd oflag=direct"]
    for failure in failures:
        console.print(f"[red]side failed: {failure}")
    figures["failures"] = failures
    figures["wall_s"] = round(time.monotonic() - started, 1)
    console.print(f"done in {figures['wall_s']:.0f} s, 1-minute load {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    if failures or args.keep:
        console.print(f"checkpoints and job logs kept under {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
        if own_dir:
            with_parent_removed_if_empty(base)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------- tables


def print_stall(report: JobsReport, size_mb: float, args: argparse.Namespace) -> dict[str, Any]:
    """Table 1 of the stall job of ``size_mb``; returns its figures."""
    by_method = {f.method: f for f in report.stall if f.size_mb == size_mb}
    if BASELINE_SAVE not in by_method:
        console.print(f"[red]table 1: the stall job of {size_mb:g} MB failed, nothing to show")
        return {"size_mb": size_mb}
    step_s = median(by_method["none"].steps)
    barrier_s = median(by_method["none"].calls)
    baseline_stall = median(by_method[BASELINE_SAVE].calls)
    baseline_cost = cost_per_save(by_method[BASELINE_SAVE], step_s, args.interval)
    state_mb = by_method[BASELINE_SAVE].bytes / 1e6
    table = Table(
        title=f"1. Training stall per checkpoint: state {state_mb:.0f} MB, 2 ranks (gloo), a save every "
        f"{args.interval} steps of {step_s * 1000:.0f} ms; median of {args.saves * args.rounds} saves"
    )
    columns = ("side", "save", "stall s (median)", "min-max", "first save s", "steps slower",
               "cost per save s", "ratio stall", "ratio cost")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("side", "save") else "right")
    rows: dict[str, Any] = {}
    for method, (side, what) in STALL_ROWS.items():
        found = by_method[method]
        stall = median(found.calls)
        slower = median(found.steps) / step_s - 1 if step_s > 0 else math.nan
        cost = cost_per_save(found, step_s, args.interval)
        rows[method] = {"side": side, "stall_s": stall, "min_s": min(found.calls), "max_s": max(found.calls),
                        "first_s": found.first, "steps_slower": slower, "cost_s": cost,
                        "ratio": stall / baseline_stall, "cost_ratio": cost / baseline_cost,
                        "bytes": found.bytes}  # fmt: skip
        table.add_row(side, what, f"{stall:.3f}", f"{min(found.calls):.3f}-{max(found.calls):.3f}",
                      f"{found.first:.3f}", f"{slower * 100:+.0f}%", f"{cost:.3f}",
                      f"{stall / baseline_stall:.2f}", f"{cost / baseline_cost:.2f}")  # fmt: skip
    console.print(table)
    console.print(
        "stall: the save call, then a barrier (every rank past it); a barrier alone takes "
        f"{barrier_s * 1000:.1f} ms. steps slower: median step between saves against the run without "
        f"saves. cost per save: stall + {args.interval} x (median step - median step without saves). "
        f"ratios: against {BASELINE_SAVE}."
    )
    ratios = {m: rows[m]["ratio"] for m in ASYNC_METHODS}
    met = all(r <= STALL_GOAL for r in ratios.values())
    verdict = "[green]met" if met else "[red]NOT met"
    shown = ", ".join(f"{STALL_ROWS[m][1]} {r:.2f}x" for m, r in ratios.items())
    console.print(f"goal: async stall <= {STALL_GOAL}x torch.save's: {shown}: {verdict}")
    return {"size_mb": size_mb, "state_mb": state_mb, "step_s": step_s, "barrier_s": barrier_s,
            "rows": rows, "goal": STALL_GOAL, "goal_met": met,
            "raw": [asdict(f) for f in by_method.values()]}  # fmt: skip


def print_memory_tier(stalls: list[dict[str, Any]]) -> dict[str, Any]:
    """The memory tier's line per state size, and issue 45's goal; returns their figures."""
    found: dict[str, Any] = {}
    for figures in stalls:
        if "rows" not in figures:
            continue
        rows, size = figures["rows"], figures["size_mb"]
        whole, sharded = rows["tunepod-memory"], rows["tunepod-memory-sharded"]
        against = {
            "torch.save": whole["ratio"],
            "torch.save+fsync": whole["stall_s"] / rows[FSYNC_SAVE]["stall_s"],
            "sharded async (thread)": whole["stall_s"] / rows["tunepod-async"]["stall_s"],
            "sharded memory save": sharded["ratio"],
            "bare copy (floor)": rows["copy"]["ratio"],
        }
        found[f"{size:g}"] = against
        console.print(
            f"memory-tier stall ratio: {whole['ratio']:.2f} at {size:g} MB (whole-state memory save, "
            f"{whole['stall_s'] * 1000:.1f} ms, / torch.save without fsync, "
            f"{rows[BASELINE_SAVE]['stall_s'] * 1000:.1f} ms; / torch.save + fsync "
            f"{against['torch.save+fsync']:.2f}; / the async sharded save (thread) "
            f"{against['sharded async (thread)']:.2f}; sharded memory save / torch.save "
            f"{sharded['ratio']:.2f}; the floor, a bare copy of the state, / torch.save "
            f"{rows['copy']['ratio']:.2f})"
        )
    if not found:
        return {}
    met = all(r["torch.save"] <= MEMORY_GOAL for r in found.values())
    shown = ", ".join(f"{size} MB {r['torch.save']:.2f}x" for size, r in found.items())
    verdict = "[green]met" if met else "[red]NOT met"
    console.print(f"goal: memory-tier stall <= {MEMORY_GOAL}x torch.save's (whole-state): {shown}: {verdict}")
    return {"ratios": found, "goal": MEMORY_GOAL, "goal_met": met}


def cost_per_save(found: StallFigures, step_s: float, interval: int) -> float:
    return median(found.calls) + interval * (median(found.steps) - step_s)


def print_resume(report: JobsReport, launcher: str) -> dict[str, Any]:
    """Table 2 (medians over the repeats of each size and side); returns its figures."""
    grouped: dict[tuple[float, str], list[ResumeFigures]] = {}
    for figure in report.resumes:
        grouped.setdefault((figure.size_mb, figure.method), []).append(figure)
    ranks = "2 ranks under torchrun" if launcher == "torchrun" else "2 ranks started directly"
    table = Table(title=f"2. Kill -> first training step after resume (seconds, {ranks}; median of runs)")
    for column in ("state MB", "side", "load", *PHASES, "kill -> first step", "ratio"):
        table.add_column(column, justify="left" if column in ("side", "load") else "right")
    rows = []
    for size in sorted({size for size, _ in grouped}):
        baseline = grouped.get((size, BASELINE_SAVE))
        base_total = median([f.phases()["kill -> first step"] for f in baseline]) if baseline else math.nan
        for method, (side, what) in RESUME_ROWS.items():
            found = grouped.get((size, method))
            if not found:
                continue
            phases = {name: median([f.phases()[name] for f in found]) for name in found[0].phases()}
            total = phases["kill -> first step"]
            rows.append({"size_mb": size, "method": method, "side": side, "phases": phases,
                         "ratio": total / base_total, "runs": len(found)})  # fmt: skip
            table.add_row(f"{size:g}", side, what, *(f"{phases[p]:.2f}" for p in PHASES), f"{total:.2f}",
                          f"{total / base_total:.2f}")  # fmt: skip
    console.print(table)
    console.print(
        "process start: relaunch to the script's first line (torchrun's agent, the interpreter); imports: "
        "torch and tunepod; model build: the MLP, AdamW, DDP; checkpoint load: finding, reading and "
        "loading the newest checkpoint into model and optimizer; first step: forward, backward, all-reduce, "
        "AdamW. kill -> relaunch (not shown) is the wait for the killed processes to be gone."
    )
    return {"rows": rows, "raw": [asdict(f) for f in report.resumes]}


def print_throughput(measured: list[throughput.Throughput], megabytes: float) -> dict[str, Any]:
    """Table 3; returns its figures."""
    dd = next(t for t in measured if t.writer == throughput.DD)
    runs = max(len(t.seconds) for t in measured)
    table = Table(
        title=f"3. Checkpoint write throughput: {dd.bytes / 1e6:.0f} MB per write, median of {runs}"
    )
    for column in ("side", "writer", "MB/s", "seconds", "ratio"):
        table.add_column(column, justify="left" if column in ("side", "writer") else "right")
    rows: dict[str, dict[str, Any]] = {}
    for found in measured:
        side = "tunepod" if found.writer.startswith("tunepod") else "baseline"
        if found.error:
            table.add_row(side, found.writer, "-", "-", f"not measured: {found.error[:60]}")
            rows[found.writer] = {"side": side, "error": found.error}
            continue
        ratio = found.mb_per_s / dd.mb_per_s
        rows[found.writer] = {
            "side": side,
            "mb_per_s": found.mb_per_s,
            "seconds": found.seconds,
            "ratio": ratio,
        }
        table.add_row(
            side, found.writer, f"{found.mb_per_s:.0f}", f"{median(found.seconds):.3f}", f"{ratio:.2f}"
        )
    console.print(table)
    console.print(
        f"ratio: MB/s against {throughput.DD}. dd and cp copy the state's torch.save file (from the page "
        "cache) to a new file and fsync it; the others write the state from memory and fsync (tunepod: "
        "also sha256 and the load check, as every save does)."
    )
    return {"megabytes": megabytes, "rows": rows}


# ---------------------------------------------------------------------------------------------- helpers


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.node()} ({platform.machine()}, {cpus} CPUs), {datetime.now():%Y-%m-%d %H:%M}"


def filesystem_of(folder: Path) -> str:
    """The mount that holds ``folder``: its type and device, from /proc/mounts."""
    best = ("", "?", "?")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "filesystem unknown"
    resolved = str(folder.resolve())
    for line in lines:
        device, mount, kind, *_ = line.split()
        if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
            best = (mount, kind, device)
    return f"{best[1]} on {best[0]}, {best[2]}"


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()}  # fmt: skip


def with_parent_removed_if_empty(folder: Path) -> None:
    """Leave no empty ``.tunepod`` behind that the benchmark itself made."""
    with contextlib.suppress(OSError):
        folder.rmdir()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
