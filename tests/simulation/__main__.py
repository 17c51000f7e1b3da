"""``make simulate``: run the tuning loop's simulation over many seeds, or one seed with its trace.

    python -m simulation --seeds 1000 --jobs 2        # many seeds; exit 1 on a violation
    python -m simulation --seeds 1000 --stop-at-first  # the same, ending at the first violating seed
    python -m simulation --seed 4242                   # one seed: its scenario, outcome and trace
    python -m simulation --mutants                     # each fixed defect put back: a seed must find it
    python -m simulation --seed 4242 --shrink          # the same, with the fewest faults that still break it
    python -m simulation --kinds sagemaker,local       # only these backends (a seed's scenario depends on it)

(run from ``tests/``, or with ``tests`` on ``PYTHONPATH``, as the Makefile does). A failing seed is
printed with the command that replays it; a replay runs the seed twice and says whether both runs
told the same story, event for event.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from simulation.backends import KINDS
from simulation.mutants import MUTANTS, Mutant, mutant
from simulation.run import Outcome, describe, run_seed
from simulation.scenario import scenario_of
from simulation.shrink import shrink


@dataclass(frozen=True)
class Summary:
    """What a worker sends back about one seed."""

    seed: int
    violations: tuple[str, ...]
    wall_s: float
    simulated_s: float


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds (default 1000)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--jobs", type=int, default=2, help="processes running seeds at once (default 2)")
    parser.add_argument("--seed", type=int, help="run this one seed and print its trace")
    parser.add_argument(
        "--stop-at-first",
        action="store_true",
        help="with --seeds: stop at the first violating seed (mutation testing needs no more)",
    )
    parser.add_argument(
        "--shrink", action="store_true", help="with --seed: the fewest faults that still break it"
    )
    parser.add_argument("--mutant", help="run with this fixed defect put back (see simulation/mutants.py)")
    parser.add_argument(
        "--mutants", action="store_true", help="each fixed defect put back: a seed must find it"
    )
    parser.add_argument(
        "--kinds",
        type=_kinds,
        default=KINDS,
        help=f"the backends seeds draw from, comma separated (default {','.join(KINDS)})",
    )
    args = parser.parse_args(argv)
    with mutant(args.mutant).apply() if args.mutant else contextlib.nullcontext():
        if args.mutants:
            return _hunt(args.first_seed, args.seeds, args.jobs)
        if args.seed is not None:
            return _one(args.seed, args.kinds, shrinking=args.shrink)
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        return _many(seeds, args.jobs, args.kinds, stop_at_first=args.stop_at_first)


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(KINDS)}")
    return kinds


def _replay(seed: int, kinds: tuple[str, ...], mutant_name: str | None = None) -> str:
    """The command that replays ``seed`` as it ran."""
    args = [f"--kinds={','.join(kinds)}"] if kinds != KINDS else []
    args += [f"--mutant={mutant_name}"] if mutant_name else []
    extra = f" SIMULATE_ARGS='{' '.join(args)}'" if args else ""
    return f"make simulate SEED={seed}{extra}"


def _one(seed: int, kinds: tuple[str, ...], *, shrinking: bool) -> int:
    first = run_seed(seed, scenario=scenario_of(seed, kinds=kinds))
    again = run_seed(seed, scenario=scenario_of(seed, kinds=kinds))
    print(describe(first))
    same = first.trace.render() == again.trace.render()
    print(
        f"\nseed {seed}: {'held' if first.held else 'VIOLATED'}; {first.steps} steps, "
        f"{first.simulated_s:.0f} s simulated, {first.orchestrators} tunepod runs"
    )
    print(f"replayed: {'the same trace, event for event' if same else 'A DIFFERENT TRACE (nondeterminism)'}")
    if shrinking and not first.held:
        smallest = shrink(first)
        print("\nshrunk to the fewest faults that still break it:\n")
        print(describe(smallest))
    return 0 if first.held and same else 1


def _many(seeds: range, jobs: int, kinds: tuple[str, ...], *, stop_at_first: bool = False) -> int:
    """Run ``seeds``; with ``stop_at_first``, only until the first seed that reports a violation (with
    several processes, the first to report, not necessarily the lowest). Leaving the loop drops the
    summaries' generator, which ends its worker pool and the seeds still running there."""
    started = time.monotonic()
    failed: list[Summary] = []
    done = 0
    slowest = 0.0
    for summary in _summaries(seeds, jobs, kinds):
        done += 1
        slowest = max(slowest, summary.wall_s)
        if summary.violations:
            failed.append(summary)
            print(f"seed {summary.seed}: {summary.violations[0]}", flush=True)
            if stop_at_first:
                break
        if done % 250 == 0:
            print(
                f"... {done} seeds, {len(failed)} violating, {time.monotonic() - started:.0f} s", flush=True
            )
    elapsed = time.monotonic() - started
    print(
        f"seeds: {done}, violations: {len(failed)} "
        f"({elapsed:.0f} s on {jobs} processes; slowest seed {slowest:.1f} s)"
    )
    for summary in sorted(failed, key=lambda s: s.seed)[:20]:
        print(f"  replay: {_replay(summary.seed, kinds)}   ({'; '.join(summary.violations)[:300]})")
    return 1 if failed else 0


