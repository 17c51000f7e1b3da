"""Checkpoint tiers (``TUNEPOD_CHECKPOINT_TIERS``): how often a save goes to node memory and how often
to the shared file system, and the rule that decides it for each save.

The orchestrator checks the spec's ``train.checkpoints`` block and hands it over as JSON; the job
reads it back into ``CheckpointTiers``. Without it every save goes to the shared folder, as before.
Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_MEMORY_DIR = "/dev/shm"


@dataclass(frozen=True)
class CheckpointTiers:
    """Where saves go: node memory every ``memory_every_steps`` steps at least, the shared file system
    every ``shared_every_steps`` steps at least, and ``memory_replicas`` copies of each memory save in
    other nodes' memory. Immutable."""

    memory_every_steps: int
    shared_every_steps: int
    memory_replicas: int = 1
    memory_dir: str = DEFAULT_MEMORY_DIR

    def __post_init__(self) -> None:
        for name, minimum in (("memory_every_steps", 1), ("shared_every_steps", 1), ("memory_replicas", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"checkpoints.{name} must be an integer >= {minimum}, got {value!r}")
        if self.shared_every_steps < self.memory_every_steps:
            raise ValueError(
                f"checkpoints.shared_every_steps ({self.shared_every_steps}) is below memory_every_steps "
                f"({self.memory_every_steps}): a shared save is the rarer, safer one; fix: set "
                f"shared_every_steps to at least {self.memory_every_steps}"
            )
        if not self.memory_dir or not Path(self.memory_dir).is_absolute():
            raise ValueError(
                f"checkpoints.memory_dir must be an absolute path on each node (such as /dev/shm), "
                f"got {self.memory_dir!r}"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def read_checkpoint_tiers(env: Mapping[str, str], name: str) -> CheckpointTiers | None:
    """The tiers in variable ``name`` of ``env``; ``None`` when it is unset or empty (every save goes
    to the shared folder). Raises ``ValueError`` naming the variable when it is malformed."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise TypeError("not a JSON object")
        return CheckpointTiers(**fields)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} is not a checkpoint tiers object ({exc}): {raw!r}") from None


@dataclass(frozen=True)
class SaveTargets:
    """Where one ``save_checkpoint`` call goes: either, both or neither."""

    shared: bool
    memory: bool


class TierSchedule:
    """Decides each save's tiers from the steps of the last save to each tier.

    A save goes to the shared folder when at least ``shared_every_steps`` steps passed since the last
    shared save, or when a stop was agreed (the job is about to leave: only the shared folder outlives
    a requeue on other nodes); to memory when at least ``memory_every_steps`` passed since the last
    memory save. A shared save goes to memory too, so the newest step saved is always in memory and a
    restore reads the shared file system only when memory lost it. Steps are counted, not matched
    against multiples, so a script that saves at irregular steps still gets a save at least every N
    and M steps. The first save of a process with nothing restored goes to both, so a job always has
    a shared step early.
    """

    def __init__(self, tiers: CheckpointTiers) -> None:
        self.tiers = tiers
        self.last_shared: int | None = None
        self.last_memory: int | None = None

    def restored(self, step: int, newest_shared: int | None) -> None:
        """A restore of ``step``; ``newest_shared``: the newest shared step then, if any."""
        self.last_memory = step
        self.last_shared = newest_shared

    def targets(self, step: int, stopping: bool) -> SaveTargets:
        shared = stopping or _due(self.last_shared, step, self.tiers.shared_every_steps)
        memory = shared or _due(self.last_memory, step, self.tiers.memory_every_steps)
        return SaveTargets(shared=shared, memory=memory)

    def saved(self, step: int, targets: SaveTargets) -> None:
        if targets.shared:
            self.last_shared = step
        if targets.memory:
            self.last_memory = step


def _due(last: int | None, step: int, every: int) -> bool:
    # A step at or before the last save (a resumed job redoing steps) counts from that step anew.
    return last is None or step - last >= every or step < last
