"""Nonsense in a container's `state` file is skipped, counted in /metrics, and nothing stops."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from tests.fakes.shimstate import ShimWriter
from tests.integration.plugin_harness import RESOURCE, config_for, running_agent, short_dir


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("vgpu_region_events_total{"):
            labels, value = line.rsplit(" ", 1)
            values[labels.split('event="')[1].split('"')[0]] = float(value)
    return values


async def scrape_until(url: str, event: str, within: float = 5.0) -> dict[str, float]:
    """Scrape until `event` has been counted: the agent reads regions at its own pace."""
    async with asyncio.timeout(within):
        while (events := await asyncio.to_thread(scrape, url)).get(event, 0) < 1:
            await asyncio.sleep(0.1)
    return events


async def test_skipped_records_and_corrupt_reads_are_counted_while_the_agent_serves(root):
    config = config_for(root, metrics_address="127.0.0.1:0")
    async with running_agent(config) as run:
        await run.kubelet.admit("ns", "pod", "main", RESOURCE, 1)
        (region,) = run.agent.regions.regions()
        writer = ShimWriter(region.path)
        try:
            writer.process(0, pid=7, host_pid=0, dev=0, memory=1 << 62)  # absurd memory
            events = await scrape_until(run.agent.metrics.url, "state_records_skipped")
            assert events["created"] == 1
            writer.scribble_header()
            await scrape_until(run.agent.metrics.url, "state_read_corrupt")
        finally:
            writer.close()
        # the device plugin is unaffected
        second = await run.kubelet.admit("ns", "pod2", "main", RESOURCE, 1)
        assert second.response.envs["NVIDIA_VISIBLE_DEVICES"]
