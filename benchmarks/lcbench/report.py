"""The tables (rich), the plot (matplotlib, PNG) and the raw numbers (JSON) of an LCBench run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.lcbench.metrics import FRACTIONS, GRID_POINTS, ArmOnInstance, ArmOverall, RunSummary
from benchmarks.lcbench.problem import Budget

REGRET_FLOOR = 1e-4  # plotted regrets are clipped here: a log axis cannot show 0 or a negative


def fraction_text(value: float) -> str:
    return ">1" if math.isinf(value) else f"{value:.2f}"


def regret_text(value: float) -> str:
    return f"{value:.4f}"


def fraction_headers() -> list[str]:
    return [f"regret @{round(f * 100)}%" for f in FRACTIONS]


def instance_table(rows: Sequence[ArmOnInstance], instance: str, baseline: str) -> Table:
    table = Table(title=f"LCBench {instance}: normalized regret (median over seeds)")
    headers = ("arm", *fraction_headers(), f"budget to {baseline}'s final", "sim h at budget end", "trials")
    for header in headers:
        table.add_column(header, justify="left" if header == "arm" else "right")
    for row in (r for r in rows if r.instance == instance):
        table.add_row(
            row.arm,
            *(regret_text(v) for v in row.regret),
            fraction_text(row.fraction_to_random),
            f"{row.end_s / 3600:.2f}",
            f"{row.num_trials:.0f}",
        )
    return table


def overall_table(arms: Sequence[ArmOverall], baseline: str, seeds: int) -> Table:
    table = Table(
        title=f"LCBench, {arms[0].instances if arms else 0} instances x {seeds} seeds: median over instances "
        "of the per-instance medians (mean rank over instances, 1 = best)"
    )
    for header in ("arm", *fraction_headers(), f"budget to {baseline}'s final", "sim h at budget end"):
        table.add_column(header, justify="left" if header == "arm" else "right")
    for arm in arms:
        table.add_row(
            arm.arm,
            *(f"{regret_text(v)} ({rank:.1f})" for v, rank in zip(arm.regret, arm.mean_rank, strict=True)),
            fraction_text(arm.fraction_to_random),
            f"{arm.end_s / 3600:.2f}",
        )
    return table


def markdown_table(arms: Sequence[ArmOverall], baseline: str) -> str:
    """The overall table as Markdown, for benchmarks/README.md."""
    headers = ["arm", *fraction_headers(), f"budget to {baseline}'s final", "sim h at budget end"]
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    for arm in arms:
        cells = [f"{regret_text(v)} ({rank:.1f})" for v, rank in zip(arm.regret, arm.mean_rank, strict=True)]
        lines.append(
            f"| {arm.arm} | {' | '.join(cells)} | {fraction_text(arm.fraction_to_random)} | "
            f"{arm.end_s / 3600:.2f} |"
        )
    return "\n".join(lines)


def print_report(
    console: Console,
    rows: Sequence[ArmOnInstance],
    arms: Sequence[ArmOverall],
    baseline: str,
    seeds: int,
    budget: Budget,
) -> None:
    console.print(
        f"budget: {budget.total_epochs} epochs ({budget.total_epochs / 52:.0f} full trials), "
        f"{budget.n_workers} workers, {budget.startup_s:g} s per job start; regret 0 = the instance's "
        "reference best, 1 = its worst final value; budget fractions in epochs"
    )
    for instance in dict.fromkeys(row.instance for row in rows):
        console.print(instance_table(rows, instance, baseline))
    console.print(overall_table(arms, baseline, seeds))


def emit(
    console: Console,
    runs: Sequence[RunSummary | dict[str, Any]],
    rows: Sequence[ArmOnInstance],
    arms: Sequence[ArmOverall],
    budget: Budget,
    *,
    baseline: str,
    seeds: int,
    markdown: bool,
    plot: Path | None,
    json_file: Path | None,
) -> None:
    """The report on the console, then the Markdown table, the plot and the JSON where asked for."""
    print_report(console, rows, arms, baseline, seeds, budget)
    if markdown:
        console.print(markdown_table(arms, baseline))
    if plot:
        write_plot(plot, rows, arms)
        console.print(f"plot: {plot}")
    if json_file:
        write_json(json_file, runs, rows, arms, budget)
        console.print(f"numbers: {json_file}")


def write_plot(path: Path, rows: Sequence[ArmOnInstance], arms: Sequence[ArmOverall]) -> None:
    """Median regret over the budget: one panel per instance and one for the median over instances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    instances = list(dict.fromkeys(row.instance for row in rows))
    panels = [*instances, "all"]
    columns = min(3, len(panels))
    lines = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(5 * columns, 3.6 * lines), squeeze=False)
    x = (np.arange(GRID_POINTS) + 1) / GRID_POINTS
    style = _line_styles([arm.arm for arm in arms], plt.get_cmap("tab20").colors)
    for ax, panel in zip(axes.flat, panels, strict=False):
        curves = (
            [(arm.arm, arm.grid_regret) for arm in arms]
            if panel == "all"
            else [(row.arm, row.grid_regret) for row in rows if row.instance == panel]
        )
        for name, regret in curves:
            ax.plot(x, np.maximum(regret, REGRET_FLOOR), label=name, **style[name])
        ax.set_yscale("log")
        ax.set_title("median over instances" if panel == "all" else f"instance {panel}")
        ax.set_xlabel("budget used (epochs / total)")
        ax.set_ylabel("normalized regret")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _line_styles(arms: Sequence[str], colors: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """One colour per arm (tab20's dark shades first, then its light ones: up to 20 arms apart), and
    tunepod's arms drawn thicker."""
    shades = [*colors[::2], *colors[1::2]]
    return {
        arm: {"color": shades[i % len(shades)], "linewidth": 2.0 if arm.startswith("tunepod") else 1.0}
        for i, arm in enumerate(arms)
    }


def write_json(
    path: Path,
    runs: Sequence[RunSummary | dict[str, Any]],
    rows: Sequence[ArmOnInstance],
    arms: Sequence[ArmOverall],
    budget: Budget,
) -> None:
    """Every run's regrets and incumbent curve (on the grid), and the aggregates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_document(runs, rows, arms, budget), indent=1) + "\n")


def json_document(
    runs: Sequence[RunSummary | dict[str, Any]],
    rows: Sequence[ArmOnInstance],
    arms: Sequence[ArmOverall],
    budget: Budget,
) -> dict[str, Any]:
    """What ``write_json`` writes; runs read back from such a file are taken as they are."""

    def plain(value: object) -> object:
        if isinstance(value, np.ndarray):
            return [round(float(v), 6) for v in value]
        if isinstance(value, float) and math.isinf(value):
            return None  # "never": JSON has no infinity
        return value

    def record(item: Any, drop: tuple[str, ...] = ()) -> dict[str, object]:
        if isinstance(item, dict):
            return item
        return {k: plain(v) for k, v in asdict(item).items() if k not in drop}

    return {
        "budget": asdict(budget),
        "fractions": list(FRACTIONS),
        "grid_points": GRID_POINTS,
        "runs": [record(run, drop=("incumbent",)) for run in runs],
        "per_instance": [record(row) for row in rows],
        "overall": [record(arm) for arm in arms],
    }
