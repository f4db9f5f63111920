"""A GPU that only looks to have room lends nothing.

Three work-conserving containers of one GPU, 20/30/50 %: the 50 % one spends two thirds of its
rate and waits for none of it, the others spend their whole rates. From spending over `k` the
GPU is 88 % in use: room to lend, if `k` is right. Where `k` was learned from a few noisy
samples it may be a sixth high, and a GPU that is full in fact is then oversubscribed by the
loan, which squeezes the lender below its rate and so confirms the loan (simulated: the 50 %
container held at 39 % for 20 s). The law lends only where the room is beyond
`saturation_sigmas` deviations of its estimates."""

from __future__ import annotations

import math

import pytest

from vgpu_agent.throttle.control import ControlParams, LoopState, Observation, control_step
from vgpu_agent.throttle.fastlaw import control_step_gpu
from vgpu_agent.throttle.nativelaw import control_step_native

LAWS = [control_step, control_step_gpu, control_step_native]
K = 1e6  # tokens a second for one percent
DT = 0.1
LIMITS = {"a": 20.0, "b": 30.0, "c": 50.0}
# percent each spent over the last ticks, and the rates in force (a on a loan already)
USE = {"a": 25.0, "b": 30.0, "c": 33.0}
IN_FORCE = {"a": 25.0, "b": 30.0, "c": 50.0}


def step(law, spread: float, params: ControlParams) -> dict[str, float]:
    states, observations = {}, []
    for key, limit in LIMITS.items():
        spend = K * USE[key]
        states[key] = LoopState(tokens_per_pct=K, spend_history=(spend,) * 5, spread=spread,
                                noise=36.0, noise_pairs=20, util=USE[key], target=limit,
                                learned=40, hungry=key != "c", tick_lengths=(DT,) * 5)
        rate = int(K * IN_FORCE[key])
        observations.append(Observation(
            key, limit, "work-conserving", spent=int(spend * DT), launches=1000,
            waited_s=0.01 if key != "c" else 0.0, rate=rate, burst=rate // 50))
    decisions = law(observations, states, DT, params)
    return {key: d.target for key, d in decisions.items()}


@pytest.mark.parametrize("law", LAWS)
def test_estimates_too_loose_to_show_room_lend_nothing(law):
    # relative deviation of k 6 %: 88 % in use, and three deviations of that (3.1 points
    # each) past 95 %
    targets = step(law, 0.06**2, ControlParams())
    assert targets == pytest.approx(LIMITS)


@pytest.mark.parametrize("law", LAWS)
def test_the_same_spending_lends_where_the_estimates_are_sure(law):
    targets = step(law, 0.001**2, ControlParams())
    assert targets["c"] == pytest.approx(50.0)  # its guarantee is kept for it
    # c uses 33 of its 50 (and the demand margin): the rest goes to a and b by their limits
    lent = targets["a"] - 20.0
    assert lent > 4.0 and targets["b"] - 30.0 == pytest.approx(1.5 * lent)


@pytest.mark.parametrize("law", LAWS)
def test_counting_no_deviations_is_the_estimates_taken_at_their_word(law):
    loose = step(law, 0.06**2, ControlParams(saturation_sigmas=0.0))
    sure = step(law, 0.001**2, ControlParams())
    assert loose == pytest.approx(sure)


@pytest.mark.parametrize("law", LAWS)
def test_a_gpu_full_by_its_estimates_lends_nothing_however_sure(law):
    for spread in (0.0, 0.001**2, 0.06**2):
        params = ControlParams(saturation_margin=20.0)  # 88 % is within 20 of full
        assert step(law, spread, params) == pytest.approx(LIMITS)


def test_a_negative_deviation_count_is_refused_by_name():
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="saturation_sigmas"):
            ControlParams(saturation_sigmas=bad)
    assert math.isfinite(ControlParams().saturation_sigmas)
