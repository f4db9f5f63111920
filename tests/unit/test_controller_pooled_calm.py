"""A crowded time-sliced GPU is calm unless its rates move together: each container's share
there is an estimate, and one rate of many following its noise is no news (`_rates_moved`,
the controller's module note), though the GPU then slows no further than `max_tick_s`; with a
few containers, each rate still counts alone."""

from __future__ import annotations

import argparse
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.bench import bench_throttle as bench
from vgpu_agent.simulation.runner import ControlledRun, _series
from vgpu_agent.throttle.control import Decision, LoopState
from vgpu_agent.throttle.controller import UNLIMITED_RATE, _rates_moved

RATE = 1_000_000


def steered(moves: list[tuple[int, int | None]]) -> list[tuple[object, int, int]]:
    """(written before, written now; None: never decided) per device, as `_steer_gpu` leaves
    them after settling."""
    out = []
    for before, now in moves:
        last = None if now is None else (
            None, Decision(now, 1_000, 10.0, False, 10.0, LoopState()), False)
        out.append((SimpleNamespace(last=last), before, 1_000))
    return out


def test_one_rate_of_ten_moving_far_is_calm_as_a_crowd_only():
    moves = [(RATE, RATE)] * 9 + [(RATE, int(RATE * 1.15))]
    assert _rates_moved(steered(moves), 0.02) == (False, True)


def test_every_rate_moving_a_little_together_is_news():
    assert _rates_moved(steered([(RATE, int(RATE * 1.03))] * 10), 0.02) == (True, True)
    assert _rates_moved(steered([(RATE, int(RATE * 1.01))] * 10), 0.02) == (False, False)


def test_each_rate_counts_against_its_own_not_the_largest():
    # small rates moving by a tenth each are news even beside one twenty times larger
    moves = [(20 * RATE, 20 * RATE)] + [(RATE // 20, RATE // 20 * 11 // 10)] * 4
    assert _rates_moved(steered(moves), 0.02)[0]


@pytest.mark.parametrize("before, now", [(0, RATE), (RATE, UNLIMITED_RATE),
                                         (UNLIMITED_RATE, RATE)])
def test_a_rate_set_or_lifted_is_news_alone(before, now):
    assert _rates_moved(steered([(RATE, RATE)] * 9 + [(before, now)]), 0.02) == (True, True)


def test_paused_and_unlimited_rates_that_stay_are_calm_and_undecided_devices_are_skipped():
    moves = [(0, 0), (UNLIMITED_RATE, UNLIMITED_RATE), (RATE, None), (RATE, RATE)]
    assert _rates_moved(steered(moves), 0.02) == (False, False)
    assert _rates_moved(steered([(RATE, None)]), 0.02) == (False, False)


async def ticks_and_errors(pooled_at: int, scenario: str, seed: int, seconds: float = 60.0
                           ) -> tuple[float, float]:
    """The agent's ticks a second from 20 to 40 s of a paced run of the throttle bench's
    `scenario` on its time-sliced ideal plant, and the largest error of a container's mean
    share then (points)."""
    plant = next(p for p in bench.PLANTS if p.name == "ideal")
    spec = replace(bench.spec_of(plant, argparse.Namespace(
        attribution="time-sliced", launch_hold_us=0.0, sample_lag_ms=0.0,
        sample_lag_jitter_ms=0.0)), seed=seed)
    sc = bench.attainable(next(s for s in bench.scenarios(seconds)
                               if s.name.startswith(scenario)), spec)
    run = ControlledRun(sc.containers, tick_s=0.1, plant=spec, paced=True)
    run.controller.calm_pooled_at = pooled_at
    ticks = [0]
    tick = run.controller.tick

    async def counted(paced: bool = False) -> None:
        ticks[0] += 1
        await tick(paced)

    run.controller.tick = counted  # type: ignore[method-assign]
    await run.advance(20.0)
    before = ticks[0]
    await run.advance(20.0)
    errors = []
    for name, points in _series(run.gpu, run.procs, 1.0).items():
        shares = [share for t, share in points if t > 20.0]
        errors.append(abs(sum(shares) / len(shares) - sc.expected(name, 40.0)))
    return (ticks[0] - before) / 20.0, max(errors)


@pytest.mark.slow
async def test_ten_containers_sharing_a_time_sliced_gpu_tick_less_and_keep_their_shares():
    # every rate counted alone (pooling off) against the default, three seeds each
    alone = [await ticks_and_errors(10**6, "5", seed) for seed in range(3)]
    pooled = [await ticks_and_errors(8, "5", seed) for seed in range(3)]
    assert sum(t for t, _ in pooled) < 0.5 * sum(t for t, _ in alone), (pooled, alone)
    assert max(e for _, e in pooled) < 3.0, pooled
    assert sum(e for _, e in pooled) <= sum(e for _, e in alone) + 0.5, (pooled, alone)


@pytest.mark.slow
async def test_a_trio_is_steered_as_before():
    # three containers: below `calm_pooled_at`, the same run tick for tick
    assert await ticks_and_errors(8, "1", 0) == await ticks_and_errors(10**6, "1", 0)
