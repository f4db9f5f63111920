"""A simulated container that changes phase: its processes switch workloads at a moment."""

from __future__ import annotations

import asyncio
import math

import pytest

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.imperfections import IDEAL
from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, PlantSpec

LONG = Workload(kernel_s=0.002, blocks=1024)
COSTLY = Workload(kernel_s=0.004, blocks=512)


def test_a_container_without_a_switch_runs_its_one_workload():
    assert ContainerSpec("a", 40, LONG).phases() == [("", LONG)]
    # a switch that never comes is no switch
    assert ContainerSpec("a", 40, LONG, switch_to=COSTLY).phases() == [("", LONG)]


def test_the_phases_split_the_busy_time_at_the_switch():
    busy = Workload(kernel_s=0.002, busy=((1.0, 4.0), (6.0, 9.0)))
    later = Workload(kernel_s=0.004, busy=((0.0, 3.0), (4.5, math.inf)))
    phases = ContainerSpec("a", 40, busy, switch_to=later, switch_at_s=5.0).phases()
    assert [suffix for suffix, _ in phases] == ["", "-after"]
    before, after = phases[0][1], phases[1][1]
    assert before.busy == ((1.0, 4.0),)
    assert after.busy == ((5.0, math.inf),)
    assert after.kernel_s == 0.004
    # a phase with no busy time left never runs
    idle = ContainerSpec("a", 40, Workload(0.002, busy=((6.0, 7.0),)), switch_to=LONG,
                         switch_at_s=5.0).phases()[0][1]
    assert not any(idle.busy_at(t / 10) for t in range(100))


def test_a_container_can_change_phase_back():
    phases = ContainerSpec("a", 40, LONG, switch_to=COSTLY, switch_at_s=5.0,
                           switch_back_at_s=9.0).phases()
    assert [suffix for suffix, _ in phases] == ["", "-after", "-back"]
    assert [w.busy for _, w in phases] == [((0.0, 5.0),), ((5.0, 9.0),), ((9.0, math.inf),)]
    assert phases[2][1].kernel_s == LONG.kernel_s
    # coming back before (or as) it leaves is no phase: refused by name
    for back in (5.0, 3.0, math.nan):
        with pytest.raises(ValueError, match=r"switch_back_at_s must come after"):
            ContainerSpec("a", 40, LONG, switch_to=COSTLY, switch_at_s=5.0,
                          switch_back_at_s=back)


def test_each_phase_runs_only_on_its_side_of_the_switch():
    # The container's processes of each phase, unthrottled and alone on the GPU: the first set
    # holds the SMs until the switch, the second from it on, and the same second launches a
    # quarter of the tokens on the costlier kernels.
    run = ControlledRun((ContainerSpec("a", 100, LONG, switch_to=COSTLY, switch_at_s=2.0,
                                       policy="off"),), plant=PlantSpec(IDEAL))
    before, after = run.procs["a"]
    assert (before.name, after.name) == ("a-0", "a-0-after")
    asyncio.run(run.advance(4.0))
    first = dict(run.gpu.shares(before, 0.5))
    second = dict(run.gpu.shares(after, 0.5))
    assert all(first[t] == pytest.approx(100) and second[t] == 0 for t in (1.0, 1.5, 2.0))
    assert all(first[t] == 0 and second[t] == pytest.approx(100) for t in (3.0, 3.5, 4.0))
    assert LONG.cost / LONG.kernel_s == 4 * (COSTLY.cost / COSTLY.kernel_s)
