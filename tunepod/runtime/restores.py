"""The restores file: where each checkpoint restore of a job with checkpoint tiers came from.

Ownership: rank 0 of the job appends one JSON line per restore that found a step
(``load_latest_checkpoint`` with ``TUNEPOD_CHECKPOINT_TIERS``), flushed and fsynced, to
``restores.jsonl`` beside the metrics file::

    {"step": 41, "tier": "peer memory", "sources": ["own memory", "peer memory (10.231.0.12:4711)"],
     "time": 1733500000.0}

``sources`` says where each rank's files came from (``own memory``, ``peer memory (<address>)``,
``shared file system``), in rank order; ``tier`` is the job's: ``peer memory`` when any rank fetched
from another node, else ``own memory``, else ``shared file system``. A fresh start (nothing to
restore) writes nothing. The orchestrator only reads the file and mirrors it into the trial's MLflow
run (``tunepod.tracking.mirror``); a job's log says the same in rank 0's ``restored step N from ...``
line. Standard library only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final, Literal

from tunepod.runtime.files import append_line_durably

log = logging.getLogger(__name__)

# (file, line number) of malformed lines already warned about: the orchestrator rereads the file on
# every sync and should say so once.
_warned_lines: set[tuple[str, int]] = set()

RESTORES_FILE_NAME = "restores.jsonl"
Tier = Literal["own memory", "peer memory", "shared file system"]
"""Where a restore came from. The names below are the only spelling of each (the memory tier's
``RestoredFrom`` and the MLflow tags use them), and mypy holds them to this type."""
OWN_MEMORY: Final[Tier] = "own memory"
PEER_MEMORY: Final[Tier] = "peer memory"
SHARED_FILE_SYSTEM: Final[Tier] = "shared file system"


@dataclass(frozen=True)
class Restore:
    """One line of the restores file: one restore of one attempt of the job."""

    step: int
    tier: str
    sources: tuple[str, ...]
    time: float

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "sources": list(self.sources)}, sort_keys=True)


def restores_file(metrics_file: Path) -> Path:
    """Where a job's rank 0 records its restores: beside its metrics file."""
    return metrics_file.parent / RESTORES_FILE_NAME


def job_tier(sources: Sequence[str]) -> Tier:
    """The job's tier from each rank's source: a peer's memory if any rank needed one (the case a
    lost node makes), else its own memory, else the shared file system."""
    if any(source.startswith(PEER_MEMORY) for source in sources):
        return PEER_MEMORY
    if any(source.startswith(OWN_MEMORY) for source in sources):
        return OWN_MEMORY
    return SHARED_FILE_SYSTEM


def record_restore(path: Path, step: int, sources: Sequence[str]) -> Restore:
    """Rank 0: append the restore of ``step`` (each rank's source in ``sources``) to ``path``."""
    restore = Restore(step, job_tier(sources), tuple(sources), time.time())
    append_line_durably(path, restore.to_json())
    return restore


def read_restores(path: Path) -> list[Restore]:
    """Every whole, well-formed line of ``path`` (none when it does not exist). A line still being
    written, or one that is not a restore, is skipped: a reader never fails the job's tracking."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    found = []
    for number, line in enumerate(text.split("\n")[:-1], start=1):  # the last piece: not yet whole
        try:
            raw = json.loads(line)
            sources = tuple(str(source) for source in raw["sources"])
            found.append(Restore(int(raw["step"]), str(raw["tier"]), sources, float(raw["time"])))
        except (ValueError, KeyError, TypeError):
            if (str(path), number) not in _warned_lines:
                _warned_lines.add((str(path), number))
                log.warning("%s:%d is not a restore record; skipped: %r", path, number, line[:200])
    return found
