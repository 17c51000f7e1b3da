"""What happened in a simulated run, in order: faults, processes, jobs, decisions, violations.

Kept in memory (a run is short); printed when an invariant breaks, so that the seed's story can be
read next to its replay. The kinds, so a reader can filter: ``fault`` (what the run injected),
``process``, ``job`` (what the backend did), ``optuna`` and ``mlflow`` (what the stores took),
``lease``, ``thread`` (a simulated thread that died), ``log`` (the orchestrator's warnings and
errors), ``violation``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    at: float
    kind: str
    text: str

    def render(self, start: float) -> str:
        return f"{self.at - start:9.2f}s  {self.kind:<9} {self.text}"


class Trace:
    def __init__(self, start: float) -> None:
        self.start = start
        self.events: list[Event] = []

    def event(self, at: float, kind: str, text: str) -> None:
        self.events.append(Event(at, kind, text))

    def render(self, *, kinds: frozenset[str] | None = None, last: int | None = None) -> str:
        chosen = [event for event in self.events if kinds is None or event.kind in kinds]
        if last is not None:
            chosen = chosen[-last:]
        return "\n".join(event.render(self.start) for event in chosen)
