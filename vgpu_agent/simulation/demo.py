"""Simulated workloads in the agent's allocations, for `vgpu-agent simulate`.

Every allocation the agent holds gets a simulated container that saturates each of its devices
(kernels of a different length per allocation), on one simulated GPU per physical UUID. The real
control law and controller steer them; every few seconds the measured share of each container is
logged next to its limit. The simulated containers mirror the allocations' limits, policies and
priorities; the allocations' own region files are left to the agent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from vgpu_agent.shm.api import RegionHandle
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimProcess, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.controller import ThrottleController

log = structlog.get_logger(__name__)

# Short, medium and long kernels, so the demo shows that kernel length does not matter.
DEMO_WORKLOADS = (
    Workload(kernel_s=0.0002, blocks=128, threads_per_block=256),
    Workload(kernel_s=0.002, blocks=1024, threads_per_block=256),
    Workload(kernel_s=0.005, blocks=4096, threads_per_block=512),
)


@dataclass(frozen=True)
class DemoShare:
    alloc_id: str
    uuid: str
    limit: float
    policy: str
    share: float  # percent of the GPU's SM time over the last report period
    target: float


class DemoWorkloads:
    """The simulated GPUs and containers mirroring a set of allocations; step with `advance`."""

    def __init__(self, regions: Callable[[], Iterable[RegionHandle]], tick_s: float = 0.1):
        self.source = regions
        self.tick_s = tick_s
        self.gpus: dict[str, SimGpu] = {}
        self.mirrors: dict[str, SimRegion] = {}
        self.procs: dict[tuple[str, int], tuple[SimGpu, SimProcess]] = {}
        self.backend = SimBackend([])
        self.controller = ThrottleController(
            self.backend, lambda: list(self.mirrors.values()), tick_s=tick_s, clock=self._now
        )
        self._origin_ns = time.monotonic_ns()
        self._reported_sm: dict[tuple[str, int], float] = {}

    def _now(self) -> int:
        first = next(iter(self.gpus.values()), None)
        return first.now_ns if first else self._origin_ns

    def _gpu(self, uuid: str) -> SimGpu:
        gpu = self.gpus.get(uuid)
        if gpu is None:
            # All simulated GPUs run on one clock.
            gpu = self.gpus[uuid] = SimGpu(uuid, start_ns=self._now())
            self.backend.gpus[uuid] = gpu
        return gpu

    def sync(self) -> None:
        """Mirror new allocations; stop the containers of allocations that are gone."""
        try:
            handles = list(self.source())
        except Exception:
            log.exception("demo_regions_unavailable")
            return
        live = set()
        for handle in handles:
            alloc_id = handle.alloc_id
            live.add(alloc_id)
            if alloc_id in self.mirrors:
                continue
            uuids = tuple(handle.device_uuids)
            mirror = SimRegion(
                alloc_id, uuids, tuple(handle.core_limit(d) for d in range(len(uuids))),
                tuple(handle.policy(d) for d in range(len(uuids))), priority=handle.priority,
                seq=handle.seq,
            )
            self.mirrors[alloc_id] = mirror
            workload = DEMO_WORKLOADS[len(self.mirrors) % len(DEMO_WORKLOADS)]
            for dev, uuid in enumerate(uuids):
                gpu = self._gpu(uuid)
                self.procs[(alloc_id, dev)] = (
                    gpu, gpu.shim_process(f"{alloc_id}/{dev}", workload, mirror, dev)
                )
            log.info("demo_workload_started", alloc_id=alloc_id, devices=list(uuids),
                     kernel_ms=workload.kernel_s * 1000)
        for alloc_id in list(self.mirrors):
            if alloc_id not in live:
                del self.mirrors[alloc_id]
                for key in [k for k in self.procs if k[0] == alloc_id]:
                    gpu, proc = self.procs.pop(key)
                    gpu.processes.remove(proc)
                    self._reported_sm.pop(key, None)
                log.info("demo_workload_stopped", alloc_id=alloc_id)

    async def advance(self, seconds: float) -> None:
        for _ in range(max(1, round(seconds / self.tick_s))):
            self.sync()
            for gpu in self.gpus.values():
                gpu.advance(self.tick_s)
            await self.controller.tick()

    def shares(self, period_s: float) -> list[DemoShare]:
        """Each container's share since the previous call (or over `period_s`)."""
        out = []
        status = self.controller.status
        for (alloc_id, dev), (_, proc) in self.procs.items():
            used = proc.total_sm_s - self._reported_sm.get((alloc_id, dev), 0.0)
            self._reported_sm[(alloc_id, dev)] = proc.total_sm_s
            mirror = self.mirrors[alloc_id]
            decided = status.get((alloc_id, dev))
            out.append(DemoShare(
                alloc_id, mirror.device_uuids[dev], mirror.core_limits[dev], mirror.policies[dev],
                100 * used / period_s, decided.target if decided else 0.0,
            ))
        return out


async def run_demo_workloads(
    regions: Callable[[], Iterable[RegionHandle]],
    *,
    report_every_s: float = 5.0,
    duration_s: float | None = None,
    speed: float = 1.0,
    tick_s: float = 0.1,
) -> list[DemoShare]:
    """Run simulated workloads in `regions`' allocations and log share vs limit periodically.

    Runs until cancelled or for `duration_s` simulated seconds; `speed` > 1 runs the simulation
    faster than the wall clock. Returns the last report.
    """
    if not report_every_s > 0 or not speed > 0 or not tick_s > 0:
        raise ValueError(
            f"report_every_s, speed and tick_s must be > 0, got {report_every_s!r}, {speed!r}, "
            f"{tick_s!r}"
        )
    demo = DemoWorkloads(regions, tick_s)
    loop = asyncio.get_running_loop()
    started, simulated, last = loop.time(), 0.0, []
    while duration_s is None or simulated < duration_s - 1e-9:
        period = report_every_s if duration_s is None else min(report_every_s,
                                                                duration_s - simulated)
        ticks = max(1, round(period / tick_s))
        for _ in range(ticks):
            await demo.advance(tick_s)
            simulated += tick_s
            # Keep pace with the wall clock (scaled by `speed`).
            await asyncio.sleep(max(0.0, started + simulated / speed - loop.time()))
        last = demo.shares(ticks * tick_s)
        for s in last:
            log.info("demo_share", alloc_id=s.alloc_id, uuid=s.uuid, policy=s.policy,
                     limit=round(s.limit, 1), share=round(s.share, 1), target=round(s.target, 1))
    return last
