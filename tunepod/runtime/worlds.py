"""The worlds file: each world size a job ran with, so that a job whose group re-formed with fewer
nodes (an elastic job, ``resources.min_nodes``) or came back on another number of them knows it.

Ownership: rank 0 appends one JSON line, flushed and fsynced, to ``worlds.jsonl`` beside the metrics
file, when ``load_latest_checkpoint`` finds the job in a world other than the one it last ran in (the
first call of a job's first process always does)::

    {"step": 8, "world_size": 2, "nodes": 1, "previous_world_size": 4, "previous_nodes": 2,
     "time": 1733500000.0}

``step`` is the restored step (0 on a fresh start): the world trains the steps after it. Every rank
learns the previous world from rank 0 (``TrainingContext.world_change``), so all of them rescale alike.
The orchestrator only reads the file and mirrors it into the trial's MLflow run (the metric
``tunepod.world_size`` at each record's step, ``tunepod.tracking.mirror``); rank 0 also says each change
in the job's log. Standard library only.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tunepod.runtime.files import append_line_durably

WORLDS_FILE_NAME = "worlds.jsonl"


@dataclass(frozen=True)
class World:
    """One line of the worlds file: a world the job ran in, from ``step`` on."""

    step: int
    world_size: int
    nodes: int
    previous_world_size: int | None
    previous_nodes: int | None
    time: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class WorldChange:
    """The job's group is not the one that trained the restored step: ``previous_world_size``
    processes on ``previous_nodes`` nodes then, ``world_size`` on ``nodes`` now, from ``step`` on.
    A script that keeps the global batch scales its per-rank batch by ``1 / scale``; one that keeps
    the per-rank batch may scale its learning rate by ``scale``."""

    step: int
    previous_world_size: int
    world_size: int
    previous_nodes: int
    nodes: int

    @property
    def scale(self) -> float:
        """``world_size / previous_world_size``: below 1 when the group shrank."""
        return self.world_size / self.previous_world_size

    def __str__(self) -> str:
        return (
            f"world size changed from {self.previous_world_size} ({self.previous_nodes} node(s)) to "
            f"{self.world_size} ({self.nodes} node(s)) at step {self.step}"
        )


def worlds_file(metrics_file: Path) -> Path:
    """Where a job's rank 0 records its worlds: beside its metrics file."""
    return metrics_file.parent / WORLDS_FILE_NAME


def read_worlds(path: Path) -> list[World]:
    """Every whole, well-formed line of ``path`` (none when it does not exist); a line still being
    written, or one that is not a world, is skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    found = []
    for line in text.split("\n")[:-1]:  # the last piece: not yet whole
        try:
            raw = json.loads(line)
            found.append(
                World(
                    step=int(raw["step"]),
                    world_size=int(raw["world_size"]),
                    nodes=int(raw["nodes"]),
                    previous_world_size=_optional_int(raw.get("previous_world_size")),
                    previous_nodes=_optional_int(raw.get("previous_nodes")),
                    time=float(raw["time"]),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return found


def last_world(path: Path) -> tuple[int, int] | None:
    """``(world_size, nodes)`` of the world the job last ran in, if it recorded one."""
    worlds = read_worlds(path)
    return (worlds[-1].world_size, worlds[-1].nodes) if worlds else None


def world_change(
    previous: tuple[int, int] | None, world_size: int, nodes: int, step: int
) -> WorldChange | None:
    """The change from ``previous`` (``(world_size, nodes)``) to this world; ``None`` when there is
    no previous world or it is the same."""
    if previous is None or previous == (world_size, nodes):
        return None
    return WorldChange(step, previous[0], world_size, previous[1], nodes)


def record_world(
    path: Path, previous: tuple[int, int] | None, world_size: int, nodes: int, step: int
) -> World | None:
    """Rank 0: append this world when it differs from ``previous`` (the last one recorded), and say a
    change in the job's log; ``None`` when it is the same world."""
    if previous == (world_size, nodes):
        return None
    before_size, before_nodes = previous if previous is not None else (None, None)
    world = World(step, world_size, nodes, before_size, before_nodes, time.time())
    append_line_durably(path, world.to_json())
    change = world_change(previous, world_size, nodes, step)
    if change is not None:
        print(f"tunepod.runtime: {change}", file=sys.stderr, flush=True)
    return world


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