def _hunt(first_seed: int, max_seeds: int, jobs: int) -> int:
    """For each mutant, the first seed (of ``max_seeds``, on the backends it can break) that breaks an
    invariant with the mutant in and holds without it: a seed that breaks one either way shows
    another defect, not the mutant's."""
    survivors = []
    for candidate in MUTANTS:
        started = time.monotonic()
        seeds = list(range(first_seed, first_seed + max_seeds))
        if candidate.found_by is not None:
            seeds.insert(0, candidate.found_by)
        found = _first_finding(candidate, seeds, jobs)
        took = time.monotonic() - started
        if found is None:
            survivors.append(candidate.name)
            print(f"{candidate.name}: NOT FOUND in {max_seeds} seeds ({took:.0f} s): {candidate.defect}")
        else:
            print(f"{candidate.name}: found by seed {found.seed} ({took:.0f} s): {candidate.defect}")
            print(f"    replay: {_replay(found.seed, candidate.kinds, candidate.name)}")
            print(f"    {found.violations[0][:300]}", flush=True)
    print(f"mutants: {len(MUTANTS)}, found: {len(MUTANTS) - len(survivors)}")
    return 1 if survivors else 0


def _first_finding(candidate: Mutant, seeds: Sequence[int], jobs: int) -> Summary | None:
    """The first seed, in the order the seeds end, that breaks an invariant with ``candidate`` in
    and none without it (checked in this process, the mutant out)."""
    for mutated in _mutated_summaries(candidate, seeds, jobs):
        if mutated.violations and not _summarize(mutated.seed, candidate.kinds).violations:
            return mutated
    return None


def _mutated_summaries(candidate: Mutant, seeds: Sequence[int], jobs: int) -> Iterator[Summary]:
    if jobs <= 1:
        for seed in seeds:
            with candidate.apply():
                summary = _summarize(seed, candidate.kinds)
            yield summary  # the mutant out again: the caller runs the seed without it
        return
    # The workers are forked with the mutant in and keep it; this process puts it back out at once.
    with candidate.apply():
        pool = multiprocessing.get_context("fork").Pool(jobs)
    with pool:
        summarize = functools.partial(_summarize, kinds=candidate.kinds)
        yield from pool.imap_unordered(summarize, seeds, chunksize=4)


def _summaries(seeds: Sequence[int], jobs: int, kinds: tuple[str, ...]) -> Iterator[Summary]:
    summarize = functools.partial(_summarize, kinds=kinds)
    if jobs <= 1:
        yield from map(summarize, seeds)
        return
    # Forked workers: each seed installs its own world, so nothing is shared between them but code.
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap_unordered(summarize, seeds, chunksize=4)


def _summarize(seed: int, kinds: tuple[str, ...]) -> Summary:
    started = time.monotonic()
    outcome: Outcome = run_seed(seed, scenario=scenario_of(seed, kinds=kinds))
    found = tuple(f"{v.invariant}: {v.detail}" for v in outcome.violations)
    return Summary(seed, found, time.monotonic() - started, outcome.simulated_s)


if __name__ == "__main__":
    sys.exit(main())
