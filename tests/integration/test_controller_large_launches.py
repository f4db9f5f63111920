"""A container whose tokens come to buy far less SM time gets back to its share.

- Launches costing far more tokens (a phase of large grids): its bucket grows with its launches
  even while its rate stays in the law's deadband. Before, its burst stayed a fiftieth of a
  second of refill, each launch ran the bucket into a debt, and the container read idle at its
  rate. With samples every second and launches a thousand times costlier, it was at 3 % of the
  GPU 30 s after the change and back only about 40 s after it; now within 25 s.
- Launches 50 times dearer for the same SM time (larger blocks of shorter threads): at its old
  rate it used about 0.1 % of the GPU, which NVML reports as 0. A zero where several percent
  were expected was taken, every time, for a sample NVML missed, and nothing was learned. With
  samples every second (sigma 8) it got back 19 s after the change, or not within 30 s,
  depending on the plant's seed, and read 0-1 % until then. Two zeros in a row from a process
  NVML lists now bound its use, and its rate rises to what that says: back 4-14 s after the
  change for these seeds.
- Launches dearer than the shim's longest wait (2 s) of refill: it runs each in debt, and the
  audit forgives that debt rather than taking it for a lie. With three processes, each runs
  one such launch after its own longest wait, three within 2 s, sometimes in one tick: the
  audit forgives one debt per process; before, the second was taken for a lie and the
  container capped near 0 %. And zeros read while the estimate is too loose to learn from
  them go on raising `k`: before, after the first raise, they were set aside, and the
  container stayed at 0.3 % of its 40."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.imperfections import REAL
from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, PlantSpec


def beside_a_neighbour(grown: Workload, seed: int = 0, processes: int = 1) -> ControlledRun:
    """A strict 40 % container (of `processes`) moving to `grown` at 10 s beside a strict
    60 % one, with NVML samples every second (sigma 8)."""
    plant = PlantSpec(imperfections=replace(REAL, nvml_sigma=8.0), sample_period_s=1.0, seed=seed)
    return ControlledRun((
        ContainerSpec("a", 60.0, Workload(kernel_s=0.0002), policy="strict"),
        ContainerSpec("b", 40.0, Workload(kernel_s=0.002), policy="strict", processes=processes,
                      switch_to=grown, switch_at_s=10.0),
    ), plant=plant, paced=True)


CASES = [  # the workload after the change, when to look (5 s windows end there), seeds
    # launches a thousand times costlier (grids 1,000 times larger)
    (Workload(kernel_s=0.0002, blocks=1024 * 100), 40.0, [0]),
    # 50 times dearer for the same SM time (blocks of 50 times the threads): 5-15 s after
    (Workload(kernel_s=0.0002, threads_per_block=256 * 50), 25.0, [0, 1, 2]),
    # Grids 5,000 times larger: each launch 2.5 s of refill, more than the bucket (a second of
    # refill at most) and the audit's loan. The shim runs one after its longest wait (2 s), in
    # debt. Before, each was taken for a lie and the cap held the container near 0 %.
    (Workload(kernel_s=0.0002, blocks=1024 * 500), 38.0, [0, 1, 2]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("grown", "at_s", "seed"), [
    (grown, at_s, seed) for grown, at_s, seeds in CASES for seed in seeds])
async def test_tokens_that_buy_far_less_get_their_share_back(grown, at_s, seed):
    run = beside_a_neighbour(grown, seed)
    await run.advance(at_s)
    assert "tokens_overclaimed" not in run.controller.error_counts  # it is honest
    # its processes after the switch, over the last 5 s
    assert run.gpu.shares(run.procs["b"][1], 5.0)[-1][1] == pytest.approx(40, abs=3)
    assert run.gpu.shares(run.procs["a"][0], 5.0)[-1][1] <= 64  # its neighbour held as before


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_three_processes_of_launches_dearer_than_the_longest_wait_get_their_share(seed):
    run = beside_a_neighbour(Workload(kernel_s=0.0002, blocks=1024 * 500), seed, processes=3)
    await run.advance(38.0)
    assert "tokens_overclaimed" not in run.controller.error_counts  # it is honest
    after = run.procs["b"][3:]  # its three processes after the switch, over the last 5 s
    assert sum(run.gpu.shares(p, 5.0)[-1][1] for p in after) == pytest.approx(40, abs=3)
    assert run.gpu.shares(run.procs["a"][0], 5.0)[-1][1] <= 64
