"""A model of the peer interposer's compute limiter (HAMi-core), for side-by-side comparison.

As documented in `shared/reference/peers.md`: one bucket per container and device with capacity
`g_total = maxThreadsPerSM * SMs * 32`; a launch costs its grid size (blocks, threads ignored),
is admitted while the balance is not negative and may drive it negative; a launch facing a
negative balance sleeps 10 ms and retries. Every 120 ms a watcher sums the container's SM
utilization over the last second of NVML samples and moves its `share` by the documented
formula, then adds `share` tokens (capped at `g_total`). The limiter is bypassed when the limit
is 0 or >= 100, and when the container is alone on its GPU (unless forced).

Modelling choices where the description leaves room: `share` and the balance start at 0; the
utilization of a process over the last second is the mean of its samples in that second (one
value per process, as NVML reports one entry per process); "alone" means no other container on
the GPU has a process.
"""

from __future__ import annotations

from dataclasses import dataclass

from vgpu_agent.simulation.gpu import SimGpu, SimProcess

WATCH_NS = 120_000_000
WINDOW_US = 1_000_000
SLEEP_NS = 10_000_000


@dataclass(frozen=True)
class PeerGpu:
    sms: int = 132  # an H100 SXM
    max_threads_per_sm: int = 2048

    @property
    def g_total(self) -> int:
        return self.max_threads_per_sm * self.sms * 32


class PeerGate:
    def __init__(self, limit: float, grid: int, gpu: PeerGpu, forced: bool = False):
        if not 0 <= limit <= 100:
            raise ValueError(f"peer limit must be in [0, 100], got {limit!r}")
        self.limit, self.grid, self.gpu, self.forced = limit, grid, gpu, forced
        self.balance = 0
        self.share = 0
        self.alone = False
        self.blocked_until_ns = 0

    @property
    def bypassed(self) -> bool:
        return self.limit <= 0 or self.limit >= 100 or (self.alone and not self.forced)

    def admit(self, now_ns: int, want: int, grid: int = 0) -> int:
        """Launches admitted of `want`, each charged its grid (`grid`, else the container's)."""
        if self.bypassed:
            return want
        if now_ns < self.blocked_until_ns:
            return 0
        grid = grid or self.grid
        admitted = 0
        if self.balance >= 0:
            admitted = min(want, self.balance // grid + 1)
            self.balance -= admitted * grid
        if admitted < want:
            self.blocked_until_ns = now_ns + SLEEP_NS
        return admitted

    def launching(self, grid: int) -> PeerLaunches:
        """The gate of one of the container's processes whose kernels have `grid` blocks (the
        peer charges each launch its own grid size)."""
        return PeerLaunches(self, grid)

    def watch(self, util: float) -> None:
        """One run of the watcher with the container's summed SM percent."""
        limit, gpu = self.limit, self.gpu
        diff = max(abs(limit - util), 5.0)
        inc = gpu.sms * gpu.sms * gpu.max_threads_per_sm * diff / 2560
        if diff > limit / 2:
            inc = inc * diff * 2 / (limit + 1)
        self.share += int(inc) if util < limit else -int(inc)
        self.share = min(max(self.share, 0), gpu.g_total)
        self.balance = min(self.balance + self.share, gpu.g_total)


class PeerWatchers:
    """Runs every peer container's watcher on its own 120 ms schedule."""

    def __init__(self, gpu: SimGpu, containers: dict[str, tuple[PeerGate, list[SimProcess]]]):
        self.gpu = gpu
        self.containers = containers
        # Containers start at different moments, so their watchers are out of phase.
        count = max(1, len(containers))
        self.next_ns = {
            name: gpu.now_ns + (i * WATCH_NS) // count for i, name in enumerate(containers)
        }

    def run_due(self) -> None:
        now = self.gpu.now_ns
        since_us = now // 1000 - WINDOW_US
        with_procs = [name for name, (_, procs) in self.containers.items() if procs]
        for name, (gate, procs) in self.containers.items():
            if now < self.next_ns[name]:
                continue
            self.next_ns[name] += WATCH_NS
            gate.alone = with_procs == [name]
            pids = {p.pid for p in procs}
            per_pid: dict[int, list[int]] = {}
            for s in self.gpu.samples:
                if s.timestamp_us > since_us and s.pid in pids:
                    per_pid.setdefault(s.pid, []).append(s.sm_util)
            util = sum(sum(v) / len(v) for v in per_pid.values())
            gate.watch(util)


class PeerLaunches:
    """One process's launches through its container's `PeerGate`, charged its own grid."""

    def __init__(self, gate: PeerGate, grid: int):
        self.gate, self.grid = gate, grid

    def admit(self, now_ns: int, want: int) -> int:
        return self.gate.admit(now_ns, want, self.grid)
