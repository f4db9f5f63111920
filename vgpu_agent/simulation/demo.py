"""Simulated workloads in the agent's own allocations, for `vgpu-agent simulate`.

Every allocation the agent holds gets one simulated process that keeps each of its devices busy
(kernels of a different length per allocation), on one simulated GPU per physical UUID. The
process plays the shim on the allocation's real region files (`shimfile.RegionShim`): it reads the
rate the agent's controller writes into `control` before every step and publishes its slot, the
device totals and the bucket into `state`. The simulated GPUs serve their NVML-like per-process
samples and GPU readings through the agent's `gpu.sim.SimBackend`, so the agent's own
`ThrottleController` steers the processes and its metrics show what they do. Every few seconds the
measured share of each container is logged next to its limit (`demo_share`).

The simulated clock is CLOCK_MONOTONIC, as the shim's timestamps are: the demo advances the
simulated GPUs to the present every tick.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.gpu.sim import SimBackend as NodeBackend
from vgpu_agent.simulation.gpu import ShimGate, SimGpu, SimProcess, Workload
from vgpu_agent.simulation.shimfile import (
    RegionShim,
    ShimFileError,
    ShimProcess,
    host_pid_candidates,
)
from vgpu_agent.throttle.controller import DeviceStatus

log = structlog.get_logger(__name__)

MIB = 1 << 20
GIB = 1 << 30

# Short, medium and long kernels, so the demo shows that kernel length does not matter; each holds
# a different part of its memory limit.
DEMO_WORKLOADS = (
    (Workload(kernel_s=0.0002, blocks=128, threads_per_block=256), 0.35),
    (Workload(kernel_s=0.002, blocks=1024, threads_per_block=256), 0.6),
    (Workload(kernel_s=0.005, blocks=4096, threads_per_block=512), 0.8),
)
UNLIMITED_MEMORY_USE = 2 * GIB  # what a process holds on a device without a memory limit
MAX_CATCH_UP_S = 0.25  # simulated per GPU and tick at most, so a stalled loop cannot stall again
# alloc_id -> (workload, part of the memory limit to hold) for an allocation that wants its own
WorkloadChoice = Callable[[str], tuple[Workload, float] | None]


class RegionOnDisk(Protocol):
    """What the demo needs of an agent region (`shm.regions.Region` has it)."""

    @property
    def alloc_id(self) -> str: ...

    @property
    def device_uuids(self) -> tuple[str, ...]: ...

    @property
    def path(self) -> Path: ...


@dataclass(frozen=True)
class DemoShare:
    alloc_id: str
    uuid: str
    limit: float
    policy: str
    share: float  # percent of the GPU's SM time over the last report period
    target: float  # what the agent's controller aims at (0 before its first decision)
    measured: float | None  # the controller's last NVML-based measurement


@dataclass
class _Container:
    shim: RegionShim
    process: ShimProcess
    on_gpus: list[tuple[SimGpu, SimProcess]]  # one per region device


class DemoWorkloads:
    """The simulated GPUs and processes of a set of allocations; step with `step`."""

    def __init__(
        self,
        regions: Callable[[], Iterable[RegionOnDisk]],
        backend: NodeBackend | None = None,
        *,
        controller_status: Callable[[], Mapping[tuple[str, int], DeviceStatus]] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        host_pids: Iterator[int] | None = None,
        workload_for: WorkloadChoice | None = None,
    ):
        self.source = regions
        self.workload_for = workload_for
        self.backend = backend
        self.controller_status = controller_status or dict
        self.clock = clock
        self.gpus: dict[str, SimGpu] = {}
        self.containers: dict[str, _Container] = {}
        self.refused: dict[str, str] = {}  # alloc_id -> why its files cannot be used
        self._host_pids = host_pids or host_pid_candidates()
        self._started = itertools.count()
        self._reported: dict[tuple[str, int], tuple[float, int]] = {}  # SM s, at ns
        # Published whole after each step: the controller reads them from a worker thread.
        self._samples: dict[str, tuple[ProcessSample, ...]] = {}
        if backend is not None:
            backend.set_sample_source(self.samples)
            backend.set_process_owner(self.container_of)
        else:
            log.warning("demo_without_backend",
                        effect="the agent sees no utilization from the simulated processes")

    # -- NVML's view, served to the agent's backend ------------------------------------------
    def samples(self, uuid: str, since_us: int) -> list[ProcessSample]:
        return [s for s in self._samples.get(uuid, ()) if s.timestamp_us > since_us]

    def container_of(self, host_pid: int) -> str | None:
        """The allocation whose simulated container runs `host_pid` (the host's view)."""
        for alloc_id, container in list(self.containers.items()):
            if container.process.counters.host_pid == host_pid:
                return alloc_id
        return None

    def _publish(self) -> None:
        live = {c.process.counters.host_pid for c in self.containers.values()}
        for uuid, gpu in self.gpus.items():
            # Only live processes: a sample of an ended one has no slot to be attributed by.
            self._samples[uuid] = tuple(s for s in gpu.samples if s.pid in live)
        if self.backend is None:
            return
        known = set(self.backend.uuids)
        for uuid, gpu in self.gpus.items():
            if uuid not in known:
                continue
            latest: dict[int, int] = {}
            for s in self._samples[uuid]:
                latest[s.pid] = s.sm_util
            util = min(1.0, sum(latest.values()) / 100)
            memory = sum(
                c.process.memory_used[dev]
                for c in self.containers.values()
                for dev, (g, _) in enumerate(c.on_gpus) if g is gpu
            )
            self.backend.set_readings(uuid, util=util, mem_used=memory, temp=32 + 45 * util)

    # -- allocations coming and going --------------------------------------------------------
    def _gpu(self, uuid: str) -> SimGpu:
        gpu = self.gpus.get(uuid)
        if gpu is None:
            # Coarse recording bins: the demo reads cumulative SM time, and a long run must not
            # grow a fine-grained history without bound.
            gpu = self.gpus[uuid] = SimGpu(uuid, start_ns=self.clock(), bin_s=60.0)
        return gpu

    def sync(self) -> None:
        """Start a process in new allocations; end those of allocations that are gone."""
        try:
            handles = {h.alloc_id: h for h in self.source()}
        except Exception:
            log.exception("demo_regions_unavailable")
            return
        for alloc_id, handle in handles.items():
            if alloc_id not in self.containers and alloc_id not in self.refused:
                self._start(handle)
        for alloc_id in [a for a in self.containers if a not in handles]:
            self._stop(alloc_id)
            log.info("demo_workload_stopped", alloc_id=alloc_id)
        for alloc_id in [a for a in self.refused if a not in handles]:
            del self.refused[alloc_id]

    def _start(self, handle: RegionOnDisk) -> None:
        alloc_id = handle.alloc_id
        try:
            shim = RegionShim(Path(handle.path))
        except (ShimFileError, OSError) as err:
            self.refused[alloc_id] = str(err)
            log.warning("demo_region_unusable", alloc_id=alloc_id, error=str(err))
            return
        chosen = self.workload_for(alloc_id) if self.workload_for is not None else None
        workload, memory_part = chosen or DEMO_WORKLOADS[next(self._started) % len(DEMO_WORKLOADS)]
        memory = [
            int(limit * memory_part) // MIB * MIB if limit else UNLIMITED_MEMORY_USE
            for limit in shim.memory_limits
        ]
        try:
            process = shim.start_process(next(self._host_pids), memory)
        except (ShimFileError, StopIteration) as err:
            shim.close()
            self.refused[alloc_id] = str(err) or "no free host pid"
            log.warning("demo_region_unusable", alloc_id=alloc_id, error=self.refused[alloc_id])
            return
        on_gpus = []
        for dev, uuid in enumerate(shim.mirror.device_uuids):
            gpu = self._gpu(uuid)
            gate = ShimGate(shim.mirror, dev, process.counters, workload.cost)
            name = f"{alloc_id}/{dev}"
            on_gpus.append((gpu, gpu.add_process(name, workload, gate, process.counters.host_pid)))
        self.containers[alloc_id] = _Container(shim, process, on_gpus)
        for dev, (gpu, _) in enumerate(on_gpus):
            self._reported[(alloc_id, dev)] = (0.0, gpu.now_ns)
        log.info("demo_workload_started", alloc_id=alloc_id, devices=list(shim.mirror.device_uuids),
                 host_pid=process.counters.host_pid, kernel_ms=workload.kernel_s * 1000,
                 memory_mib=[m // MIB for m in memory])

    def _stop(self, alloc_id: str) -> None:
        container = self.containers.pop(alloc_id)
        for dev, (gpu, proc) in enumerate(container.on_gpus):
            gpu.processes.remove(proc)
            self._reported.pop((alloc_id, dev), None)
        try:
            container.shim.end_process(container.process)
        except (ShimFileError, ValueError) as err:
            log.warning("demo_process_end_failed", alloc_id=alloc_id, error=str(err))
        container.shim.close()

    def close(self) -> None:
        """End every simulated process (their slots are given back) and stop serving samples."""
        for alloc_id in list(self.containers):
            self._stop(alloc_id)
        self._samples.clear()
        if self.backend is not None:
            self.backend.set_sample_source(None)

    # -- time --------------------------------------------------------------------------------
    def step(self) -> None:
        """Follow the allocations, then run every simulated GPU up to now under the rates in
        `control`, and publish the processes' counters, samples and readings."""
        self.sync()
        for container in self.containers.values():
            container.shim.pull()
        now = self.clock()
        for gpu in self.gpus.values():
            behind_s = (now - gpu.now_ns) / 1e9
            if behind_s * 1e9 >= gpu.step_ns:
                gpu.advance(min(behind_s, MAX_CATCH_UP_S))
        for container in self.containers.values():
            container.shim.push()
        self._publish()

    def shares(self) -> list[DemoShare]:
        """Each container's measured share per device since the previous call."""
        out = []
        status = self.controller_status()
        for alloc_id, container in self.containers.items():
            mirror = container.shim.mirror
            for dev, (gpu, proc) in enumerate(container.on_gpus):
                used_before, since = self._reported.get((alloc_id, dev), (0.0, gpu.start_ns))
                self._reported[(alloc_id, dev)] = (proc.total_sm_s, gpu.now_ns)
                period_s = max(1e-9, (gpu.now_ns - since) / 1e9)
                decided = status.get((alloc_id, dev))
                out.append(DemoShare(
                    alloc_id, mirror.device_uuids[dev], mirror.core_limits[dev],
                    mirror.policies[dev], 100 * (proc.total_sm_s - used_before) / period_s,
                    decided.target if decided else 0.0,
                    decided.measured_util if decided else None,
                ))
        return out


async def run_demo_workloads(
    regions: Callable[[], Iterable[RegionOnDisk]],
    backend: NodeBackend | None = None,
    *,
    controller_status: Callable[[], Mapping[tuple[str, int], DeviceStatus]] | None = None,
    report_every_s: float = 5.0,
    tick_s: float = 0.025,
    duration_s: float | None = None,
    workload_for: WorkloadChoice | None = None,
    on_step: Callable[[DemoWorkloads], None] | None = None,
) -> list[DemoShare]:
    """Run simulated processes in `regions`' allocations, steered through their region files,
    and log each one's share next to its limit every `report_every_s`.

    `backend` is the agent's simulated GPU backend: it serves the processes' samples and the GPU
    readings to the agent. `controller_status` (the agent's `controller.status`) adds the
    controller's target and measurement to the reports. `workload_for` picks the workload of
    chosen allocations; `on_step` is called after every step. Runs until cancelled or for
    `duration_s` seconds; on the way out the processes end and give their slots back. Returns
    the last report.
    """
    for name, value in (("report_every_s", report_every_s), ("tick_s", tick_s),
                        ("duration_s", 1.0 if duration_s is None else duration_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    demo = DemoWorkloads(regions, backend, controller_status=controller_status,
                         workload_for=workload_for)
    loop = asyncio.get_running_loop()
    started = loop.time()
    next_report = started + report_every_s
    last: list[DemoShare] = []
    try:
        while duration_s is None or loop.time() - started < duration_s:
            demo.step()
            if on_step is not None:
                on_step(demo)
            if loop.time() >= next_report:
                next_report += report_every_s
                last = demo.shares()
                for s in last:
                    log.info("demo_share", alloc_id=s.alloc_id, uuid=s.uuid, policy=s.policy,
                             limit=round(s.limit, 1), share=round(s.share, 1),
                             target=round(s.target, 1),
                             measured=None if s.measured is None else round(s.measured, 1))
            await asyncio.sleep(tick_s)
    finally:
        demo.close()
    return last
