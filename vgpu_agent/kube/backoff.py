"""Pacing of API calls: exponential backoff for retries (the shared `Backoff`), a token bucket
for events. Pure: the caller reads the clock and sleeps."""

from __future__ import annotations

from vgpu_agent.backoff import Backoff

__all__ = ["Backoff", "TokenBucket"]


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
