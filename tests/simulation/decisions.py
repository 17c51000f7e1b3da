"""The referee's own account of ASHA's decisions: what Optuna held when, and the rule, re-derived.

A decision is judged on what Optuna held (its intermediate values), not on the jobs' metrics files:
ASHA ranks the values the orchestrators told Optuna, and a report still in a metrics file, not yet
told, was no part of any decision. Every value told is logged in order (``ToldLog``: a sequence
number per value), so that the population of a rung at any moment can be rebuilt.

A decision is made at a moment the referee cannot see exactly: the deciding thread read the trials a
few yield points before it acted, while other threads told values; an orchestrator that crashed may
have decided what the next one carries out. So each decision is judged over a *window* of moments,
from the first it could have been made at to the last, and is right when the rule gives it at one of
them. The rule is the referee's own (``HalvingRule``), from the spec's rungs, never
``tunepod.hpo.asha``'s: a defect there must not fool the referee too.

- a **pause** at rung ``r`` of a job judged from rung ``f`` on (0, or the rung after the one it was
  promoted from): the trial held a value at ``r``, and at some rung from ``f`` to ``r`` it was outside
  the top at some moment from its arrival there to the pause being written (``r`` itself, but for a
  pause carried out after a crash, whose rung is judged again, or the highest reached);
- a **go on** past a rung (a job that was judged there and not paused): inside the top at a moment of
  one of its judgements (each driver's first look at the rung: from the value's arrival, or the
  driver's first report, to its next call's reports), unless that look already saw the trial's last
  step (a job that is finishing is never paused); a look made once the job had ended (a driver that
  re-attached late) decides nothing;
- a **promotion** by the rule (not for an idle slot) from rung ``r``: inside the top at ``r`` at some
  moment from the pause being written to the promotion being written.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from optuna.trial import FrozenTrial

from tunepod.hpo.asha import AshaState
from tunepod.spec.models import PrunerSpec

JobRunning = Callable[[int, float], bool]
"""Whether a job of trial ``number`` ran at simulated time ``at`` (the ground truth's)."""
_ONE_CALL_S = 1.0
"""A driver calls its report feed once a poll, 1 s apart at the least; the values one call tells are
apart only by the first backoffs of a storage call retried (0.2 s, 0.4 s, 0.8 s)."""


@dataclass(frozen=True)
class Told:
    """One intermediate value as it reached Optuna."""

    seq: int
    at: float
    """The simulated time it was told."""
    process: str
    number: int
    step: int
    value: float


@dataclass
class ToldLog:
    """Every intermediate value told to Optuna, in order: what each trial held at any moment."""

    told: list[Told] = field(default_factory=list)
    by_trial: dict[int, list[Told]] = field(default_factory=dict)

    @property
    def seq(self) -> int:
        """The moment now: the number of values told so far."""
        return len(self.told)

    def add(self, at: float, process: str, number: int, step: int, value: float) -> None:
        told = Told(len(self.told) + 1, at, process, number, step, value)
        self.told.append(told)
        self.by_trial.setdefault(number, []).append(told)

    def values(self, number: int, at: int) -> dict[int, float]:
        """Trial ``number``'s intermediate values at moment ``at``."""
        told = self.by_trial.get(number, [])
        return {t.step: t.value for t in told[: bisect.bisect_right([t.seq for t in told], at)]}

    def moments(self, start: int, end: int, units: int) -> Iterator[int]:
        """``start``, then each moment to ``end`` at which a value that reaches ``units`` was told
        (only those can change who a rung of ``units`` keeps)."""
        yield start
        yield from (t.seq for t in self.told[start:end] if t.step + 1 >= units)


@dataclass(frozen=True)
class HalvingRule:
    """Successive halving as the spec states it: at rungs of ``min_resource x reduction_factor^k``
    units below ``max_resource`` (a unit: a step + 1), the top ``1 / reduction_factor`` of the trials
    there so far go on, and the leader always does."""

    rungs: tuple[int, ...]
    reduction_factor: int
    max_resource: int
    maximize: bool = True

    @classmethod
    def of(cls, spec: PrunerSpec, *, maximize: bool = True) -> HalvingRule:
        assert spec.max_resource is not None, "asha has a max_resource"
        rungs, units = [], spec.min_resource
        while units < spec.max_resource:
            rungs.append(units)
            units *= spec.reduction_factor
        return cls(tuple(rungs), spec.reduction_factor, spec.max_resource, maximize)

    def value_at(self, values: dict[int, float], rung: int) -> float | None:
        """The value told at the first step that reached ``rung``."""
        reached = [step for step in values if step + 1 >= self.rungs[rung]]
        value = values[min(reached)] if reached else None
        return value if value is not None and math.isfinite(value) else None

    def keeps(self, number: int, rung: int, log: ToldLog, at: int) -> bool:
        """Trial ``number`` is among those the rung keeps at moment ``at``."""
        valued = {n: v for n in log.by_trial if (v := self.value_at(log.values(n, at), rung)) is not None}
        if number not in valued:
            return False
        sign = 1.0 if self.maximize else -1.0
        mine = sign * valued[number]
        ahead = sum(sign * v > mine or (sign * v == mine and n < number) for n, v in valued.items())
        return ahead < max(1, len(valued) // self.reduction_factor)

    def arrival(self, number: int, rung: int, log: ToldLog, after: int = 0) -> int | None:
        """The moment trial ``number`` first held a value at ``rung`` (after moment ``after``)."""
        for told in log.by_trial.get(number, []):
            if told.seq > after and told.step + 1 >= self.rungs[rung]:
                return told.seq
        return None

    def ever(self, keeps: bool, number: int, rung: int, log: ToldLog, window: tuple[int, int]) -> bool:
        """At some moment of ``window``, the rung keeps trial ``number`` (``keeps``), or does not."""
        moments = log.moments(*window, self.rungs[rung])
        return any(self.keeps(number, rung, log, at) is keeps for at in moments)


@dataclass(frozen=True)
class Segment:
    """One job's stretch of a trial under ASHA: from its start or a promotion to a pause or the end."""

    number: int
    first_rung: int
    """The first rung it is judged at."""
    start: int
    """The moment it began (0, or its promotion's)."""
    end: int
    """The moment it ended (its pause's; the end of the run for the last one)."""
    paused_at: int | None
    """The rung it was paused at; None for a segment that was not paused."""


def segments(number: int, writes: list[tuple[int, AshaState]], end: int) -> list[Segment]:
    """Trial ``number``'s segments from its ASHA states as written (``(moment, state)``, in order; a
    state written again is one write)."""
    found, first, start, paused = [], 0, 0, False
    for at, state in writes:
        if state.paused and not paused:
            found.append(Segment(number, first, start, at, state.rung))
            paused = True
        elif not state.paused and paused:
            first, start, paused = state.rung + 1, at, False
    if not paused:
        found.append(Segment(number, first, start, end, None))
    return found


def judged_windows(
    rule: HalvingRule, segment: Segment, rung: int, log: ToldLog, running: JobRunning
) -> list[tuple[int, int]]:
    """The windows in which a driver of the segment's job looked at ``rung`` while its job ran (see
    the module docstring); empty where a look saw the job finishing (nothing to judge)."""
    arrival = rule.arrival(segment.number, rung, log, segment.start)
    if arrival is None or arrival > segment.end:
        return []
    told = [t for t in log.by_trial.get(segment.number, []) if segment.start < t.seq <= segment.end]
    batches = _batches(told)
    windows = []
    for index, batch in enumerate(batches):
        new_driver = index == 0 or batches[index - 1][0].process != batch[0].process
        if not (batch[0].seq <= arrival <= batch[-1].seq or (new_driver and batch[0].seq > arrival)):
            continue
        # The look follows the batch; its window runs on to the next call's (a retry may split one).
        looked = [batch]
        for following in batches[index + 1 : index + 2]:
            if following[0].process != batch[0].process:
                break
            looked.append(following)
        after = batches[index + len(looked) : index + len(looked) + 1]
        end = after[0][0].seq - 1 if after else segment.end
        if any(t.step + 1 >= rule.max_resource for group in looked for t in group):
            return []  # a look that saw the job's last step judges nothing
        # A pause of a job that has ended is no pause: the job must still run when the look decides,
        # after its last value (an orchestrator stalled in the middle of telling them, the job may
        # have finished meanwhile).
        decided_at = looked[-1][-1].at
        if running(segment.number, batch[-1].at) and running(segment.number, decided_at):
            windows.append((batch[0].seq, end))
    return windows


def _batches(told: list[Told]) -> list[list[Told]]:
    """One trial's values, grouped as told by one call of a driver's report feed: consecutive, by one
    process, less than ``_ONE_CALL_S`` apart."""
    batches: list[list[Told]] = []
    for told_one in told:
        last = batches[-1][-1] if batches else None
        if last is not None and last.process == told_one.process and told_one.at - last.at < _ONE_CALL_S:
            batches[-1].append(told_one)
        else:
            batches.append([told_one])
    return batches


def passed_rungs(rule: HalvingRule, segment: Segment, log: ToldLog) -> list[int]:
    """The rungs the segment's job went on past: from its first rung to the one it was paused at, or
    to the highest it reached."""
    if segment.paused_at is not None:
        return list(range(segment.first_rung, segment.paused_at))
    values = log.values(segment.number, segment.end)
    return [r for r in range(segment.first_rung, len(rule.rungs)) if rule.value_at(values, r) is not None]


def asha_verdicts(
    rule: HalvingRule,
    trial: FrozenTrial,
    writes: list[tuple[int, AshaState]],
    log: ToldLog,
    running: JobRunning,
) -> Iterator[str]:
    """What is wrong with ASHA's decisions on ``trial`` (see the module docstring)."""
    number = trial.number
    found = segments(number, writes, log.seq)
    for segment in found:
        for rung in passed_rungs(rule, segment, log):
            windows = judged_windows(rule, segment, rung, log, running)
            if windows and not any(rule.ever(True, number, rung, log, w) for w in windows):
                yield f"trial {number} went on past rung {rung} outside its top (judged in {windows})"
        if segment.paused_at is not None:
            yield from _pause_verdict(rule, segment, log)
    promotions = [(at, state) for at, state in writes if not state.paused and not state.idle]
    for at, state in promotions:
        paused = [s for s in found if s.paused_at == state.rung and s.end <= at]
        if paused and not rule.ever(True, number, state.rung, log, (paused[-1].end, at)):
            yield f"trial {number} promoted from rung {state.rung} outside its top"


def _pause_verdict(rule: HalvingRule, segment: Segment, log: ToldLog) -> Iterator[str]:
    number, rung = segment.number, segment.paused_at
    assert rung is not None
    if rung < segment.first_rung or rule.value_at(log.values(number, segment.end), rung) is None:
        first = segment.first_rung
        yield f"trial {number} paused at rung {rung}, which its job (judged from rung {first}) did not reach"
        return
    for judged in range(segment.first_rung, rung + 1):
        arrival = rule.arrival(number, judged, log)
        if arrival is not None and rule.ever(False, number, judged, log, (arrival, segment.end)):
            return
    yield f"trial {number} paused at rung {rung} while in its top from rung {segment.first_rung} on"
