"""Pacing of API calls: exponential backoff for retries, a token bucket for events. Pure: the
caller reads the clock and sleeps."""

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


class TokenBucket:
    """At most `burst` calls at once, then `rate` per second on average."""

    def __init__(self, rate: float, burst: int, now: float):
        if rate <= 0 or burst < 1:
            raise ValueError(f"token bucket needs rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last = now

    def delay(self, now: float) -> float:
        """Take a token and return 0, or return how long to wait before one is there."""
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate
