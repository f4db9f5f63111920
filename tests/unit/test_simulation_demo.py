"""Simulated workloads in the agent's allocations, as `vgpu-agent simulate` runs them."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from vgpu_agent.simulation.demo import DemoWorkloads, run_demo_workloads
from vgpu_agent.simulation.region import SimRegion


def allocation(alloc_id, uuid, limit, policy="strict", priority=0):
    return SimRegion(alloc_id, (uuid,), (limit,), (policy,), priority=priority)


async def test_demo_reports_each_container_at_its_limit():
    allocations = [
        allocation("a", "GPU-0", 30),
        allocation("b", "GPU-0", 50),
        allocation("c", "GPU-1", 25),
    ]
    with capture_logs() as logs:
        last = await run_demo_workloads(lambda: allocations, report_every_s=3, duration_s=6,
                                        speed=1e6)
    shares = {s.alloc_id: s for s in last}
    assert shares["a"].share == pytest.approx(30, abs=2)
    assert shares["b"].share == pytest.approx(50, abs=2)
    assert shares["c"].share == pytest.approx(25, abs=2)
    assert {s.uuid for s in last} == {"GPU-0", "GPU-1"}
    reports = [e for e in logs if e["event"] == "demo_share"]
    assert len(reports) == 6  # two reports of three containers
    assert {"alloc_id", "limit", "share", "target", "policy", "uuid"} <= set(reports[0])
    # The allocations' own rates are not touched: the demo steers mirrors of them.
    assert all(a.rate_writes == 0 for a in allocations)


async def test_demo_follows_allocations_that_come_and_go():
    allocations = [allocation("first", "GPU-0", 40)]
    demo = DemoWorkloads(lambda: list(allocations))
    await demo.advance(2)
    allocations.append(allocation("second", "GPU-0", 60, policy="work-conserving"))
    await demo.advance(3)
    assert set(demo.mirrors) == {"first", "second"}
    allocations.pop(0)
    await demo.advance(3)
    assert set(demo.mirrors) == {"second"}
    assert len(demo.gpus["GPU-0"].processes) == 1
    # Alone and work-conserving, the remaining container may use the whole GPU.
    demo.shares(1.0)
    await demo.advance(2)
    assert demo.shares(2.0)[0].share > 90


async def test_demo_survives_an_unreadable_allocation_list():
    calls = {"n": 0}

    def regions():
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("state dir gone")
        return [allocation("a", "GPU-0", 30)]

    demo = DemoWorkloads(regions)
    await demo.advance(1)
    assert set(demo.mirrors) == {"a"}


@pytest.mark.parametrize("kwargs", [{"report_every_s": 0}, {"speed": 0}, {"tick_s": -1}])
async def test_bad_demo_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="must be > 0"):
        await run_demo_workloads(list, **kwargs)
