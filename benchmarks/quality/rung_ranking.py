"""How well a rung's ranking predicts the final values: ASHA's value against its forecast, offline.

    .venv/bin/python -m benchmarks.quality --no-digits --llm --llm-seeds 2 --first-seed 90000 \\
        --arms random --full-budget --root /tmp/llm-curves      # trials trained to their end
    .venv/bin/python -m benchmarks.quality.rung_ranking /tmp/llm-curves --metric val_perplexity \\
        --minimize --rung-steps 60,80,100 --final-step 120 --target 13.0

Reads every trial's reports (``<root>/shared/jobs/<study>/trial-N/metrics.jsonl``) of studies whose
trials ran to ``--final-step`` (random search with no pruner), and prints, for each rung step, the
rank correlation (Spearman) between the final values and what ASHA would rank the trials by there:
the value at the rung (``rank_by: value``) and the final value its curve up to the rung forecasts
(``rank_by: forecast``, ``tunepod.hpo.asha.forecast_final``); with ``--target``, where the trials
that reach it by their end rank, and how many of them ASHA's top third keeps.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.lcbench.metrics import ranks_of
from benchmarks.quality.timing import trial_reports
from tunepod.hpo.asha import forecast_final

Curve = dict[int, float]
Ranker = Callable[[Curve, int], float]


def full_curves(root: Path, metric: str, final_step: int) -> list[Curve]:
    """Every trial's ``metric`` by step, of the trials that reported ``final_step``."""
    curves = []
    for jobs_dir in sorted((root / "shared" / "jobs").iterdir()):
        for reports in trial_reports(jobs_dir).values():
            curve = {r.step: r.metrics[metric] for r in reports if metric in r.metrics}
            if final_step in curve:
                curves.append(curve)
    return curves


def ranks(values: Sequence[float]) -> list[float]:
    """Each value's rank, 0 the lowest (ties share their mean rank)."""
    return [rank - 1 for rank in ranks_of(values)]


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    rx, ry = ranks(xs), ranks(ys)
    mean_x, mean_y = sum(rx) / len(rx), sum(ry) / len(ry)
    covariance = sum((a - mean_x) * (b - mean_y) for a, b in zip(rx, ry, strict=True))
    spread = math.sqrt(sum((a - mean_x) ** 2 for a in rx) * sum((b - mean_y) ** 2 for b in ry))
    return covariance / spread if spread else math.nan


def rankers(final_step: int, maximize: bool) -> dict[str, Ranker]:
    def value(curve: Curve, rung_step: int) -> float:
        return curve[min(step for step in curve if step >= rung_step)]

    def forecast(curve: Curve, rung_step: int) -> float:
        at = min(step for step in curve if step >= rung_step)
        points = [(step + 1, v) for step, v in sorted(curve.items()) if step <= at]
        return forecast_final(points, final_step + 1, maximize=maximize)

    return {"value": value, "forecast": forecast}


def report(curves: list[Curve], args: argparse.Namespace) -> None:
    sign = -1.0 if args.maximize else 1.0  # rank 0 is the best
    finals = [sign * curve[args.final_step] for curve in curves]
    target: float | None = args.target
    reached = [i for i, c in enumerate(curves) if target is not None and reaches(c, target, args.maximize)]
    kept = max(1, len(curves) // 3)
    print(f"{len(curves)} curves to step {args.final_step}; {len(reached)} reach the target by their end")
    for rung_step in args.rung_steps:
        for name, ranker in rankers(args.final_step, args.maximize).items():
            merits = [sign * ranker(curve, rung_step) for curve in curves]
            line = f"rung step {rung_step:>5} by {name:<8}: spearman {spearman(merits, finals):6.3f}"
            if reached:
                order = ranks(merits)
                where = sorted(int(order[i]) for i in reached)
                line += f"; reaching ranks {where}, {sum(r < kept for r in where)} in the top {kept}"
            print(line)


def reaches(curve: Curve, target: float, maximize: bool) -> bool:
    """The curve reaches ``target`` at some step."""
    return max(curve.values()) >= target if maximize else min(curve.values()) <= target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality.rung_ranking", description=__doc__)
    parser.add_argument("root", type=Path, help="a --root of python -m benchmarks.quality (kept)")
    parser.add_argument("--metric", required=True)
    parser.add_argument("--minimize", dest="maximize", action="store_false")
    parser.add_argument("--rung-steps", type=lambda t: [int(s) for s in t.split(",")], required=True)
    parser.add_argument("--final-step", type=int, required=True)
    parser.add_argument("--target", type=float)
    args = parser.parse_args(argv)
    curves = full_curves(args.root, args.metric, args.final_step)
    if not curves:
        parser.error(f"{args.root}: no trial reported {args.metric} at step {args.final_step}")
    report(curves, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
