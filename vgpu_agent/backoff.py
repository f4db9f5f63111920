"""Exponential backoff for retries, shared by every part that retries. Pure: the caller sleeps."""

from __future__ import annotations

import math
import random
from collections.abc import Callable


class Backoff:
    """Delays of initial, 2*initial, 4*initial, ... capped at `cap`, each scaled by a random
    factor in [1 - jitter, 1] so agents on many nodes do not retry in step."""

    def __init__(
        self,
        initial: float = 0.5,
        cap: float = 60.0,
        jitter: float = 0.5,
        rand: Callable[[], float] = random.random,
    ):
        if initial <= 0 or cap < initial:
            raise ValueError(f"backoff needs 0 < initial <= cap, got initial={initial} cap={cap}")
        if not 0 <= jitter < 1:
            raise ValueError(f"backoff jitter must be in [0, 1), got {jitter}")
        self.initial = initial
        self.cap = cap
        self.jitter = jitter
        self._rand = rand
        self.failures = 0

    def next_delay(self) -> float:
        """Record one more failure and return how long to wait before the next try."""
        base = min(self.cap, math.ldexp(self.initial, min(self.failures, 64)))
        self.failures += 1
        return base * (1 - self.jitter * self._rand())

    def reset(self) -> None:
        self.failures = 0
