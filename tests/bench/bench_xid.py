"""XID event -> HealthChange latency of the HealthMonitor, two backends side by side in one run.

1. NVML: the real NvmlBackend through pynvml on the fake libnvidia-ml.so.1 (the XID is appended
   to the fake's events file; the fake's wait polls that file every 2 ms, as a driver would wake
   the waiter on an interrupt).
2. Simulated: SimBackend, where wait_xid wakes on a threading.Condition.

Each round injects one critical XID, waits for the Unhealthy change on a subscriber queue, then
lets the GPU recover before the next round. Prints median and p99 in milliseconds.

    python tests/bench/bench_xid.py [--events 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench import machine
from tests.fakes.fakenvml import FakeNvml
from vgpu_agent.gpu.health import HealthMonitor
from vgpu_agent.gpu.model import GpuBackend
from vgpu_agent.gpu.nvml import NvmlBackend
from vgpu_agent.gpu.sim import SimBackend

RECOVERY_S = 0.02
CHECK_INTERVAL_S = 0.01


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(
    backend: GpuBackend, inject: Callable[[str, int], None], events: int
) -> list[float]:
    gpus = backend.discover().gpus
    uuid = gpus[0].uuid
    monitor = HealthMonitor(backend, gpus, frozenset(), RECOVERY_S, CHECK_INTERVAL_S)
    changes = monitor.subscribe()
    task = asyncio.create_task(monitor.run())
    await asyncio.sleep(0.3)  # the waiter thread registers its event set
    latencies: list[float] = []
    try:
        for _ in range(events):
            begin = time.perf_counter()
            inject(uuid, 79)
            while True:
                change = await asyncio.wait_for(changes.get(), 5.0)
                if not change.healthy:
                    break
            latencies.append((time.perf_counter() - begin) * 1000)
            while not (await asyncio.wait_for(changes.get(), 5.0)).healthy:
                pass
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return latencies


def describe(name: str, values: list[float]) -> str:
    return (
        f"{name:<34} n={len(values):<5} median={statistics.median(values):7.2f} ms  "
        f"p99={percentile(values, 0.99):7.2f} ms  max={max(values):7.2f} ms"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))

    with tempfile.TemporaryDirectory() as tmp:
        fake = FakeNvml(Path(tmp), gpus=2)
        os.environ.update(fake.env())
        nvml = NvmlBackend(str(fake.library_path))
        nvml.start()
        try:
            nvml_ms = await measure(nvml, fake.inject_xid, args.events)
        finally:
            nvml.shutdown()

    sim = SimBackend("2xA100-80GB")
    sim.start()
    sim_ms = await measure(sim, sim.inject_xid, args.events)

    print(f"machine: {machine.describe()}")
    print(describe("XID -> Unhealthy, NVML (fake lib)", nvml_ms))
    print(describe("XID -> Unhealthy, simulated", sim_ms))
    ratio = statistics.median(nvml_ms) / statistics.median(sim_ms)
    print(f"median ratio NVML/simulated: {ratio:.1f}x; goal p99 <= 100 ms")


if __name__ == "__main__":
    asyncio.run(main())
