"""Where every decision of a simulated run comes from: a seeded random source.

The scheduler asks which runnable thread goes on; the backends, stores and trackers ask whether a
fault strikes at a call and how long a call takes. A seed fixes them all, so a seed replays its run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


class Choices:
    """The decisions of one run, drawn from ``random.Random(seed)``."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._random = random.Random(seed)

    def pick(self, options: Sequence[T]) -> T:
        return options[self._random.randrange(len(options))]

    def chance(self, probability: float) -> bool:
        return probability > 0 and self._random.random() < probability

    def uniform(self, low: float, high: float) -> float:
        return self._random.uniform(low, high)

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        return self._random.randint(low, high)
