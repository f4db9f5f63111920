"""The endpoint outlives failures of what it reads: a source that raises, a backend gone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

from tests.fakes.promtext import value
from vgpu_agent.gpu.sim import SimBackend, build_inventory
from vgpu_agent.metrics.http import MetricsService
from vgpu_agent.metrics.sources import MetricsSources
from vgpu_agent.shm.api import RegionHandle

SPEC = "2xL4-24GB"
GPUS = build_inventory(SPEC)


async def _get(port: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(
        f"http://127.0.0.1:{port}{path}"
    ) as response:
        return response.status, await response.text()


async def _running(service: MetricsService) -> asyncio.Task[None]:
    task = asyncio.create_task(service.run())
    for _ in range(200):
        if service.port:
            return task
        await asyncio.sleep(0.01)
    raise AssertionError("metrics service did not bind")


async def test_a_failing_region_source_gives_500_then_recovers() -> None:
    broken = [True]

    def regions() -> Iterable[RegionHandle]:
        if broken[0]:
            raise RuntimeError("region store is reloading")
        return ()

    sources = MetricsSources(node="n", gpus=lambda: GPUS, slices_per_gpu=2, regions=regions)
    service = MetricsService(sources, host="127.0.0.1", port=0, region_max_age_s=0.05)
    task = await _running(service)
    try:
        status, body = await _get(service.port, "/metrics")
        assert status == 500 and "region store is reloading" in body
        assert service.scrape_errors == 1
        status, _ = await _get(service.port, "/healthz")
        assert status == 200  # the server itself is fine
        broken[0] = False
        status, body = await _get(service.port, "/metrics")
        assert status == 200 and "vgpu_gpu_memory_total_bytes" in body
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_poller_keeps_running_when_the_inventory_source_raises() -> None:
    backend = SimBackend(SPEC)
    backend.start()
    calls = [0]

    def gpus() -> list:  # type: ignore[type-arg]
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("inventory being replaced")
        return GPUS

    backend.set_readings(GPUS[0].uuid, util=0.5)
    sources = MetricsSources(node="n", gpus=gpus, slices_per_gpu=2)
    service = MetricsService(sources, host="127.0.0.1", port=0, backend=backend, poll_s=0.1)
    task = await _running(service)
    try:
        assert service.poller is not None
        for _ in range(100):  # the failed round is retried after a pause
            if service.poller.rounds >= 3:
                break
            await asyncio.sleep(0.05)
        assert service.poller.rounds >= 3
        status, body = await _get(service.port, "/metrics")
        assert status == 200
        assert value(body, "vgpu_gpu_utilization_ratio", gpu_uuid=GPUS[0].uuid) == 0.5
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_port_in_use_is_named() -> None:
    sources = MetricsSources(node="n", gpus=lambda: (), slices_per_gpu=1)
    first = MetricsService(sources, host="127.0.0.1", port=0)
    await first.start()
    try:
        second = MetricsService(sources, host="127.0.0.1", port=first.port)
        try:
            await second.start()
        except OSError as err:
            assert f"127.0.0.1:{first.port}" in str(err)
        else:
            await second.stop()
            raise AssertionError("a second server bound the same port")
    finally:
        await first.stop()

