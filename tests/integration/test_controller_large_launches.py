"""A container whose launches come to cost far more tokens (a phase of large grids) gets back
to its share: its bucket grows with its launches even while its rate stays in the law's
deadband. Before, its burst stayed a fiftieth of a second of refill, each launch ran the bucket
into a debt, and the container read idle at its rate. With samples every second and launches
a thousand times costlier, it was at 3 % of the GPU 30 s after the change and back only about
40 s after it; now within 25 s."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.imperfections import REAL
from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, PlantSpec


@pytest.mark.slow
async def test_launches_costing_far_more_tokens_get_their_share_back():
    factor = 1000
    plant = PlantSpec(imperfections=replace(REAL, nvml_sigma=8.0), sample_period_s=1.0)
    grown = Workload(kernel_s=0.0002, blocks=1024 * factor // 10)  # tokens buy factor x less
    run = ControlledRun((
        ContainerSpec("a", 60.0, Workload(kernel_s=0.0002), policy="strict"),
        ContainerSpec("b", 40.0, Workload(kernel_s=0.002), policy="strict",
                      switch_to=grown, switch_at_s=10.0),
    ), plant=plant, paced=True)
    await run.advance(40.0)
    shares = run.gpu.shares(run.procs["b"][1], 5.0)  # its processes after the switch
    assert shares[-1][1] == pytest.approx(40, abs=3)
    assert run.gpu.shares(run.procs["a"][0], 5.0)[-1][1] <= 64  # its neighbour held as before
