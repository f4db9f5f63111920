"""Pod-chosen policy: what it costs the controller tick, the apply pass and the pod watch.

1. The controller reads policy and priority every tick now (they change when a pod's annotations
   do); side by side with the earlier read-once variant, 100 single-device regions, interleaved.
2. `RegionPolicies.apply` over 100 bound regions on real region files: nothing to change (every
   PodResources refresh) and every region rewritten (annotations changed).
3. One pod watch event (a MODIFIED Pod of about 6 KB, JSON-decoded and cached), as `NodePods`
   handles it.

    python tests/bench/bench_podpolicy.py [--regions N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog

# this tree's code, not whichever checkout is installed (comparisons run older trees)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.kube.pods import NodePods
from vgpu_agent.shm.regions import RegionStore
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.controller import CORE_POLICIES, ThrottleController
from vgpu_agent.throttle.podpolicy import PodInfo, PodPolicyRules
from vgpu_agent.throttle.regionpolicy import RegionPolicies

UUID = "GPU-00000000-0000-0000-0000-000000000001"


class NoSamples:
    def process_utilization(self, uuid: str, since_us: int) -> list:
        return []


class ReadOnce(ThrottleController):
    """The controller as it was: policy and priority read once per region."""

    def _limits(self, device):  # type: ignore[no-untyped-def]
        limits = device.limits
        if limits is None:
            region, dev = device.region, device.dev
            policy = region.policy(dev)
            if policy not in CORE_POLICIES:
                policy = self.default_policy
            limit = min(100.0, max(1e-6, float(region.core_limit(dev))))
            limits = device.limits = (limit, policy, region.priority)
        return limits


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def line(name: str, values: list[float], unit: str = "us") -> str:
    return (f"  {name:<44} median {statistics.median(values):9.1f} {unit}   "
            f"p99 {pct(values, 0.99):9.1f} {unit}")


async def bench_tick(regions: int, rounds: int) -> None:
    def make() -> list[SimRegion]:
        return [SimRegion(f"r{i}", (UUID,), (1.0,), ("strict",)) for i in range(regions)]

    now = [10**12]
    a_regions, b_regions = make(), make()
    new = ThrottleController(NoSamples(), lambda: a_regions, clock=lambda: now[0])
    old = ReadOnce(NoSamples(), lambda: b_regions, clock=lambda: now[0])
    times: dict[str, list[float]] = {"reads every tick": [], "reads once": []}
    for _ in range(20):  # warm up: models, caches
        now[0] += 100_000_000
        await new.tick()
        await old.tick()
    for i in range(rounds):
        now[0] += 100_000_000
        pair = [("reads every tick", new), ("reads once", old)]
        for name, controller in pair if i % 2 else reversed(pair):
            started = time.perf_counter()
            await controller.tick()
            times[name].append((time.perf_counter() - started) * 1e6)
    print(f"1. controller tick, {regions} regions ({rounds} ticks each, interleaved)")
    for name, values in times.items():
        print(line(name, values))
    ratio = statistics.median(times["reads every tick"]) / statistics.median(times["reads once"])
    print(f"  ratio every-tick / once (median)            {ratio:.3f}")


def bench_apply(regions: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        store = RegionStore(root)
        assignments = {}
        for i in range(regions):
            ids = (f"{UUID}::{i}",)
            store.create(Grant(ids, (GrantedDevice(UUID, 0, 1, 1 << 30, 1.0),)))
            assignments[ids[0]] = ("ns", f"pod-{i}", "main")
        asyncio.run(store.reconcile(assignments))
        known = {}

        def annotate(priority: int) -> None:
            for i in range(regions):
                known[("ns", f"pod-{i}")] = PodInfo(f"u{i}", "ns", f"pod-{i}", {
                    "vgpu.io/core-policy": "work-conserving", "vgpu.io/priority": str(priority)})

        class Pods:
            def pod(self, namespace: str, name: str) -> PodInfo | None:
                return known.get((namespace, name))

        rules = PodPolicyRules(priority_namespaces=frozenset({"ns"}))
        policies = RegionPolicies(store.regions, store.identity, rules, pods=Pods())
        annotate(1)
        policies.apply()
        steady, rewrite = [], []
        for i in range(rounds):
            started = time.perf_counter()
            policies.apply()
            steady.append((time.perf_counter() - started) * 1e6)
            annotate(2 + i % 2)
            started = time.perf_counter()
            written = policies.apply()
            rewrite.append((time.perf_counter() - started) * 1e6)
            assert written == regions
        store.close()
    print(f"2. RegionPolicies.apply over {regions} bound regions ({rounds} rounds)")
    print(line("nothing to change", steady))
    print(line("every region rewritten", rewrite))


def bench_watch_event(rounds: int) -> None:
    async def no_client() -> None:
        return None

    pods = NodePods("node-1", no_client)
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "server-7f9c", "namespace": "prod", "uid": "0b1c2d3e-0000-4000-8000-000000000001",
            "resourceVersion": "123456",
            "annotations": {"vgpu.io/core-policy": "strict", "vgpu.io/priority": "10",
                            "kubectl.kubernetes.io/last-applied-configuration": "x" * 4000},
            "labels": {f"label-{i}": "value" for i in range(20)},
        },
        "spec": {"nodeName": "node-1", "containers": [{"name": "server", "image": "i" * 100,
                                                       "env": [{"name": f"E{i}", "value": "v"}
                                                               for i in range(30)]}]},
        "status": {"phase": "Running"},
    }
    raw = json.dumps({"type": "MODIFIED", "object": pod}).encode()
    times = []
    for i in range(rounds):
        started = time.perf_counter()
        pods._on_watch_event(json.loads(raw), str(i))
        times.append((time.perf_counter() - started) * 1e6)
    print(f"3. one pod watch event ({len(raw)} bytes, {rounds} events)")
    print(line("decode and cache", times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--regions", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    # what is timed is the work, not the formatting and writing of its log lines
    structlog.configure(processors=[], logger_factory=structlog.ReturnLoggerFactory())
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}")
    asyncio.run(bench_tick(args.regions, args.rounds))
    bench_apply(args.regions, args.rounds)
    bench_watch_event(args.rounds * 10)


if __name__ == "__main__":
    main()
