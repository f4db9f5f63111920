"""A real Prometheus (Debian's package) scrapes the agent's endpoint every second; its HTTP API
must then hold the per-container series with the right labels and plausible values, and
`promtool check metrics` must accept the exposition.

`scripts/install-prometheus` installs the package when `prometheus`/`promtool` are missing; the
tests are skipped, saying why, only when that is impossible (no apt, no root, no network).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from tests.fakes.shimstate import DeviceSpec, FileRegion, ShimWriter, make_region
from vgpu_agent.gpu.sim import SimBackend, build_inventory
from vgpu_agent.metrics.http import MetricsService
from vgpu_agent.metrics.sources import MetricsSources

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
SPEC = "2xA100-80GB,1xL4-24GB"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def prometheus_tools() -> tuple[str, str]:
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        result = subprocess.run(
            [str(REPO / "scripts" / "install-prometheus")],
            capture_output=True, text=True, timeout=300, check=False,
        )
        if result.returncode != 0:
            pytest.skip(
                "Debian's prometheus package is not installed and could not be installed: "
                + (result.stderr.strip().splitlines() or ["no reason given"])[-1]
            )
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    assert prometheus and promtool
    return prometheus, promtool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One Prometheus server on loopback scraping `target` every second."""

    def __init__(self, binary: str, workdir: Path, target: str):
        self.port = free_port()
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
            "scrape_configs:\n  - job_name: vgpu-agent\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> dict:  # type: ignore[type-arg]
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://127.0.0.1:{self.port}{path}{query}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)

    def query(self, promql: str) -> list[dict]:  # type: ignore[type-arg]
        answer = self.api("/api/v1/query", query=promql)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_ready(self, limit_s: float = 30) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.logs()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"prometheus not ready after {limit_s} s: {self.logs()}")

    def wait_scrapes(self, count: int, limit_s: float = 30) -> None:
        """Until the target has been scraped successfully `count` times."""
        deadline = time.monotonic() + limit_s
        seen = 0.0
        while time.monotonic() < deadline:
            result = self.query('count_over_time(up{job="vgpu-agent"}[5m])')
            healthy = self.query('min_over_time(up{job="vgpu-agent"}[5m])')
            seen = float(result[0]["value"][1]) if result else 0.0
            if seen >= count and healthy and float(healthy[0]["value"][1]) == 1.0:
                return
            time.sleep(0.25)
        targets = self.api("/api/v1/targets")
        raise AssertionError(f"{seen} scrapes after {limit_s} s; targets: {targets}")

    def logs(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text()[-2000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def prometheus_factory(
    prometheus_tools: tuple[str, str], tmp_path: Path
) -> Iterator[Callable[[str], Prometheus]]:
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        workdir = tmp_path / f"prometheus-{len(started)}"
        workdir.mkdir()
        server = Prometheus(prometheus_tools[0], workdir, target)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


# ------------------------------------------------------------------ the node being scraped


class Registration:
    registered = True
    registrations = 1
    kubelet_restarts = 0
    last_error = ""


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[MetricsService]:
    """Simulated GPUs and three containers (one with two GPUs, two sharing a pod) whose region
    files a shim-like writer keeps updating while Prometheus scrapes."""
    backend = SimBackend(SPEC)
    backend.start()
    gpus = build_inventory(SPEC)
    g0, g1, g2 = (g.uuid for g in gpus)
    for index, uuid in enumerate((g0, g1, g2)):
        backend.set_readings(uuid, util=0.2 * (index + 1), mem_used=(index + 1) * GIB, temp=45)
    root = tmp_path / "regions"
    specs = {
        "r1": (("ml", "train-0", "trainer"), [DeviceSpec(g0, 20 * GIB, 25), DeviceSpec(g1, 20 * GIB, 25)]),
        "r2": (("ml", "infer-0", "server"), [DeviceSpec(g2, 6 * GIB, 50)]),
        "r3": (("ml", "infer-0", "sidecar"), [DeviceSpec(g2, 2 * GIB, 25)]),
    }
    regions, writers, identities = [], [], {}
    for n, (alloc_id, (identity, devices)) in enumerate(specs.items()):
        ids = [f"{d.uuid}::{n}" for d in devices]
        directory = make_region(root, alloc_id, devices, ids, seq=n + 1)
        regions.append(FileRegion(directory))
        identities[alloc_id] = identity
        writers.append((ShimWriter(directory), len(devices)))
    sources = MetricsSources(
        node="sim-node",
        gpus=lambda: gpus,
        slices_per_gpu=4,
        regions=lambda: regions,
        identity=identities.get,
        healthy=lambda: {g.uuid: True for g in gpus},
        xid_counts=lambda: {},
        registration=lambda: Registration(),
        region_events=lambda: {"created": 3},
        pod_resources_failures=lambda: 0,
    )
    service = MetricsService(sources, host="127.0.0.1", port=0, backend=backend, poll_s=0.2)
    service.instruments.on_result("ok", 0.003)

    async def shim_activity() -> None:
        launches = 0
        while True:
            launches += 10
            for number, (writer, count) in enumerate(writers):
                for dev in range(count):
                    writer.process(0, 100 + number, 5000 + number, dev, memory=(number + 1) * GIB,
                                   launches=launches, wait_ns=launches * 1000,
                                   last_launch_ns=time.monotonic_ns())
                    writer.device_totals(dev, memory=(number + 1) * GIB)
            await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(service.run()), asyncio.create_task(shim_activity())]
    for _ in range(200):
        if service.port:
            break
        await asyncio.sleep(0.01)
    try:
        yield service
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer, _ in writers:
            writer.close()


async def test_prometheus_scrapes_per_container_series(
    served: MetricsService,
    prometheus_factory: Callable[[str], Prometheus],
    prometheus_tools: tuple[str, str],
) -> None:
    prometheus = prometheus_factory(f"127.0.0.1:{served.port}")
    # two scrapes for the series; two more so the agent has learnt the rhythm and re-read the
    # regions between scrapes (the first two may carry the same region data)
    await asyncio.to_thread(prometheus.wait_scrapes, 4)

    limits = await asyncio.to_thread(prometheus.query, "vgpu_container_memory_limit_bytes")
    got = sorted(
        (r["metric"]["namespace"], r["metric"]["pod"], r["metric"]["container"],
         r["metric"]["gpu_index"], float(r["value"][1]))
        for r in limits
    )
    assert got == [
        ("ml", "infer-0", "server", "2", 6.0 * GIB),
        ("ml", "infer-0", "sidecar", "2", 2.0 * GIB),
        ("ml", "train-0", "trainer", "0", 20.0 * GIB),
        ("ml", "train-0", "trainer", "1", 20.0 * GIB),
    ]
    for r in limits:
        assert r["metric"]["job"] == "vgpu-agent" and r["metric"]["gpu_uuid"].startswith("GPU-")

    used = await asyncio.to_thread(
        prometheus.query, 'vgpu_container_memory_used_bytes{container="sidecar", kind="data"}'
    )
    assert [float(r["value"][1]) for r in used] == [3.0 * GIB]
    launches = await asyncio.to_thread(
        prometheus.query, 'rate(vgpu_container_kernel_launches_total{pod="train-0"}[10s])'
    )
    assert len(launches) == 2 and all(float(r["value"][1]) > 0 for r in launches)
    ages = await asyncio.to_thread(prometheus.query, "vgpu_container_last_launch_age_seconds")
    assert len(ages) == 4 and all(0 <= float(r["value"][1]) < 5 for r in ages)
    gpu_util = await asyncio.to_thread(
        prometheus.query, 'vgpu_gpu_utilization_ratio{model="NVIDIA L4-24GB"}'
    )
    assert [round(float(r["value"][1]), 3) for r in gpu_util] == [0.6]
    assert gpu_util[0]["metric"]["node"] == "sim-node"

    body, _ = await served.render("")
    check = subprocess.run(
        [prometheus_tools[1], "check", "metrics"], input=body, capture_output=True, timeout=30,
        check=False,
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


async def test_promtool_flags_only_the_legacy_hami_names(
    served: MetricsService, prometheus_tools: tuple[str, str]
) -> None:
    served.hami = True
    await served.refresh()
    body, _ = await served.render("")
    check = subprocess.run(
        [prometheus_tools[1], "check", "metrics"], input=body, capture_output=True, timeout=30,
        check=False,
    )
    complaints = (check.stdout + check.stderr).decode().strip().splitlines()
    assert sorted(line.split()[0] for line in complaints) == [
        "HostCoreUtilization",
        "HostGPUMemoryUsage",
        "vGPU_device_memory_limit_in_bytes",
        "vGPU_device_memory_usage_in_bytes",
    ]
