"""The NVML readings cache and the region cache that scrapes read."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.fakes.shimstate import DeviceSpec, FileRegion, make_region
from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.gpu.model import GpuReadings
from vgpu_agent.gpu.sim import SimBackend, build_inventory
from vgpu_agent.metrics.poller import GpuPoller, RegionCache
from vgpu_agent.shm.regions import RegionStore

SPEC = "3xA100-80GB"
GPUS = build_inventory(SPEC)


@pytest.fixture
def backend() -> SimBackend:
    sim = SimBackend(SPEC)
    sim.start()
    return sim


async def test_poll_caches_every_gpu(backend: SimBackend) -> None:
    backend.set_readings(GPUS[1].uuid, util=0.75, temp=61.0, power=250.0, mem_used=7)
    poller = GpuPoller(backend, lambda: GPUS, 1.0)
    samples = await poller.poll_once()
    assert set(samples) == {g.uuid for g in GPUS}
    assert samples[GPUS[1].uuid].readings == GpuReadings(7, 0.75, 61.0, 250.0)
    assert not any(s.stale for s in samples.values())


async def test_one_failing_gpu_is_stale_alone_and_recovers(backend: SimBackend) -> None:
    clock = iter(float(t) for t in range(100))
    poller = GpuPoller(backend, lambda: GPUS, 1.0, clock=lambda: next(clock))
    await poller.poll_once()
    lost = GPUS[2].uuid
    backend.set_lost(lost)
    for _ in range(3):
        samples = await poller.poll_once()
    assert samples[lost].stale and samples[lost].failures == 3
    assert lost in samples[lost].error  # the error names the GPU
    assert samples[lost].polled_at == 0.0  # the last good poll, kept for its age
    assert samples[lost].readings is not None  # the old figures stay, flagged stale
    assert not samples[GPUS[0].uuid].stale and not samples[GPUS[1].uuid].stale
    backend.set_lost(lost, False)
    samples = await poller.poll_once()
    assert not samples[lost].stale and samples[lost].failures == 3  # a counter never drops


async def test_a_crashing_backend_call_marks_the_gpu_stale(backend: SimBackend) -> None:
    class Broken(SimBackend):
        def readings(self, uuid: str) -> GpuReadings:
            if uuid == GPUS[0].uuid:
                raise RuntimeError("bug in a backend")
            return super().readings(uuid)

    broken = Broken(SPEC)
    broken.start()
    samples = await GpuPoller(broken, lambda: GPUS).poll_once()
    assert samples[GPUS[0].uuid].stale and "bug in a backend" in samples[GPUS[0].uuid].error
    assert samples[GPUS[0].uuid].readings is None
    assert not samples[GPUS[1].uuid].stale


async def test_no_inventory_yet_means_no_poll(backend: SimBackend) -> None:
    poller = GpuPoller(backend, lambda: (), 0.5)
    assert await poller.poll_once() == {}
    assert poller.rounds == 0


async def test_poll_does_not_block_the_loop() -> None:
    class Slow(SimBackend):
        def readings(self, uuid: str) -> GpuReadings:
            import time

            time.sleep(0.3)  # a sick GPU can take seconds to answer
            return super().readings(uuid)

    slow = Slow("1xA100-80GB")
    slow.start()
    poller = GpuPoller(slow, lambda: build_inventory("1xA100-80GB"))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    await poller.poll_once()
    task.cancel()
    assert ticks >= 10  # the loop kept turning while NVML was slow


@pytest.mark.parametrize("interval", [0, -1.0, float("nan")])
def test_bad_interval_is_named(interval: float) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        GpuPoller(SimBackend(SPEC), lambda: GPUS, interval)
    with pytest.raises(ValueError, match="must be > 0"):
        RegionCache(lambda: (), interval)


async def test_region_cache_reads_limits_and_usage(tmp_path: Path) -> None:
    uuid = GPUS[0].uuid
    directory = make_region(tmp_path, "a1", [DeviceSpec(uuid, 1 << 30, 25, "strict", 1000, 50)],
                            [f"{uuid}::2"], seq=9)
    cache = RegionCache(lambda: [FileRegion(directory)])
    (sample,) = await cache.refresh()
    assert sample.alloc_id == "a1" and sample.seq == 9 and sample.device_ids == (f"{uuid}::2",)
    (dev,) = sample.devices
    assert (dev.uuid, dev.memory_limit, dev.core_limit, dev.policy, dev.rate, dev.burst) == (
        uuid, 1 << 30, 25.0, "strict", 1000, 50)
    assert sample.usage is not None and not sample.usage.corrupt


async def test_region_cache_skips_a_region_that_vanishes(tmp_path: Path) -> None:
    uuid = GPUS[0].uuid
    keep = FileRegion(make_region(tmp_path, "keep", [DeviceSpec(uuid, 1, 10)], [f"{uuid}::0"]))

    class Vanished(FileRegion):
        def rate(self, dev: int) -> tuple[int, int]:
            raise ValueError("mmap closed or invalid")

    gone = Vanished(make_region(tmp_path, "gone", [DeviceSpec(uuid, 1, 10)], [f"{uuid}::1"]))
    cache = RegionCache(lambda: [gone, keep])
    samples = await cache.refresh()
    assert [s.alloc_id for s in samples] == ["keep"]
    assert cache.read_errors == 1
    await cache.refresh()
    assert cache.read_errors == 2 and cache.rounds == 2


def _one_region(tmp_path: Path) -> FileRegion:
    uuid = GPUS[0].uuid
    return FileRegion(make_region(tmp_path, "a", [DeviceSpec(uuid, 1, 10)], [f"{uuid}::0"]))


async def test_region_cache_reads_nothing_until_scraped(tmp_path: Path) -> None:
    region = _one_region(tmp_path)
    cache = RegionCache(lambda: [region])
    runner = asyncio.create_task(cache.run())
    await asyncio.sleep(0.1)
    assert cache.rounds == 0
    assert cache.due_in(time.monotonic()) is None  # nothing due: it sleeps until a scrape
    assert len(await cache.fresh()) == 1  # the first scrape waits for a round
    assert (cache.rounds, cache.waited_rounds) == (1, 1)
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)


async def test_region_cache_run_sleeps_until_the_round_is_due_then_until_a_scrape(
    tmp_path: Path,
) -> None:
    region = _one_region(tmp_path)
    cache = RegionCache(lambda: [region], max_age_s=5.0, lead_s=0.25)
    waits: list[float | None] = []
    due_in = cache.due_in

    def recorded(now: float) -> float | None:
        waits.append(due_in(now))
        return waits[-1]

    cache.due_in = recorded  # type: ignore[method-assign]
    runner = asyncio.create_task(cache.run())
    try:
        await asyncio.sleep(0.05)
        assert waits == [None]  # no scrape yet: no timer at all
        await cache.fresh()
        await asyncio.sleep(0.3)  # the second scrape sets a 0.3 s rhythm
        await cache.fresh()
        rounds = cache.rounds
        await asyncio.sleep(0.02)
        pending = waits[-1]
        assert cache.scrape_gap is not None and cache.scrape_gap >= 0.3
        # due lead_s before the next scrape: about 0.05 s after this one
        assert pending is not None and 0.0 < pending <= cache.scrape_gap - 0.25
        await asyncio.sleep(0.25)
        assert cache.rounds == rounds + 1  # the round ran before the expected scrape
        assert waits[-1] is None  # and then nothing until the scrape comes
        woken = len(waits)
        await asyncio.sleep(0.3)
        assert len(waits) == woken  # no wake-ups while it waits
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_region_cache_reads_once_per_scrape_just_before_it(tmp_path: Path) -> None:
    region = _one_region(tmp_path)
    now = [100.0]
    cache = RegionCache(lambda: [region], max_age_s=5.0, lead_s=1.0, clock=lambda: now[0])
    for _ in range(2):  # the first two scrapes teach it the 15 s rhythm
        await cache.fresh()
        now[0] += 15.0
    assert cache.scrape_gap == 15.0
    for _ in range(4):  # later scrapes: one background round before each, none waited for
        await cache.fresh()
        rounds, read_after = cache.rounds, None
        for step in range(1, 15 * 4 + 1):  # the agent's ticks between two scrapes
            now[0] += 0.25
            await cache.refresh_if_due()
            if read_after is None and cache.rounds > rounds:
                read_after = step * 0.25
        assert cache.rounds == rounds + 1
        assert read_after == 14.0  # lead_s before the scrape due at 15 s
    waited = cache.waited_rounds
    await cache.fresh()
    assert cache.waited_rounds == waited  # data were about 1 s old: served as they were


async def test_region_cache_waits_for_a_round_after_a_pause(tmp_path: Path) -> None:
    region = _one_region(tmp_path)
    now = [0.0]
    cache = RegionCache(lambda: [region], max_age_s=5.0, lead_s=1.0, clock=lambda: now[0])
    await cache.fresh()
    now[0] += 4.0
    await cache.fresh()
    assert cache.rounds == 1  # young enough to serve
    for _ in range(600 * 4):  # the scraper goes away for ten minutes
        now[0] += 0.25
        await cache.refresh_if_due()
    assert cache.rounds == 2  # only the round for the scrape it expected at 8 s
    await cache.fresh()
    assert cache.rounds == 3 and cache.waited_rounds == 2


async def test_two_interleaved_scrapers_set_the_rhythm(tmp_path: Path) -> None:
    region = _one_region(tmp_path)
    now = [0.0]
    cache = RegionCache(lambda: [region], clock=lambda: now[0])
    for gap in (15.0, 3.0, 12.0, 3.0, 12.0):  # replica B scrapes 3 s after replica A
        await cache.fresh()
        now[0] += gap
    assert cache.scrape_gap == 3.0


async def test_concurrent_refreshes_share_one_round(tmp_path: Path) -> None:
    uuid = GPUS[0].uuid
    region = FileRegion(make_region(tmp_path, "a", [DeviceSpec(uuid, 1, 10)], [f"{uuid}::0"]))
    calls = 0

    def regions() -> list[FileRegion]:
        nonlocal calls
        calls += 1
        return [region]

    cache = RegionCache(regions)
    results = await asyncio.gather(*(cache.refresh() for _ in range(5)))
    assert calls == 1 and cache.rounds == 1
    assert all(r == results[0] for r in results)
    await cache.refresh()
    assert cache.rounds == 2  # a later call starts a new round


async def test_a_region_collected_during_a_round_is_no_read_error(tmp_path: Path) -> None:
    # The round's list is taken on the loop; the region store may collect one of its regions
    # (its container is gone) before the worker thread reads it. That is no fault of anyone's:
    # skipped without a warning and without counting towards vgpu_region_read_errors.
    uuid = GPUS[0].uuid
    store = RegionStore(tmp_path / "state")
    store.adopt()
    try:
        kept = store.create(Grant((f"{uuid}::0",), (GrantedDevice(uuid, 0, 1, 1 << 30, 25.0),)))
        gone = store.create(Grant((f"{uuid}::1",), (GrantedDevice(uuid, 0, 1, 1 << 30, 25.0),)))
        listed = [gone, kept]
        store.discard(gone.alloc_id)  # collected after the list was taken
        assert gone.closed
        cache = RegionCache(lambda: listed)
        with capture_logs() as logs:
            samples = await cache.refresh()
        assert [s.alloc_id for s in samples] == [kept.alloc_id]
        assert cache.read_errors == 0
        assert not [e for e in logs if e["event"] == "region_unreadable"]
    finally:
        store.close()
