"""A container attacking the agent's state dir through the files it is given: growing `state`,
swapping it. The agent cuts it back, reads the file at the path, counts both in /metrics, and
the next pod's Allocate is answered."""

from __future__ import annotations

import os

import pytest

from tests.fakes.shimstate import ShimWriter
from tests.integration.plugin_harness import (
    RESOURCE,
    config_for,
    running_agent,
    short_dir,
    until,
)
from tests.integration.test_agent_region_problems import scrape_until
from vgpu_agent.shm import layout


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


async def test_a_grown_and_a_swapped_state_are_handled_and_allocate_goes_on(root):
    config = config_for(root, metrics_address="127.0.0.1:0")
    async with running_agent(config) as run:
        first = await run.kubelet.admit("ns", "pod", "main", RESOURCE, 1)
        mounted = {m.container_path: m.read_only for m in first.response.mounts}
        assert mounted["/run/vgpu/state"] is False and "/run/vgpu" not in mounted
        (region,) = run.agent.regions.regions()
        state = region.path / "state"
        with open(state, "r+b") as f:  # 256 MiB of junk past its end
            f.seek(layout.STATE_SIZE + (256 << 20))
            f.write(b"junk")
        # The controller's reads check the files every 0.5 s at most; the grid may add a tick.
        await until(lambda: state.stat().st_size == layout.STATE_SIZE, within=5.0)
        os.rename(state, region.path / "state.old")  # a region of an older agent: swappable
        state.write_bytes(layout.encode_state(1))
        writer = ShimWriter(region.path)
        try:
            writer.process(0, pid=7, host_pid=0, dev=0)
            events = await scrape_until(run.agent.metrics.url, "state_replaced")
            assert events["files_truncated"] >= 1 and events["state_replaced"] == 1
            assert events["identity_rejected"] == 0 and events["backstop_memory"] == 0
            assert events["tokens_overclaimed"] == 0  # exported, and its junk was no claim
            assert [p.pid for p in region.usage().processes] == [7]
        finally:
            writer.close()
        second = await run.kubelet.admit("ns", "pod2", "main", RESOURCE, 1)
        assert second.response.envs["NVIDIA_VISIBLE_DEVICES"]


@pytest.mark.parametrize("strategy", ["envvar", "cdi"])
async def test_either_strategy_mounts_the_region_files_and_never_a_directory(root, strategy):
    async with running_agent(config_for(root, device_list_strategy=strategy)) as run:
        admission = await run.kubelet.admit("ns", "pod", "main", RESOURCE, 1)
        mounts = {m.container_path: (m.host_path, m.read_only) for m in admission.response.mounts}
        for inside, (host, _) in mounts.items():
            assert os.path.isfile(host), f"{inside} mounts {host}, not a file"
        region_files = {p: ro for p, (_, ro) in mounts.items() if p.startswith("/run/vgpu/")}
        assert region_files == {"/run/vgpu/control": True, "/run/vgpu/state": False,
                                "/run/vgpu/hami.cache": False}
