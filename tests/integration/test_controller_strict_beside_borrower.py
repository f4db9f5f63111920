"""A small `strict` tenant beside a `work-conserving` one that borrows the rest of the GPU: the
strict one gets its limit and, once its first limited rate is in force, never more than a little
above it, while the borrower takes what is left (`bench_strict.py` measures the same pair over
more plants and seeds)."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.imperfections import IDEAL, REAL
from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, PlantSpec

LIMIT = 5.0
SAT = Workload(kernel_s=0.002, blocks=1024, threads_per_block=256)  # saturates the GPU alone


async def _shares(plant: PlantSpec, seconds: float = 15.0) -> dict[str, list[tuple[float, float]]]:
    run = ControlledRun((ContainerSpec("strict", LIMIT, SAT, policy="strict"),
                         ContainerSpec("borrower", 60.0, SAT)),
                        tick_s=0.1, plant=plant, paced=True)
    await run.advance(seconds)
    assert run.controller.error_counts == {}
    # one process each: its share is the container's
    return {name: run.gpu.shares(procs[0], 0.5) for name, procs in run.procs.items()}


def _from(series: list[tuple[float, float]], start_s: float) -> list[float]:
    """Shares of the 0.5 s windows that start at `start_s` or later."""
    return [share for t, share in series if t - 0.5 >= start_s - 1e-9]


@pytest.mark.parametrize(("plant", "over", "off"), ids=["ideal", "s3/6Hz-0", "s3/6Hz-1", "s3/6Hz-2"], argvalues=[
    (PlantSpec(IDEAL), 0.5, 0.4),
    # sigma 3, samples every 1/6 s: the worst of 16 seeds in bench_strict went 0.9 over and
    # settled 0.23 above
    *[(PlantSpec(replace(REAL, nvml_sigma=3.0), 1 / 6, seed=seed), 2.0, 0.6) for seed in (0, 1, 2)],
])
async def test_a_small_strict_tenant_gets_its_limit_and_the_borrower_the_rest(plant, over, off):
    series = await _shares(plant)
    # the first tick (0.1 s) runs a newcomer unthrottled, by design: judged from 0.2 s on
    strict = _from(series["strict"], 0.2)
    assert max(strict) <= LIMIT + over
    settled = statistics.fmean(_from(series["strict"], 5.0))
    assert settled == pytest.approx(LIMIT, abs=off)
    # the borrower has what is left (less the context switches' cost), not its own 60 %
    assert statistics.fmean(_from(series["borrower"], 5.0)) > 90.0
