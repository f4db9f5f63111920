"""Device-plugin benchmarks: Allocate latency, XID-to-Unhealthy latency, re-registration time.

    python tests/bench/bench_plugin.py [--calls 5000]

1. Allocate: the agent runs as its own process (`vgpu-agent run`, 8 simulated GPUs x K=16, the
   full Allocate path including region creation, with the shim installed in its state dir); a
   bare grpc.aio server answering the same RPC with an empty response runs in another process on
   the same kind of unix socket. The client alternates calls between the two, so both see the
   same machine noise; it prints p50/p99 of each and their ratio. No container ever holds the
   benchmark's allocations, so the agent collects their regions (PodResources every 0.5 s, no
   grace; one container holds a device all along, since an answer listing no container of the
   resource postpones collection): the node holds about as many regions as a busy node has
   containers, not thousands. The count is printed, taken every 500 calls.
2. XID -> Unhealthy: in-process agent on the simulated backend; time from injecting a critical
   XID to the kubelet stand-in receiving the ListAndWatch update that marks the GPU Unhealthy.
3. Kubelet restart -> registration received again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench import machine  # noqa: E402
from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc  # noqa: E402
from vgpu_agent.agent import Agent  # noqa: E402
from vgpu_agent.config import Config  # noqa: E402
from vgpu_agent.gpu.sim import SimBackend  # noqa: E402
from vgpu_agent.kubelet.standin import KubeletStandIn  # noqa: E402

RESOURCE = "nvidia.com/gpu"

BARE_SERVER = """
import asyncio, sys
import grpc
from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

class Bare(api_pb2_grpc.DevicePluginServicer):
    async def Allocate(self, request, context):
        return api_pb2.AllocateResponse()

async def main():
    server = grpc.aio.server()
    api_pb2_grpc.add_DevicePluginServicer_to_server(Bare(), server)
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe(name: str, values_ms: list[float]) -> str:
    return (
        f"{name:<28} n={len(values_ms):>5}  p50={statistics.median(values_ms):7.3f} ms  "
        f"p99={pct(values_ms, 0.99):7.3f} ms  max={max(values_ms):7.3f} ms"
    )


async def wait_socket(path: str, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        await asyncio.sleep(0.05)


async def bench_allocate(root: Path, calls: int) -> None:
    plugin_dir = root / "dp"
    plugin_dir.mkdir()
    kubelet = KubeletStandIn(str(plugin_dir), str(root / "pr.sock"))
    await kubelet.start()
    shim_dir = root / "state" / "shim"
    shim_dir.mkdir(parents=True)
    (shim_dir / "libvgpu.so").write_bytes(b"\x7fELF")  # only mounted, never loaded here
    (shim_dir / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VGPU_AGENT_REGION_GC_GRACE_SECONDS": "0",
        "VGPU_AGENT_POD_RESOURCES_REFRESH_SECONDS": "0.5",
    }
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vgpu_agent.cli",
        "run",
        "--backend",
        "sim",
        "--sim-gpus",
        "8xA100-80GB",
        "--split-count",
        "16",
        "--device-plugin-dir",
        str(plugin_dir),
        "--state-dir",
        str(root / "state"),
        "--pod-resources-socket",
        str(root / "pr.sock"),
        "--metrics-address",
        "127.0.0.1:0",
        "--log-level",
        "warning",
        env=env,
    )
    bare_socket = str(root / "bare.sock")
    bare = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BARE_SERVER, bare_socket, env=env
    )
    try:
        await kubelet.wait_for(lambda: len(kubelet.free_devices(RESOURCE)) == 128, limit_s=60)
        await wait_socket(bare_socket)
        # One container holds a device all along: PodResources then lists a container of the
        # resource, and the agent collects the regions nobody holds (an answer listing none,
        # as a restarting kubelet gives, postpones collection, and the regions would pile up
        # in the thousands).
        await kubelet.admit("bench", "holder", "main", RESOURCE, 1)
        ids = kubelet.free_devices(RESOURCE)
        regions_dir = root / "state" / "regions"
        held: list[int] = []
        rng = random.Random(7)
        async with (
            grpc.aio.insecure_channel(f"unix:{plugin_dir / 'vgpu-agent.sock'}") as agent_channel,
            grpc.aio.insecure_channel(f"unix:{bare_socket}") as bare_channel,
        ):
            agent_stub = api_pb2_grpc.DevicePluginStub(agent_channel)
            bare_stub = api_pb2_grpc.DevicePluginStub(bare_channel)
            agent_ms: list[float] = []
            bare_ms: list[float] = []
            for i in range(calls + 200):
                request = api_pb2.AllocateRequest(
                    container_requests=[
                        api_pb2.ContainerAllocateRequest(
                            devices_ids=rng.sample(ids, rng.choice((1, 2)))
                        )
                    ]
                )
                order = [(agent_stub, agent_ms), (bare_stub, bare_ms)]
                if i % 2:
                    order.reverse()
                for stub, sink in order:
                    started = time.perf_counter()
                    await stub.Allocate(request)
                    if i >= 200:  # warm-up excluded
                        sink.append((time.perf_counter() - started) * 1000)
                if i % 500 == 0:
                    held.append(sum(1 for _ in os.scandir(regions_dir)))
        print(describe("Allocate (vgpu-agent)", agent_ms))
        print(describe("Allocate (bare grpc.aio)", bare_ms))
        p99_ratio = pct(agent_ms, 0.99) / pct(bare_ms, 0.99)
        p50_ratio = statistics.median(agent_ms) / statistics.median(bare_ms)
        print(f"{'ratio agent/bare':<28} p50 x{p50_ratio:.2f}  p99 x{p99_ratio:.2f}")
        print(f"{'regions on the node':<28} at most {max(held)} (every 500 calls: "
              f"{' '.join(map(str, held))})")
    finally:
        for proc in (agent, bare):
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()
        await kubelet.stop()


