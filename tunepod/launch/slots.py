"""How many trials a launcher's cluster can run at once: what ``num_parallel: auto`` becomes.

A launcher that can tell implements ``KnowsSlots`` (the local launcher from this machine's CPUs, the
Slurm launcher from ``sinfo``); one that cannot (SageMaker starts instances per job, and an EKS
cluster's free capacity is its scheduler's to know) does not, and ``auto`` is refused for it at spec
load. The answer is read once, when a tune step starts: it is a snapshot, not a reservation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tunepod.spec.resources import Resources


@dataclass(frozen=True)
class Slots:
    """Trials the cluster can run at once, and why, in words for the log."""

    count: int
    why: str
    """E.g. ``3 idle nodes in partition nodes / 1 node per trial = 3``."""


@runtime_checkable
class KnowsSlots(Protocol):
    """A launcher that can say how many jobs of ``resources`` its cluster runs at once."""

    def trial_slots(self, resources: Resources) -> Slots:
        """At least 1 (a cluster with nothing free now still runs trials one after another). Raises
        ``TransientError`` when the cluster did not answer, ``TunepodError`` when it cannot tell."""
        ...


def divided(available: int, have: str, per_trial: int, unit: str) -> Slots:
    """``available`` of something (``have`` says it: ``4 CPUs``, ``3 idle nodes in partition p``)
    shared by trials of ``per_trial`` ``unit`` each: ``4 CPUs / 2 processes per trial = 2``, at least 1."""
    count = max(1, available // per_trial)
    floor = " (at least 1)" if available < per_trial else ""
    return Slots(count, f"{have} / {counted(per_trial, unit)} per trial = {count}{floor}")


def counted(number: int, noun: str) -> str:
    """``1 node``, ``2 nodes``, ``2 processes``."""
    if number == 1:
        return f"1 {noun}"
    return f"{number} {noun}es" if noun.endswith("s") else f"{number} {noun}s"
