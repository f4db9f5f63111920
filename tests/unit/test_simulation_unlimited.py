"""The bench's baseline with no limiter, and the peer model's full bucket beside it."""

from __future__ import annotations

import pytest

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.imperfections import IDEAL
from vgpu_agent.simulation.runner import (
    ContainerSpec,
    PlantSpec,
    Scenario,
    evaluate,
    run_peer,
    run_unlimited,
)

LONG = Workload(kernel_s=0.002, blocks=1024, threads_per_block=256)
# twice as long with half the blocks: four times LONG's SM time per token
COSTLY = Workload(kernel_s=0.004, blocks=512, threads_per_block=256)


def _pair(duration_s: float, policy: str = "work-conserving") -> Scenario:
    return Scenario("pair", (ContainerSpec("a", 20, LONG, policy=policy),
                             ContainerSpec("b", 80, COSTLY, policy=policy)),
                    lambda name, t: 20.0 if name == "a" else 80.0, duration_s)


def _mean(points: list[tuple[float, float]], after_s: float) -> float:
    values = [share for t, share in points if t >= after_s]
    return sum(values) / len(values)


def test_with_no_limiter_saturating_processes_split_the_gpu_by_its_time_slicing():
    result = run_unlimited(_pair(6.0, policy="strict"), plant=PlantSpec(IDEAL))
    a, b = (_mean(result.series[name], 1.0) for name in ("a", "b"))
    # neither limit counts: the GPU gives each process its turns, whatever its tokens buy
    assert a == pytest.approx(50, abs=3)
    assert b == pytest.approx(50, abs=3)
    assert a > 20 + 20  # the strict 20 % one runs far above its limit


def test_the_peer_model_never_throttles_while_its_full_bucket_lasts():
    # The bucket holds g_total blocks (8.65 M for the modelled GPU): at these workloads' rates,
    # tens of seconds of launches, so within a few seconds the peer is no limiter at all.
    scenario = _pair(6.0)
    plant = PlantSpec(IDEAL)
    peer = evaluate(run_peer(scenario, plant=plant, window_s=0.5), settle_exclude_s=1.0)
    none = evaluate(run_unlimited(scenario, plant=plant, window_s=0.5), settle_exclude_s=1.0)
    assert none.mean_abs_error > 20  # 50/50 against 20/80
    assert peer.mean_abs_error == pytest.approx(none.mean_abs_error, abs=0.05)
