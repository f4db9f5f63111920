"""A monotonic clock in nanoseconds that moves only when a test moves it: what the controller,
the region store and the simulator take as `clock`, so that a test decides what time it is."""

from __future__ import annotations


class ManualClock:
    def __init__(self, start_ns: int = 10**12) -> None:
        self.ns = start_ns

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)
