"""A region round in its worker thread lets the event loop run while it reads, even when the
interpreter would leave the GIL with the reading thread for a long time."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.shimstate import DeviceSpec, FileRegion, make_region
from vgpu_agent.gpu.sim import build_inventory
from vgpu_agent.metrics import poller
from vgpu_agent.metrics.poller import RegionCache
from vgpu_agent.shm.api import RegionUsage

G0 = build_inventory("1xA100-80GB")[0].uuid


class Busy(FileRegion):
    """A region whose `state` takes pure Python work to read (no system call that would
    release the GIL by itself)."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self._usage = super().usage()

    def usage(self) -> RegionUsage:
        deadline = time.perf_counter() + 0.002
        while time.perf_counter() < deadline:
            pass
        return self._usage


@pytest.fixture
def long_switch_interval() -> Iterator[None]:
    # a 0.5 s switch interval: without stepping aside the loop would wait for the whole round
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    yield
    sys.setswitchinterval(before)


async def test_the_loop_runs_during_a_long_round(
    tmp_path: Path, long_switch_interval: None
) -> None:
    pauses = 8
    regions = pauses * poller.STEP_ASIDE_EVERY
    handles = [
        Busy(make_region(tmp_path, f"r{n}", [DeviceSpec(G0, 1 << 30, 10)], [f"{G0}::{n % 16}"]))
        for n in range(regions)
    ]
    cache = RegionCache(lambda: handles)
    beats = 0
    done = asyncio.Event()

    async def heartbeat() -> None:
        nonlocal beats
        while not done.is_set():
            beats += 1
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.01)
    before = beats
    samples = await cache.refresh()
    done.set()
    await ticker
    assert len(samples) == regions
    # the round steps aside every STEP_ASIDE_EVERY regions and the loop runs in the pauses
    # (half of them, to leave room for a loaded machine); without them it ran only when the
    # round started and ended
    assert beats - before >= 2 + pauses // 2
