"""Critical XID -> tainted ResourceSlice stored in the API server, side by side in one run:

1. XID -> HealthChange: the HealthMonitor alone (what the device plugin reacts to);
2. XID -> slice: the same, plus the ResourceSlicePublisher writing the device taint through
   kubernetes_asyncio to the fake API server (a list and a replace over HTTP), timed until the
   server applies the write (its watch event for the tainted slice);
each with the simulated backend and with the real NvmlBackend on the fake libnvidia-ml.so.1.

Each round injects one critical XID, waits for the tainted slice, then moves the monitor's clock
past the recovery period so the GPU recovers (the taint is removed) before the next round (a
real-time recovery period could end before a slow write and hide it). Prints medians and p99s in
milliseconds.

    python tests/bench/bench_dra_slices.py [--events 200]
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
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench import machine
from tests.fakes.fakenvml import FakeNvml
from tests.fakes.kubeapi import NODE, FakeKubeAPI
from tests.fakes.resourceapi import Selector
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.gpu.health import HealthMonitor
from vgpu_agent.gpu.model import GpuBackend
from vgpu_agent.gpu.nvml import NvmlBackend
from vgpu_agent.gpu.sim import SimBackend
from vgpu_agent.kube.resourceslices import ResourceSlicePublisher

RECOVERY_S = 60.0  # passed by moving the monitor's clock, never by waiting
CHECK_INTERVAL_S = 0.01
DRIVER = "gpu.vgpu.io"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tainted(event: dict[str, Any] | None, device: str) -> bool | None:
    """Whether the slice in a watch event taints `device` (None: not a slice event)."""
    if event is None or event["type"] not in ("ADDED", "MODIFIED"):
        return None
    for d in event["object"]["spec"]["devices"]:
        if d["name"] == device:
            return bool(d.get("taints"))
    return None


async def measure(
    backend: GpuBackend,
    inject: Callable[[str, int], None],
    events: int,
    tmp: Path,
) -> tuple[list[float], list[float]]:
    gpus = backend.discover().gpus
    target = gpus[0]
    device = f"gpu-{target.index}"
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE)
    now = [0.0]
    monitor = HealthMonitor(
        backend, gpus, frozenset(), RECOVERY_S, CHECK_INTERVAL_S, clock=lambda: now[0]
    )
    changes = monitor.subscribe()
    publisher = ResourceSlicePublisher(
        NODE, DRIVER, gpus, Split(4), kubeconfig=str(api.write_kubeconfig(tmp / "kubeconfig")),
        health=monitor, request_timeout=5.0,
    )
    watcher, _ = api.resources.open_watch("resourceslices", None, Selector(), Selector(), None)
    tasks = [asyncio.create_task(monitor.run()), asyncio.create_task(publisher.run())]
    await publisher.wait_for(lambda p: p.published is not None, within=10)
    await asyncio.sleep(0.3)  # the waiter thread registers its event set
    to_change: list[float] = []
    to_slice: list[float] = []
    try:
        for _ in range(events):
            while not watcher.queue.empty():
                watcher.queue.get_nowait()
            begin = time.perf_counter()
            inject(target.uuid, 48)
            while (await asyncio.wait_for(changes.get(), 5.0)).healthy:
                pass
            to_change.append((time.perf_counter() - begin) * 1000)
            while tainted(await asyncio.wait_for(watcher.queue.get(), 5.0), device) is not True:
                pass
            to_slice.append((time.perf_counter() - begin) * 1000)
            # recovery: healthy again and the taint gone
            now[0] += 2 * RECOVERY_S
            while not (await asyncio.wait_for(changes.get(), 5.0)).healthy:
                pass
            while tainted(await asyncio.wait_for(watcher.queue.get(), 5.0), device) is not False:
                pass
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        api.resources.close_watch(watcher)
        await api.stop()
    return to_change, to_slice


def describe(name: str, values: list[float]) -> str:
    return (
        f"{name:<40} n={len(values):<5} median={statistics.median(values):7.2f} ms  "
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
            nvml_change, nvml_slice = await measure(nvml, fake.inject_xid, args.events, Path(tmp))
        finally:
            nvml.shutdown()
        sim = SimBackend("2xA100-80GB")
        sim.start()
        sim_change, sim_slice = await measure(sim, sim.inject_xid, args.events, Path(tmp))

    print(f"machine: {machine.describe()}")
    print(describe("XID -> HealthChange, NVML (fake lib)", nvml_change))
    print(describe("XID -> tainted slice, NVML (fake lib)", nvml_slice))
    print(describe("XID -> HealthChange, simulated", sim_change))
    print(describe("XID -> tainted slice, simulated", sim_slice))
    for name, change, written in (("NVML", nvml_change, nvml_slice),
                                  ("simulated", sim_change, sim_slice)):
        api_ms = statistics.median(written) - statistics.median(change)
        print(f"{name}: the API write adds {api_ms:.2f} ms to the median "
              f"({statistics.median(written) / statistics.median(change):.1f}x)")
    print("goal: XID -> tainted slice p99 <= 1000 ms")


if __name__ == "__main__":
    asyncio.run(main())
