"""GPU health as a pure state machine: events in, health changes out. No I/O, no clock.

A GPU turns Unhealthy on a critical XID (one not in the ignore list) or a failing NVML query.
It turns Healthy again once, for the whole recovery period, it has had no new critical XID and no
failing query, and its latest query succeeded. Recovery is judged on the successful query, so a
GPU nobody can query never recovers. A recovery period of 0 disables recovery.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthChange:
    """One GPU changed health. `xid` is the XID that made it Unhealthy, if one did."""

    uuid: str
    healthy: bool
    reason: str
    xid: int | None = None


@dataclass
class _GpuHealth:
    healthy: bool = True
    last_bad: float | None = None  # time of the latest critical XID or failed query
    query_ok: bool = True
    critical_xids: int = 0
    reason: str = ""


class HealthTracker:
    def __init__(self, ignored_xids: frozenset[int], recovery_period_s: float):
        if recovery_period_s < 0:
            raise ValueError(
                f"recovery period {recovery_period_s!r} s is negative; use >= 0 (0 disables)"
            )
        self.ignored_xids = ignored_xids
        self.recovery_period_s = recovery_period_s
        self._gpus: dict[str, _GpuHealth] = {}

    def track(self, uuid: str) -> None:
        """Start tracking a GPU as Healthy (GPUs are also tracked on their first event)."""
        self._gpus.setdefault(uuid, _GpuHealth())

    def on_xid(self, uuid: str, xid: int, now: float) -> list[HealthChange]:
        if xid in self.ignored_xids:
            return []
        gpu = self._gpus.setdefault(uuid, _GpuHealth())
        gpu.critical_xids += 1
        gpu.last_bad = now
        if not gpu.healthy:
            return []
        gpu.healthy = False
        gpu.reason = f"critical XID {xid}"
        return [HealthChange(uuid, False, gpu.reason, xid)]

    def on_check(self, uuid: str, ok: bool, error: str | None, now: float) -> list[HealthChange]:
        gpu = self._gpus.setdefault(uuid, _GpuHealth())
        gpu.query_ok = ok
        if not ok:
            gpu.last_bad = now
            if not gpu.healthy:
                return []
            gpu.healthy = False
            gpu.reason = f"NVML query failed: {error or 'unknown error'}"
            return [HealthChange(uuid, False, gpu.reason)]
        if gpu.healthy or not self._recovered(gpu, now):
            return []
        gpu.healthy = True
        gpu.reason = f"recovered: no critical XID or failed query for {self.recovery_period_s:g} s"
        return [HealthChange(uuid, True, gpu.reason)]

    def _recovered(self, gpu: _GpuHealth, now: float) -> bool:
        if self.recovery_period_s <= 0:
            return False
        return gpu.last_bad is None or now - gpu.last_bad >= self.recovery_period_s

    def is_healthy(self, uuid: str) -> bool:
        gpu = self._gpus.get(uuid)
        return gpu.healthy if gpu is not None else True

    def reason(self, uuid: str) -> str:
        gpu = self._gpus.get(uuid)
        return gpu.reason if gpu is not None else ""

    def healthy(self) -> dict[str, bool]:
        return {uuid: gpu.healthy for uuid, gpu in self._gpus.items()}

    def xid_counts(self) -> dict[str, int]:
        """Critical (not ignored) XIDs seen per GPU since start."""
        return {uuid: gpu.critical_xids for uuid, gpu in self._gpus.items()}