async def bench_health_and_restart(root: Path, events: int, restarts: int) -> None:
    config = Config(
        backend="sim",
        sim_gpus="2xA100-80GB",
        split_count=4,
        device_plugin_dir=str(root / "dp2"),
        pod_resources_socket=str(root / "pr2.sock"),
        state_dir=str(root / "state2"),
        metrics_address="127.0.0.1:0",
        health_recovery_seconds=0.2,
        health_check_seconds=0.05,
        log_level="warning",
    )
    os.makedirs(config.device_plugin_dir)
    kubelet = KubeletStandIn(config.device_plugin_dir)
    await kubelet.start()
    backend = SimBackend(config.sim_gpus)
    agent = Agent(config, backend=backend)
    task = asyncio.create_task(agent.run())
    uuid = backend.uuids[0]

    def health_of(state: str) -> bool:
        devices = kubelet.resources[RESOURCE].devices
        return bool(devices) and {h for d, h in devices.items() if d.startswith(uuid)} == {state}

    try:
        await kubelet.wait_for(lambda: RESOURCE in kubelet.resources and health_of("Healthy"), 30)
        xid_ms: list[float] = []
        for _ in range(events):
            injected = time.monotonic()
            backend.inject_xid(uuid, 79)
            await kubelet.wait_for(lambda: health_of("Unhealthy"), 5)
            xid_ms.append((kubelet.resources[RESOURCE].last_update - injected) * 1000)
            await kubelet.wait_for(lambda: health_of("Healthy"), 5)
        print(describe("XID -> Unhealthy at kubelet", xid_ms))

        restart_ms: list[float] = []
        for _ in range(restarts):
            seen = len(kubelet.registrations)
            await kubelet.restart()
            restarted = time.monotonic()
            await kubelet.wait_for(lambda: len(kubelet.registrations) > seen, 5)
            restart_ms.append((kubelet.registrations[-1].at - restarted) * 1000)
        print(describe("kubelet restart -> Register", restart_ms))
    finally:
        agent.stop()
        await task
        await kubelet.stop()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--xid-events", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=30)
    args = parser.parse_args()
    print(
        f"machine: {machine.describe()}, grpcio {grpc.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="vgb-", dir="/tmp") as tmp:
        await bench_allocate(Path(tmp), args.calls)
        await bench_health_and_restart(Path(tmp), args.xid_events, args.restarts)


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main())
