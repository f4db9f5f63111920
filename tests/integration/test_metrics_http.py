"""The metrics endpoint served over HTTP, with the real pynvml path (fake libnvidia-ml), real
region files and the real PodResources client, through the faults a node sees."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from tests.fakes.fakenvml import NVML_ERROR_GPU_IS_LOST, FakeNvml
from tests.fakes.promtext import series, value
from tests.fakes.shimstate import DeviceSpec, FileRegion, ShimWriter, make_region
from vgpu_agent.gpu.nvml import NvmlBackend
from vgpu_agent.kubelet.podresources import PodResourcesClient
from vgpu_agent.kubelet.standin import Admission, KubeletStandIn
from vgpu_agent.metrics.http import MetricsService
from vgpu_agent.metrics.sources import Identity, MetricsSources
from vgpu_agent.shm.api import RegionHandle
from vgpu_agent.shm.regions import Region, format_alloc_id

GIB = 1 << 30
RESOURCE = "nvidia.com/gpu"


@dataclass
class Registration:
    registered: bool = False
    registrations: int = 0
    kubelet_restarts: int = 0
    last_error: str = ""


@dataclass
class Node:
    fake: FakeNvml
    backend: NvmlBackend
    service: MetricsService
    regions: list[RegionHandle]
    identities: dict[str, Identity]
    registration: Registration = field(default_factory=Registration)
    pod_resources: PodResourcesClient | None = None

    async def get(self, path: str, accept: str = "") -> tuple[int, str, str]:
        headers = {"Accept": accept} if accept else {}
        async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{self.service.port}{path}", headers=headers
        ) as response:
            return response.status, response.headers["Content-Type"], await response.text()

    async def scrape(self) -> str:
        await self.service.refresh()
        status, _, text = await self.get("/metrics")
        assert status == 200, text
        return text


@pytest.fixture
async def node(fake_nvml: FakeNvml, tmp_path: Path) -> AsyncIterator[Node]:
    backend = NvmlBackend(str(fake_nvml.library_path))
    await asyncio.to_thread(backend.start)
    inventory = await asyncio.to_thread(backend.discover)
    regions: list[RegionHandle] = []
    identities: dict[str, Identity] = {}
    holder: dict[str, Node] = {}

    def identity(alloc_id: str) -> Identity | None:
        client = holder["node"].pod_resources
        if client is None:
            return identities.get(alloc_id)
        handle = next((r for r in regions if r.alloc_id == alloc_id), None)
        ref = client.assignments.get(handle.device_ids[0]) if handle and handle.device_ids else None
        return tuple(ref) if ref is not None else None  # type: ignore[return-value]

    sources = MetricsSources(
        node="node-1",
        gpus=lambda: inventory.gpus,
        slices_per_gpu=4,
        regions=lambda: regions,
        identity=identity,
        nvml_errors=lambda: dict(backend.errors_by_call),
        registration=lambda: holder["node"].registration,
        pod_resources_failures=lambda: (
            holder["node"].pod_resources.failures if holder["node"].pod_resources else 0
        ),
        backend_error=lambda: "",
    )
    service = MetricsService(sources, host="127.0.0.1", port=0, backend=backend, poll_s=0.1)
    node = Node(fake_nvml, backend, service, regions, identities)
    holder["node"] = node
    task = asyncio.create_task(service.run())
    for _ in range(100):
        if service.port:
            break
        await asyncio.sleep(0.01)
    try:
        yield node
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(backend.shutdown)


def _region(node: Node, root: Path, identity: Identity, gpu: int, **kw: int) -> Path:
    """A region directory opened with the agent's own reader (`Region.open`)."""
    uuid = node.fake.uuids[gpu]
    seq = len(node.regions) + 1
    ids = [f"{uuid}::{gpu}"]
    alloc_id = format_alloc_id(seq, ids, seq)
    directory = make_region(root, alloc_id, [DeviceSpec(uuid, 8 * GIB, 25)], ids, seq=seq)
    node.regions.append(Region.open(directory))
    node.identities[alloc_id] = identity
    if kw:
        shim = ShimWriter(directory)
        shim.process(0, 10, 1010, 0, **kw)
        shim.device_totals(0, memory=kw.get("memory", 0))
        shim.close()
    return directory


async def test_nvml_error_on_one_gpu_keeps_the_endpoint_serving(
    node: Node, tmp_path: Path
) -> None:
    g0, g1 = node.fake.uuids
    node.fake.set_readings(g0, util=30, mem_used=3 * GIB)
    node.fake.set_readings(g1, util=60, mem_used=5 * GIB)
    _region(node, tmp_path, ("ns", "p0", "c"), 0, memory=GIB, launches=4)
    _region(node, tmp_path, ("ns", "p1", "c"), 1, memory=2 * GIB, launches=9)
    text = await node.scrape()
    assert value(text, "vgpu_gpu_utilization_ratio", gpu_uuid=g1) == 0.6

    node.fake.fail("nvmlDeviceGetUtilizationRates", g1, NVML_ERROR_GPU_IS_LOST)
    for _ in range(3):  # several scrapes while the GPU keeps failing
        text = await node.scrape()
        assert value(text, "vgpu_gpu_readings_stale", gpu_uuid=g1) == 1
        assert value(text, "vgpu_gpu_utilization_ratio", gpu_uuid=g1) is None
        assert value(text, "vgpu_gpu_utilization_ratio", gpu_uuid=g0) == 0.3
        assert value(text, "vgpu_gpu_memory_used_bytes", gpu_uuid=g0) == 3 * GIB
        assert value(text, "vgpu_container_memory_used_bytes", kind="data", pod="p1") == 2 * GIB
        assert value(text, "vgpu_container_kernel_launches_total", pod="p0") == 4
    errors = value(text, "vgpu_nvml_errors_total", call="nvmlDeviceGetUtilizationRates")
    assert errors is not None and errors >= 3

    node.fake.clear_failures()
    text = await node.scrape()
    assert value(text, "vgpu_gpu_readings_stale", gpu_uuid=g1) == 0
    assert value(text, "vgpu_gpu_utilization_ratio", gpu_uuid=g1) == 0.6


