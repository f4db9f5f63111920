"""DRA benchmark: NodePrepareResources for one claim against a bare grpc.aio call.

    python tests/bench/bench_dra_prepare.py [--calls 1000]

Three processes besides this client: the fake API server (ResourceClaims already allocated, as
the scheduler leaves them), the agent (`vgpu-agent run --mode dra` on 8 simulated GPUs, reading
each claim from that server, creating its region, writing its CDI spec and checkpoint), and a
bare grpc.aio server answering the same DRAPlugin RPC with an empty response on the same kind of
unix socket. The client registers the agent through the kubelet DRA stand-in's plugin watcher,
then alternates calls between the two so both see the same machine noise (and, third, a plain
read of the same claim through kubernetes_asyncio from this process, to show the API's share); each prepared claim is
unprepared right after (not timed), so the node never fills up. Prints p50/p99 of each and the
ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench import machine  # noqa: E402
from vgpu_agent._proto.dra.v1 import api_pb2, api_pb2_grpc  # noqa: E402
from vgpu_agent.dra.claims import ClaimReader  # noqa: E402
from vgpu_agent.kubelet.drastandin import DraKubeletStandIn  # noqa: E402

DRIVER = "gpu.vgpu.io"
NODE = "bench-node"

BARE_SERVER = """
import asyncio, sys
import grpc
from vgpu_agent._proto.dra.v1 import api_pb2, api_pb2_grpc

class Bare(api_pb2_grpc.DRAPluginServicer):
    async def NodePrepareResources(self, request, context):
        return api_pb2.NodePrepareResourcesResponse()

async def main():
    server = grpc.aio.server()
    api_pb2_grpc.add_DRAPluginServicer_to_server(Bare(), server)
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""

API_SERVER = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from tests.fakes.kubeapi import FakeKubeAPI

async def main():
    api = FakeKubeAPI(token=None)
    await api.start()
    api.add_node(sys.argv[3])
    store = api.resources
    for n in range(int(sys.argv[2])):
        name = f"claim-{n}"
        body = {
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.vgpu.io"}}]}},
        }
        claim = store.create("resourceclaims", "bench", body)
        claim["status"] = {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": "gpu.vgpu.io", "pool": sys.argv[3],
            "device": f"gpu-{n % 8}", "shareID": f"share-{n}",
            "consumedCapacity": {"memory": "1Gi", "cores": "10"}}], "config": []}}}
        store.update("resourceclaims", "bench", name, claim, "status")
    print(api.url, flush=True)
    for claim in store.items("resourceclaims"):
        print(claim["metadata"]["name"], claim["metadata"]["uid"], flush=True)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def main(calls: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="vg-bench-dra-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    api = await asyncio.create_subprocess_exec(
        sys.executable, "-c", API_SERVER, str(ROOT), str(calls + 10), NODE,
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert api.stdout is not None
    url = (await api.stdout.readline()).decode().strip()
    claims = []
    while (line := (await api.stdout.readline()).decode().strip()) != "ready":
        name, uid = line.split()
        claims.append(("bench", name, uid))
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "b", "cluster": {"server": url}}],
                "users": [{"name": "b", "user": {"token": "x"}}],
                "contexts": [{"name": "b", "context": {"cluster": "b", "user": "b"}}],
                "current-context": "b",
            }
        )
    )
    registry, plugins = root / "registry", root / "plugins"
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vgpu_agent.cli", "run", "--mode", "dra", "--backend", "sim",
        "--sim-gpus", "8xA100-80GB", "--state-dir", str(root / "state"),
        "--plugin-registry-dir", str(registry), "--dra-plugin-dir", str(plugins),
        "--cdi-dir", str(root / "cdi"), "--kubeconfig", str(kubeconfig),
        "--node-name", NODE, "--metrics-address", "127.0.0.1:0",
        "--pod-resources-socket", str(root / "pr.sock"), "--log-level", "warning",
        env=env, stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    bare_socket = root / "bare.sock"
    bare = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BARE_SERVER, str(bare_socket), env=env
    )
    kubelet = DraKubeletStandIn(str(registry), str(plugins))
    await kubelet.start()
    try:
        await kubelet.wait_registered(DRIVER, limit_s=60)
        for _ in range(100):
            if bare_socket.exists():
                break
            await asyncio.sleep(0.1)
        bare_channel = grpc.aio.insecure_channel(f"unix:{bare_socket}")
        bare_stub = api_pb2_grpc.DRAPluginStub(bare_channel)
        reader = ClaimReader(str(kubeconfig))
        await reader.start()
        prepare_s: list[float] = []
        bare_s: list[float] = []
        read_s: list[float] = []
        warmup = 10
        for i, claim in enumerate(claims[: calls + warmup]):
            request = api_pb2.NodePrepareResourcesRequest(
                claims=[api_pb2.Claim(namespace=claim[0], name=claim[1], uid=claim[2])]
            )
            started = time.perf_counter()
            await bare_stub.NodePrepareResources(request)
            bare_elapsed = time.perf_counter() - started
            started = time.perf_counter()
            result = (await kubelet.prepare(DRIVER, [claim]))[claim[2]]
            prepare_elapsed = time.perf_counter() - started
            if result.error:
                raise SystemExit(f"prepare failed: {result.error}")
            await kubelet.unprepare(DRIVER, [claim])
            started = time.perf_counter()
            await reader.read(claim[0], claim[1])
            read_elapsed = time.perf_counter() - started
            if i >= warmup:
                bare_s.append(bare_elapsed)
                prepare_s.append(prepare_elapsed)
                read_s.append(read_elapsed)
        await bare_channel.close()
        await reader.close()
    finally:
        await kubelet.stop()
        for proc in (agent, bare, api):
            proc.terminate()
            await proc.wait()
    p50, p99 = statistics.median(prepare_s) * 1e3, pct(prepare_s, 99) * 1e3
    b50, b99 = statistics.median(bare_s) * 1e3, pct(bare_s, 99) * 1e3
    print(f"machine: {machine.describe()}")
    print(f"NodePrepareResources, one claim ({len(prepare_s)} calls, API read included):")
    print(f"  agent  p50 {p50:.3f} ms  p99 {p99:.3f} ms")
    print(f"  bare   p50 {b50:.3f} ms  p99 {b99:.3f} ms")
    print(f"  ratio  p50 {p50 / b50:.2f}x  p99 {p99 / b99:.2f}x  (goal <= 2x)")
    r50, r99 = statistics.median(read_s) * 1e3, pct(read_s, 99) * 1e3
    print("  the claim read alone (kubernetes_asyncio, same fake server, from this process):")
    print(f"         p50 {r50:.3f} ms  p99 {r99:.3f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    asyncio.run(main(parser.parse_args().calls))
