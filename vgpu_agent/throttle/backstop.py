"""The agent's own check of every container against its limits, which no shim setting can switch
off. Pure: the watcher (`throttle/watch.py`) feeds it what NVML and the host say.

- Memory: what NVML reports the container's processes (attributed on host evidence, as for the
  throttle) hold on a GPU, against the region's memory limit. NVML counts each process's CUDA
  context, which the shim does not, so each process is allowed `context_bytes` on top.
- SM share: the container's measured utilization averaged over `window_s`, against its core
  limit plus `sm_margin_pct` points. Only `strict` containers: a `work-conserving` one may run
  above its limit on capacity nobody else uses, and `off` has no limit.

A breach is reported when it starts, and again only after it has cleared: one episode, one
report, however long it lasts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

BreachKind = Literal["memory", "sm"]
Key = tuple[str, int]  # (alloc_id, region device index)


@dataclass(frozen=True)
class BackstopParams:
    window_s: float = 30.0
    sm_margin_pct: float = 10.0
    context_bytes: int = 768 << 20  # per process: a CUDA context, which the shim does not count
    min_coverage: float = 0.8  # of the window, before an SM average is judged

    def __post_init__(self) -> None:
        if not 0 < self.window_s < 86400:
            raise ValueError(f"backstop window must be in (0, 86400) s, got {self.window_s!r}")
        if not 0 <= self.sm_margin_pct <= 100:
            raise ValueError(f"backstop SM margin must be in [0, 100], got {self.sm_margin_pct!r}")
        if self.context_bytes < 0:
            raise ValueError(f"context allowance must be >= 0, got {self.context_bytes!r}")
        if not 0 < self.min_coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {self.min_coverage!r}")


@dataclass(frozen=True)
class Breach:
    alloc_id: str
    dev: int
    kind: BreachKind
    measured: float  # bytes, or percent of SM time averaged over the window
    allowed: float  # the same unit: limit plus the allowances

    def describe(self) -> str:
        if self.kind == "memory":
            return (f"GPU memory in use {self.measured / (1 << 20):.0f} MiB on device {self.dev}, "
                    f"above the {self.allowed / (1 << 20):.0f} MiB allowed")
        return (f"SM share {self.measured:.1f}% on device {self.dev} over the window, above the "
                f"{self.allowed:.1f}% allowed")


class _Window:
    """One device's SM samples over the window, with their sum kept as they come and go (the
    watch judges every device every round: summing the window each time was most of its cost).
    The sum is made afresh once the window has turned over, so float rounding cannot build up."""

    __slots__ = ("dropped", "samples", "total")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()
        self.total = 0.0
        self.dropped = 0

    def add(self, now_s: float, util: float) -> None:
        self.samples.append((now_s, util))
        self.total += util

    def drop_before(self, since_s: float) -> None:
        samples = self.samples
        while samples and samples[0][0] < since_s:
            self.total -= samples.popleft()[1]
            self.dropped += 1
        if self.dropped >= len(samples):
            self.total = math.fsum(u for _, u in samples)
            self.dropped = 0

    def mean(self) -> float:
        return self.total / len(self.samples)


class Backstop:
    """Per container device: the recent SM samples and which breaches are in progress."""

    def __init__(self, params: BackstopParams | None = None):
        self.params = params or BackstopParams()
        self._sm: dict[Key, _Window] = {}
        self._open: set[tuple[Key, BreachKind]] = set()

    def memory(self, key: Key, used_bytes: int, processes: int, limit_bytes: int) -> Breach | None:
        """Judge one device's NVML memory; `limit_bytes` 0 means no limit."""
        allowed = limit_bytes + max(0, processes) * self.params.context_bytes
        over = limit_bytes > 0 and used_bytes > allowed
        return self._episode(key, "memory", over, float(used_bytes), float(allowed))

    def sm(self, key: Key, now_s: float, util: float | None, limit_pct: float,
           strict: bool) -> Breach | None:
        """Add one measurement (None: nothing new) and judge the window's average."""
        window = self._sm.get(key)
        if window is None:
            window = self._sm[key] = _Window()
        if util is not None:
            window.add(now_s, min(100.0, max(0.0, util)))
        span = self.params.window_s
        window.drop_before(now_s - span)
        samples = window.samples
        covered = bool(samples) and now_s - samples[0][0] >= span * self.params.min_coverage
        if not strict or not covered:
            # nothing to judge (yet): an open episode stays open until a judgement clears it
            return None
        allowed = min(100.0, limit_pct + self.params.sm_margin_pct)
        mean = window.mean()
        return self._episode(key, "sm", mean > allowed, mean, allowed)

    def forget_except(self, keys: Iterable[Key]) -> None:
        keep = set(keys)
        self._sm = {k: v for k, v in self._sm.items() if k in keep}
        self._open = {(k, kind) for k, kind in self._open if k in keep}

    def _episode(self, key: Key, kind: BreachKind, over: bool, measured: float,
                 allowed: float) -> Breach | None:
        if not over:
            self._open.discard((key, kind))
            return None
        if (key, kind) in self._open:
            return None
        self._open.add((key, kind))
        return Breach(key[0], key[1], kind, measured, allowed)
