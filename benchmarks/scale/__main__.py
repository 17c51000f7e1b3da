"""Scale: a study of trivial trials (each sleeps ``--sleep-s`` and reports a few values), ``--parallel``
in flight, on the local launcher, against the ideal and against Ray Tune on the same trials.

    .venv/bin/python -m benchmarks.scale                        # 100 and 1,000 trials, 16 in flight
    .venv/bin/python -m benchmarks.scale --trials 100 --no-ray  # quick look at tunepod alone
    .venv/bin/python -m benchmarks.scale --prefect-api http://127.0.0.1:4200/api
    .venv/bin/python -m benchmarks.scale --prefect-api URL --mlflow-uri URL   # the local stack
    .venv/bin/python -m benchmarks.scale --optuna-storage "$(cat /var/lib/tunepod-postgres/url)"

Each side is a process of its own timed from launch to exit: ``tunepod run`` on a generated spec
(stage a small folder, tune ``trainer.py`` with the random sampler and no pruner; MLflow on SQLite,
Optuna on a journal file, both in a temp folder) under ``probe.py``, which times each piece of
per-trial bookkeeping; and Ray Tune (``ray_side.py``). Ideal: trials x sleep / parallel. Overhead:
wall - ideal. Exit 1 only when a side failed (a trial that did not complete, a crash).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PIECES = ("ask", "tell", "MLflow run wait", "submission", "Prefect task run")
"""The bookkeeping on a trial's own path: its slot waits for each of these."""
BACKGROUND = "MLflow writes"
"""Every MLflow call, made by the tracking outbox's threads while the trials run (reported apart: its
wall time, summed over threads that wait on the server at once, is not time any trial waited)."""
GOAL_BOOKKEEPING_MS = 50.0
GOAL_GROWTH = 1.2
GOAL_TAIL_S = 5.0

# Wide enough for the tables when the output is a file or a pipe (rich's default there is 80).
console = Console(highlight=False, soft_wrap=True, width=150)


@dataclass
class SideResult:
    side: str
    trials: int
    wall_s: float
    ideal_s: float
    failed: str | None = None
    cpu_s: float | None = None
    user_s: float | None = None
    tail_s: float | None = None
    max_rss_mb: float | None = None
    pieces: dict[str, dict[str, float]] = field(default_factory=dict)
    refused: int | None = None
    """Events and artifacts Prefect refused, as its client logged them (tunepod's side only)."""

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.ideal_s

    def bookkeeping_ms(self, piece: str | None = None) -> float | None:
        """Wall ms per trial of one piece, or of every piece on a trial's path (``PIECES``)."""
        if not self.pieces:
            return None
        names = [piece] if piece else [p for p in PIECES if p in self.pieces]
        return 1000 * sum(self.pieces.get(n, {}).get("seconds", 0.0) for n in names) / self.trials

    def bookkeeping_cpu_ms(self, piece: str | None = None, figure: str = "cpu_s") -> float | None:
        """The calling threads' CPU ms per trial of one piece, or of all of them, the MLflow writes
        included (the Prefect task run, which spans threads, has none of its own here); ``figure``
        "user_s": of it, the CPU in user space."""
        if not self.pieces:
            return None
        names = [piece] if piece else [*PIECES, BACKGROUND]
        return 1000 * sum(self.pieces.get(n, {}).get(figure, 0.0) for n in names) / self.trials