async def test_content_negotiation(node: Node) -> None:
    await node.service.refresh()
    status, ctype, text = await node.get("/metrics")
    assert status == 200 and ctype.startswith("text/plain") and "version=0.0.4" in ctype
    assert "# EOF" not in text
    status, ctype, text = await node.get(
        "/metrics", accept="application/openmetrics-text;version=1.0.0,text/plain;q=0.5"
    )
    assert status == 200 and ctype.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")


async def test_gzip_when_the_scraper_accepts_it(node: Node) -> None:
    await node.service.refresh()
    url = f"http://127.0.0.1:{node.service.port}/metrics"
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.get(url, headers={"Accept-Encoding": "gzip"}) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            packed = await response.read()
        async with session.get(url, headers={"Accept-Encoding": "identity"}) as response:
            assert "Content-Encoding" not in response.headers
            plain = await response.read()
    assert gzip.decompress(packed).startswith(b"# HELP") and len(packed) * 3 < len(plain)


async def test_probes_say_which_part_is_not_ready(node: Node) -> None:
    status, _, body = await node.get("/healthz")
    assert status == 200 and body.startswith("ok")
    status, _, body = await node.get("/readyz")
    assert status == 503 and "kubelet registration: not registered" in body
    node.registration.registered = True
    status, _, body = await node.get("/readyz")
    assert status == 200 and "registered" in body


async def test_slow_region_reads_do_not_block_the_loop(node: Node, tmp_path: Path) -> None:
    directory = _region(node, tmp_path, ("ns", "slow", "c"), 0, memory=GIB)

    class Slow(FileRegion):
        def usage(self):  # type: ignore[no-untyped-def]
            time.sleep(0.5)  # a region file on a stalled disk
            return super().usage()

    await node.service.refresh()  # a first round, read quickly
    node.regions[:] = [Slow(directory)]  # the stand-in reader, made slow
    refresh = asyncio.create_task(node.service.regions.refresh())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    status, _, _ = await node.get("/healthz")
    status_m, _, _ = await node.get("/metrics")  # served from the previous round
    assert status == status_m == 200
    assert time.perf_counter() - started < 0.3
    await refresh
    text = await node.scrape()
    assert value(text, "vgpu_container_memory_used_bytes", kind="data", pod="slow") == GIB


async def test_pod_resources_socket_missing_keeps_last_known_labels(
    node: Node, tmp_path: Path
) -> None:
    socket = tmp_path / "pod-resources" / "kubelet.sock"
    kubelet = KubeletStandIn(str(tmp_path / "device-plugins"), str(socket))
    await kubelet.start()
    client = PodResourcesClient(str(socket), RESOURCE, timeout_s=2.0)
    node.pod_resources = client
    try:
        g0 = node.fake.uuids[0]
        _region(node, tmp_path, ("ignored", "ignored", "ignored"), 0, memory=GIB)
        kubelet.admissions.append(Admission("team", "job-7", "worker", RESOURCE, [f"{g0}::0"],
                                            None))  # type: ignore[arg-type]
        assert await client.refresh()
        text = await node.scrape()
        labels = {"namespace": "team", "pod": "job-7", "container": "worker"}
        assert value(text, "vgpu_container_memory_used_bytes", kind="data", **labels) == GIB
        assert value(text, "vgpu_pod_resources_failures_total") == 0
    finally:
        await kubelet.stop()
    socket.unlink(missing_ok=True)
    assert not await client.refresh()
    assert not await client.refresh()
    text = await node.scrape()
    assert value(text, "vgpu_pod_resources_failures_total") == 2
    assert series(text, "vgpu_container_memory_used_bytes")[0][0]["pod"] == "job-7"
    await client.close()


async def test_corrupt_state_file_keeps_the_endpoint_serving(node: Node, tmp_path: Path) -> None:
    bad = _region(node, tmp_path, ("ns", "bad", "c"), 0, memory=GIB, launches=2)
    _region(node, tmp_path, ("ns", "good", "c"), 1, memory=2 * GIB, launches=5)
    (bad / "state").write_bytes(b"\x00garbage" * 100)  # what a broken process could leave
    text = await node.scrape()
    assert value(text, "vgpu_regions", state="corrupt") == 1
    assert value(text, "vgpu_container_memory_limit_bytes", pod="bad") == 8 * GIB
    assert value(text, "vgpu_container_memory_used_bytes", kind="data", pod="bad") is None
    assert value(text, "vgpu_container_memory_used_bytes", kind="data", pod="good") == 2 * GIB
    assert value(text, "vgpu_container_kernel_launches_total", pod="good") == 5


@pytest.mark.parametrize("reason", [None, "vgpu_agent.shm._usagec was not built"])
async def test_a_round_read_in_python_is_said_once_at_start(monkeypatch, reason) -> None:
    import vgpu_agent.metrics.http as http

    monkeypatch.setattr(http, "NOT_NATIVE_USAGE_REASON", reason)
    sources = MetricsSources(node="node-1", gpus=list, slices_per_gpu=4, regions=list,
                             identity=lambda alloc_id: None)
    service = MetricsService(sources, host="127.0.0.1", port=0)
    with capture_logs() as logs:
        await service.start()
    await service.stop()
    said = [(e["event"], e.get("reason")) for e in logs if "not_native" in e["event"]]
    assert said == ([] if reason is None else [("metrics_usage_read_not_native", reason)])
