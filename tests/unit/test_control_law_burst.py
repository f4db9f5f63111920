"""A bucket kept by the rate's deadband still grows with the container's launches.

A rate within the deadband of the one in force is not rewritten, and its burst was kept with
it. A container whose launches came to cost more than that burst (a phase of large grids) then
ran each launch into a debt its refill had to pay first: one lumpy launch per refill, reading
idle at its rate, and claims beyond what the audit lends (taken for a liar). On the simulated
GPU, with samples every second (sigma 8), a strict 40 % container whose launches came to
cost 1,000 times more read 3 % of the GPU 30 s later (`test_controller_large_launches.py`)."""

from __future__ import annotations

import pytest

from vgpu_agent.throttle.control import ControlParams, LoopState, Observation, control_step
from vgpu_agent.throttle.fastlaw import control_step_gpu
from vgpu_agent.throttle.nativelaw import control_step_native

LAWS = [control_step, control_step_gpu, control_step_native]


def settle(law, spent: int, launches: int) -> tuple[int, int, LoopState]:
    """A strict 40 % container spending `spent` tokens a tick in `launches` launches at 40 %
    use, until its rate stays put."""
    states: dict[str, LoopState] = {}
    rate = burst = 2**52
    for _ in range(60):
        obs = Observation("x", 40.0, "strict", spent=spent, launches=launches, util=40.0,
                          rate=rate, burst=burst)
        decision = law([obs], states, 0.1, ControlParams())["x"]
        states = {"x": decision.state}
        rate, burst = decision.rate, decision.burst
    return rate, burst, states["x"]


def after(law, limit: float, launches: int, params: ControlParams | None = None):
    """Settled at 100 launches a tick, then one tick of the same spending and use in
    `launches` launches under `limit`: (the rate and burst it had, the decision)."""
    rate, burst, state = settle(law, spent=10**6, launches=100)
    obs = Observation("x", limit, "strict", spent=10**6, launches=launches, util=40.0,
                      rate=rate, burst=burst)
    return rate, burst, law([obs], {"x": state}, 0.1, params or ControlParams())["x"]


@pytest.mark.parametrize("law", LAWS)
def test_launches_grown_past_the_burst_deepen_it_and_keep_the_rate(law):
    # the same spending and use in one launch a tick: 100 times the cost of a launch
    rate, burst, decision = after(law, 40.0, launches=1)
    assert burst < 10**6  # 10,000 tokens a launch: a fiftieth of a second of refill
    assert decision.rate == rate  # within the deadband: not rewritten
    assert decision.burst >= ControlParams().burst_launches * 10**6  # two of its launches


@pytest.mark.parametrize("law", LAWS)
def test_a_bucket_deep_enough_is_kept_as_it_is(law):
    rate, burst, decision = after(law, 40.0, launches=100)
    assert (decision.rate, decision.burst) == (rate, burst)


@pytest.mark.parametrize("law", LAWS)
def test_the_bucket_deepened_in_the_deadband_holds_at_most_a_second_of_refill(law):
    # launch counts and tokens are the container's word: a claim of one launch costing
    # everything it may spend would otherwise deepen the bucket, and with it what the audit
    # lends, without end
    params = ControlParams(burst_launches=1000.0)  # as if each launch cost 100 s of refill
    rate, _, decision = after(law, 40.0, launches=1, params=params)
    assert decision.rate == rate
    assert decision.burst == rate


@pytest.mark.parametrize("law", LAWS)
def test_a_bucket_written_with_a_new_rate_holds_at_most_a_second_of_refill(law):
    # the same bound where the rate changes (here its share halves): a container claiming one
    # launch of everything it spent may not deepen its bucket past a second of refill either
    rate, _, decision = after(law, 20.0, launches=1,
                              params=ControlParams(burst_launches=1000.0))
    assert decision.rate < 0.6 * rate  # written anew, not kept in the deadband
    assert decision.burst == decision.rate


@pytest.mark.parametrize("law", LAWS)
def test_a_new_rate_keeps_room_for_two_launches_below_a_second_of_refill(law):
    # ten launches a tick of 100,000 tokens each: two of them, a fifth of a second of refill
    rate, _, decision = after(law, 20.0, launches=10)
    assert decision.rate < 0.6 * rate
    assert 2 * 10**5 <= decision.burst < decision.rate