def write_spec(folder: Path, args: argparse.Namespace, trials: int) -> Path:
    data = folder / "data"
    data.mkdir()
    (data / "README").write_text("the scale benchmark stages this folder\n")
    tune = {
        "train": {
            "entrypoint": str(HERE / "trainer.py"),
            "args": {"sleep_s": args.sleep_s, "reports": args.reports},
            "resources": {"num_nodes": 1, "procs_per_node": 1},
        },
        # A study of its own in a shared database: one per run, named after the run's folder.
        "study": {"name": f"scale-{folder.name}" if args.optuna_storage else "scale",
                  "storage": args.optuna_storage or f"journal://{folder / 'optuna.log'}", "metric": "score",
                  "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "num_trials": trials, "num_parallel": args.parallel, "sampler": "random", "seed": 0,
        "pruner": {"kind": "none"},
    }  # fmt: skip
    spec = {
        "name": "scale",
        # An experiment of its own on a shared server: a trial's run is found by study and number.
        "tracking": {"uri": args.mlflow_uri or f"sqlite:///{folder}/mlflow.db", "experiment": folder.name},
        "launcher": {"kind": "local", "root": str(folder / "shared")},
        "steps": {
            "data": {"uses": "stage", "with": {"source": str(data), "target": "fsx:///datasets/scale"}},
            "search": {"uses": "tune", "needs": ["data"], "with": tune},
        },
    }
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_tunepod(folder: Path, args: argparse.Namespace, trials: int) -> SideResult:
    spec = write_spec(folder, args, trials)
    stats = folder / "probe.json"
    command = [sys.executable, "-m", "benchmarks.scale.probe", str(stats), "run", str(spec)]
    env_api = {"PREFECT_API_URL": args.prefect_api} if args.prefect_api else {}
    wall_s, failed = _timed(command, folder / "tunepod.log", env_api)
    result = SideResult("tunepod", trials, wall_s, trials * args.sleep_s / args.parallel, failed)
    if stats.exists():
        probe = json.loads(stats.read_text())
        result.cpu_s, result.user_s, result.pieces = probe["cpu_s"], probe.get("user_s"), probe["pieces"]
        result.tail_s, result.max_rss_mb = probe.get("tail_s"), probe.get("max_rss_mb")
    result.refused = _refusals(folder / "tunepod.log")
    study = f"scale-{folder.name}" if args.optuna_storage else "scale"
    ended = len(list((folder / "shared" / "jobs" / study).glob("trial-*/result.json")))
    if failed is None and ended != trials:
        result.failed = f"{ended} of {trials} trials wrote a result; see {folder / 'tunepod.log'}"
    return result


def _refusals(log: Path) -> int:
    """How many events or artifacts Prefect's client refused to publish (too large, say)."""
    with log.open(errors="replace") as lines:
        return sum(1 for line in lines if "Refusing to publish" in line)


def run_ray(folder: Path, args: argparse.Namespace, trials: int) -> SideResult:
    out = folder / "ray.json"
    command = [
        sys.executable, "-m", "benchmarks.scale.ray_side", str(out), "--trials", str(trials),
        "--parallel", str(args.parallel), "--sleep-s", str(args.sleep_s), "--reports", str(args.reports),
        "--storage", str(folder / "ray"), *(["--fresh-actors"] if args.ray_fresh_actors else []),
    ]  # fmt: skip
    wall_s, failed = _timed(command, folder / "ray.log", {})
    result = SideResult("Ray Tune", trials, wall_s, trials * args.sleep_s / args.parallel, failed)
    if failed is None:
        counts = json.loads(out.read_text())
        if counts["trials"] != trials or counts["errored"]:
            result.failed = f"Ray Tune: {counts}; see {folder / 'ray.log'}"
    return result


def _timed(command: list[str], log: Path, env: dict[str, str]) -> tuple[float, str | None]:
    import os

    started = time.perf_counter()
    with log.open("wb") as out:
        code = subprocess.run(
            command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, check=False
        ).returncode
    wall_s = time.perf_counter() - started
    return wall_s, None if code == 0 else f"exit {code}; see {log}"


def print_tables(results: list[SideResult], args: argparse.Namespace) -> None:
    table = Table(title=f"{args.parallel} in flight, trials of {args.sleep_s:g} s ({args.reports} reports)")
    for column in ("trials", "side", "wall s", "ideal s", "overhead s", "overhead / ideal",
                   "bookkeeping ms/trial", "its CPU ms/trial", "orchestrator CPU ms/trial", "tail s",
                   "peak RSS MB"):  # fmt: skip
        table.add_column(column, justify="left" if column == "side" else "right")
    for r in results:
        if r.failed:
            table.add_row(str(r.trials), r.side, "FAILED", "", "", "", "", "", "", "", r.failed)
            continue
        table.add_row(
            str(r.trials), r.side, f"{r.wall_s:.1f}", f"{r.ideal_s:.1f}", f"{r.overhead_s:.1f}",
            f"{r.overhead_s / r.ideal_s:.2f}", _ms(r.bookkeeping_ms()), _ms(r.bookkeeping_cpu_ms()),
            "" if r.cpu_s is None else f"{1000 * r.cpu_s / r.trials:.1f}", _ms(r.tail_s), _ms(r.max_rss_mb),
        )  # fmt: skip
    console.print(table)
    ours = [r for r in results if r.side == "tunepod" and r.pieces]
    if ours:
        pieces = Table(
            title="tunepod bookkeeping per trial, ms: wall time (summed over threads) / the calling "
            "thread's CPU time"
        )
        pieces.add_column("piece")
        for r in ours:
            pieces.add_column(f"{r.trials} trials", justify="right")
        for piece in PIECES:
            pieces.add_row(f"{piece} (on the trial's path)", *[_piece_cell(r, piece) for r in ours])
        pieces.add_row(
            f"{BACKGROUND} (outbox threads, beside the trials)", *[_piece_cell(r, BACKGROUND) for r in ours]
        )
        console.print(pieces)
        for r in ours:
            print_tail(r)
    print_goals(results)


def print_tail(result: SideResult) -> None:
    """The tail's pieces the probe timed (the tune step's end), in seconds of wall time."""
    tail = {name.removeprefix("tail: "): piece["seconds"] for name, piece in result.pieces.items()
            if name.startswith("tail: ")}  # fmt: skip
    if result.tail_s is not None and tail:
        listed = ", ".join(f"{name} {seconds:.2f}" for name, seconds in tail.items())
        console.print(f"tail after the last trial, {result.trials} trials: {result.tail_s:.1f} s; {listed}")


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _piece_cell(result: SideResult, piece: str) -> str:
    cell = _ms(result.bookkeeping_ms(piece))
    # The Prefect task run spans threads (submission to start, end to result): no CPU of its own.
    return cell if piece == "Prefect task run" else f"{cell} / {_ms(result.bookkeeping_cpu_ms(piece))}"


def print_goals(results: list[SideResult]) -> None:
    ok = [r for r in results if not r.failed]
    ours = sorted((r for r in ok if r.side == "tunepod"), key=lambda r: r.trials)
    if not ours:
        return
    largest = ours[-1]
    ray = next((r for r in ok if r.side == "Ray Tune" and r.trials == largest.trials), None)
    if ray is not None:
        met = largest.overhead_s <= ray.overhead_s
        console.print(
            f"goal: tunepod's overhead at {largest.trials} trials <= Ray Tune's: "
            f"{largest.overhead_s:.1f} s vs {ray.overhead_s:.1f} s "
            f"(ratio {largest.overhead_s / max(ray.overhead_s, 1e-9):.2f}) -> {'met' if met else 'MISSED'}"
        )
    refused = {r.trials: r.refused for r in ours if r.refused is not None}
    if refused:
        listed = ", ".join(f"{count} at {trials} trials" for trials, count in refused.items())
        verdict = "met" if not any(refused.values()) else "MISSED"
        console.print(f"goal: no Prefect event or artifact refused: {listed} -> {verdict}")
    if largest.tail_s is not None:
        met = largest.tail_s < GOAL_TAIL_S
        console.print(
            f"goal: tail after the last trial < {GOAL_TAIL_S:.0f} s: {largest.tail_s:.1f} s at "
            f"{largest.trials} trials -> {'met' if met else 'MISSED'}"
        )
    bookkeeping = largest.bookkeeping_ms() or 0.0
    met = bookkeeping <= GOAL_BOOKKEEPING_MS
    console.print(
        f"goal: bookkeeping on a trial's path <= {GOAL_BOOKKEEPING_MS:.0f} ms per trial: "
        f"{bookkeeping:.1f} ms at {largest.trials} trials -> {'met' if met else 'MISSED'}; "
        f"the orchestrator's CPU for all of it, MLflow writes included: "
        f"{largest.bookkeeping_cpu_ms() or 0.0:.1f} ms per trial"
    )
    if len(ours) > 1:
        first = ours[0]
        growth = bookkeeping / max(first.bookkeeping_ms() or 1e-9, 1e-9)
        cpu_growth = (largest.bookkeeping_cpu_ms() or 0.0) / max(first.bookkeeping_cpu_ms() or 1e-9, 1e-9)
        console.print(
            f"goal: bookkeeping flat from {first.trials} to {largest.trials} trials (<= {GOAL_GROWTH}x): "
            f"{growth:.2f}x on the trial's path, {cpu_growth:.2f}x in CPU -> "
            f"{'met' if max(growth, cpu_growth) <= GOAL_GROWTH else 'MISSED'}"
        )
        print_cpu_growth(first, largest)


def print_cpu_growth(first: SideResult, largest: SideResult) -> None:
    """The orchestrator's CPU per trial and each piece's, from the smallest study to the largest; then
    the same in user space alone, the code's own work: the kernel's part (fsync above all) follows
    the filesystem's load over a long run as much as the work asked of it."""
    for figure, label in (("cpu_s", "CPU"), ("user_s", "user-space CPU")):
        growths = _cpu_growths(first, largest, figure)
        listed = ", ".join(f"{name} {growth:.2f}x" for name, growth in growths.items())
        verdict = "met" if all(growth <= GOAL_GROWTH for growth in growths.values()) else "MISSED"
        goal = "goal: " if figure == "cpu_s" else ""
        console.print(
            f"{goal}{label} per trial flat from {first.trials} to {largest.trials} trials "
            f"(<= {GOAL_GROWTH}x): {listed} -> {verdict}"
        )


def _cpu_growths(first: SideResult, largest: SideResult, figure: str) -> dict[str, float]:
    growths = {}
    before_s, after_s = getattr(first, figure), getattr(largest, figure)
    if before_s and after_s:
        growths["orchestrator"] = (after_s / largest.trials) / (before_s / first.trials)
    for piece in (*PIECES, BACKGROUND):
        before, after = first.bookkeeping_cpu_ms(piece, figure), largest.bookkeeping_cpu_ms(piece, figure)
        if piece != "Prefect task run" and before and after:
            growths[piece] = after / before
    return growths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", default="100,1000", help="comma-separated study sizes (default 100,1000)")
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--sleep-s", type=float, default=1.0)
    parser.add_argument("--reports", type=int, default=3)
    parser.add_argument("--prefect-api", help="a running Prefect server's API URL (default: a temporary one)")
    parser.add_argument(
        "--mlflow-uri", help="a running MLflow tracking server (default: SQLite in the temp folder)"
    )
    parser.add_argument(
        "--optuna-storage",
        help="the study's Optuna storage URL, e.g. postgresql://... (default: a journal file beside it)",
    )
    parser.add_argument("--no-ray", action="store_true", help="tunepod alone")
    parser.add_argument(
        "--ray-fresh-actors",
        action="store_true",
        help="Ray Tune with its default reuse_actors=False (a new actor process per trial)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp folders (stores, logs, job dirs)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    results: list[SideResult] = []
    for trials in (int(n) for n in args.trials.split(",")):
        sides = [("tunepod", run_tunepod)] + ([] if args.no_ray else [("ray", run_ray)])
        for name, run in sides:
            folder = Path(tempfile.mkdtemp(prefix=f"tunepod-scale-{name}-{trials}-"))
            console.print(f"[dim]{name}, {trials} trials: {folder}[/dim]")
            result = run(folder, args, trials)
            results.append(result)
            if not args.keep and not result.failed:
                shutil.rmtree(folder, ignore_errors=True)
    print_tables(results, args)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
