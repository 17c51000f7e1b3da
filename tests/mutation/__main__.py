"""``make mutate``: how many of the catalog's mutants the tuning loop's simulation finds.

    python -m mutation --seeds 1000                 # every mutant, up to 1,000 seeds each
    python -m mutation --mutants a,b --seeds 300    # only these
    python -m mutation --json mutation.json         # the verdicts, also as JSON

(run with ``tests`` on ``PYTHONPATH``, as the Makefile does). Each mutant of ``mutation/catalog.py`` is
put into a fresh copy of ``tunepod/`` and the simulation runs on that copy, one mutant at a time
(the simulation itself on ``--jobs`` processes), until its first violating seed. Exit 1 when a
mutant survives without a reason written in its ``escapes``, or the simulation could not run on
one; exit 2, before anything runs, when a mutant no longer applies (the catalog went stale).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from mutation.apply import StaleCatalog, mutated_source
from mutation.catalog import MUTANTS, Mutant
from mutation.hunt import Seeds, Verdict, hunt

# Per seed, with room for a loaded machine (1,000 seeds take about 90 s on 2 idle cores), plus start-up.
_TIME_LIMIT_PER_SEED_S = 0.9
_TIME_LIMIT_START_S = 60.0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    chosen = _chosen(args.mutants)
    try:
        for mutant in chosen:
            mutated_source(mutant)
    except StaleCatalog as exc:
        print(exc, file=sys.stderr)
        return 2
    limit = args.time_limit_s or _TIME_LIMIT_START_S + _TIME_LIMIT_PER_SEED_S * args.seeds
    seeds = Seeds(args.seeds, args.first_seed, args.jobs, limit)
    verdicts = [_hunted(mutant, seeds) for mutant in chosen]
    _summarize(verdicts)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(v) for v in verdicts], indent=2) + "\n")
    gaps = [v for v in verdicts if v.survived and v.escapes is None]
    errors = [v for v in verdicts if v.status == "error"]
    return 1 if gaps or errors else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mutation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1000, help="seeds per mutant at most (default 1000)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--jobs", type=int, default=2, help="the simulation's processes (default 2)")
    parser.add_argument("--mutants", help="comma-separated names (default: all of them)")
    parser.add_argument(
        "--time-limit-s",
        type=float,
        help=f"per mutant (default {_TIME_LIMIT_START_S:.0f} s + {_TIME_LIMIT_PER_SEED_S} s per seed)",
    )
    parser.add_argument("--json", type=Path, help="also write the verdicts to this file")
    return parser


def _chosen(names: str | None) -> list[Mutant]:
    if not names:
        return list(MUTANTS)
    by_name = {mutant.name: mutant for mutant in MUTANTS}
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        raise SystemExit(f"no mutant named {', '.join(unknown)}; the catalog has: {', '.join(by_name)}")
    return [by_name[name] for name in wanted]


def _hunted(mutant: Mutant, seeds: Seeds) -> Verdict:
    verdict = hunt(mutant, seeds)
    print(_line(verdict, seeds), flush=True)
    if verdict.violation is not None:
        print(f"    {verdict.violation[:300]}", flush=True)
    if verdict.detail is not None:
        print("    " + verdict.detail.replace("\n", "\n    "), flush=True)
    return verdict


def _line(verdict: Verdict, seeds: Seeds) -> str:
    took = f"{verdict.seconds:.0f} s"
    if verdict.status == "found":
        return f"{verdict.name}: found by seed {verdict.seed} ({took})"
    if verdict.status == "survived":
        return f"{verdict.name}: NOT FOUND in {verdict.seeds_run} seeds ({took})"
    if verdict.status == "timed_out":
        return (
            f"{verdict.name}: NOT FOUND in at least {verdict.seeds_run} of {seeds.count} seeds "
            f"({took}: stopped at the time limit)"
        )
    return f"{verdict.name}: ERROR, the simulation did not run through ({took})"


def _summarize(verdicts: list[Verdict]) -> None:
    found = sum(v.status == "found" for v in verdicts)
    print(f"\nmutation score: {found} of {len(verdicts)} found by the simulation")
    survivors = [v for v in verdicts if v.survived]
    if survivors:
        print("survivors:")
    for verdict in survivors:
        print(f"  {verdict.name} ({verdict.path}): {verdict.escapes or 'no reason written: a gap'}")
    errors = [v.name for v in verdicts if v.status == "error"]
    if errors:
        print(f"the simulation failed to run on: {', '.join(errors)}")


if __name__ == "__main__":
    sys.exit(main())
