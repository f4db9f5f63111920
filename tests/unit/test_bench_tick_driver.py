"""`bench_tick.py`'s time-sliced driver gives a sample period only to a process whose container
spent since the last one: a container paused for another's turn alone must not be seen running,
or no turn there ever gives a figure and the bench measures a crowd no real node has."""

from __future__ import annotations

from tests.bench.bench_tick import sliced_period
from vgpu_agent.gpu.model import ProcessSample


def own(*utils: int, at_us: int = 0) -> list[ProcessSample]:
    return [ProcessSample(100 + n, at_us, util) for n, util in enumerate(utils)]


def test_a_paused_container_is_never_given_a_period():
    samples = own(5, 10, 20)
    given = set()
    for period in range(30):
        now_us = period * 166_000
        # the middle container spent nothing since the last sample: paused
        found = sliced_period(samples, [50, 7, 90], [40, 7, 80], now_us)
        assert len(found) == 1
        given.add(found[0].pid)
        assert found[0].timestamp_us == now_us
        assert found[0].sm_util == 25  # the whole GPU's use: the two running, summed
    assert given == {100, 102}


def test_every_spending_container_gets_periods_in_turn_and_the_use_is_capped():
    samples = own(60, 70)
    owners = [sliced_period(samples, [2, 2], [1, 1], p * 166_000)[0] for p in range(4)]
    assert [s.pid for s in owners] == [100, 101, 100, 101]
    assert {s.sm_util for s in owners} == {100}


def test_with_nobody_spending_every_process_reads_idle():
    samples = own(5, 10)
    found = sliced_period(samples, [3, 4], [3, 4], 1_000)
    assert [(s.pid, s.timestamp_us, s.sm_util) for s in found] == [(100, 1_000, 0),
                                                                    (101, 1_000, 0)]
