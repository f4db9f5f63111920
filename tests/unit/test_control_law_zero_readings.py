"""Readings of 0 % where the law expected several percent.

One far off is a sample NVML missed (its processes absent from the batch) and teaches nothing;
one that noise reaches, once the estimate is close, is a reading like any other. Two far off in a
row, from a container measured before, bound its use: its tokens came to buy next to nothing,
and `k` rises to at least its spending over the resolution. A container never measured (its
processes not yet placed) learns nothing from them."""

from __future__ import annotations

import pytest

from vgpu_agent.throttle.control import ControlParams, LoopState, Observation, control_step
from vgpu_agent.throttle.fastlaw import control_step_gpu
from vgpu_agent.throttle.nativelaw import control_step_native

LAWS = [control_step, control_step_gpu, control_step_native]
SPENT = 10**6  # tokens a tick, 0.1 s: 10 million a second


def tick(law, state: LoopState | None, util: float | None, rate: int, burst: int):
    obs = Observation("x", 40.0, "strict", spent=SPENT, launches=100, util=util,
                      rate=rate, burst=burst)
    decision = law([obs], {"x": state} if state else {}, 0.1, ControlParams())["x"]
    return decision.state, decision.rate, decision.burst


def settled(law) -> tuple[LoopState, int, int]:
    """A strict 40 % container spending 10 million tokens a second at 40 % use."""
    state, rate, burst = None, 2**52, 2**52
    for _ in range(60):
        state, rate, burst = tick(law, state, 40.0, rate, burst)
    return state, rate, burst


@pytest.mark.parametrize("law", LAWS)
def test_one_zero_is_a_missed_sample(law):
    state, rate, burst = settled(law)
    after, new_rate, _ = tick(law, state, 0.0, rate, burst)
    assert new_rate == rate
    assert after.tokens_per_pct == pytest.approx(state.tokens_per_pct, rel=0.01)


@pytest.mark.parametrize("law", LAWS)
def test_two_zeros_in_a_row_raise_k_to_what_they_bound(law):
    state, rate, burst = settled(law)
    state, rate, burst = tick(law, state, 0.0, rate, burst)
    after, new_rate, _ = tick(law, state, 0.0, rate, burst)
    # 10 million tokens a second for at most 1 %: k at least 10 million, 40 times what it was
    assert after.tokens_per_pct >= SPENT / 0.1 / ControlParams().resolution * 0.99
    assert new_rate >= 30 * rate
    assert after.k_floor == 0.0


@pytest.mark.parametrize("law", LAWS)
def test_zeros_go_on_raising_k_while_the_estimate_is_too_loose_to_learn_from_them(law):
    # Its tokens came to buy next to nothing (a launch now 2.5 s of refill, its processes
    # running one each after their longest wait, so it spends about its rate whatever it is):
    # a raise bounds k by the spending it saw, which says little, and leaves the estimate
    # loose. Before, every zero after that was set aside (noise reaches a zero from a loose
    # estimate) and k stayed a thousand times low; now zeros in pairs raise it again.
    state, rate, burst = settled(law)
    k0 = state.tokens_per_pct
    raises = 0
    for _ in range(6):
        spent = max(1, rate // 10)  # a tick's refill: what it spends, at any rate
        for util in (0.0, 0.0):
            obs = Observation("x", 40.0, "strict", spent=spent, launches=1, util=util,
                              rate=rate, burst=burst)
            d = law([obs], {"x": state}, 0.1, ControlParams())["x"]
            raises += d.state.tokens_per_pct > state.tokens_per_pct
            state, rate, burst = d.state, d.rate, d.burst
    assert raises >= 5  # a raise for every pair of zeros but the first's first
    assert state.tokens_per_pct > 1000 * k0


@pytest.mark.parametrize("law", LAWS)
def test_zeros_apart_teach_nothing_new(law):
    state, rate, burst = settled(law)
    k = state.tokens_per_pct
    for util in (0.0, 40.0, 0.0, 40.0, 0.0):
        state, rate, burst = tick(law, state, util, rate, burst)
    assert state.tokens_per_pct == pytest.approx(k, rel=0.1)


@pytest.mark.parametrize("law", LAWS)
def test_a_container_never_measured_learns_nothing_from_zeros(law):
    # its first tick unthrottled gives the cold-start bound; its processes not placed yet, NVML
    # shows it at 0: no reading of it has taught anything, so zeros bound nothing
    state, rate, burst = tick(law, None, None, 2**52, 2**52)
    state, rate, burst = tick(law, state, None, rate, burst)
    first = rate
    for _ in range(5):
        state, rate, burst = tick(law, state, 0.0, rate, burst)
    assert state.learned == 0
    assert rate == first


@pytest.mark.parametrize("law", LAWS)
def test_zeros_within_reach_of_the_noise_teach_nothing(law):
    # at 10 % with readings scattered by 8 points, noise alone reads 0 twice in a row now and
    # then: that is no bound
    def at_ten(state, util, rate, burst):
        obs = Observation("x", 10.0, "strict", spent=SPENT, launches=100, util=util,
                          rate=rate, burst=burst)
        d = law([obs], {"x": state} if state else {}, 0.1, ControlParams())["x"]
        return d.state, d.rate, d.burst

    state, rate, burst = None, 2**52, 2**52
    for n in range(200):
        state, rate, burst = at_ten(state, (2.0, 18.0)[n % 2], rate, burst)
    before = rate
    for _ in range(2):
        state, rate, burst = at_ten(state, 0.0, rate, burst)
    assert rate < 2 * before


@pytest.mark.parametrize("law", LAWS)
def test_a_container_waking_from_idle_reads_zero_once_and_keeps_its_k(law):
    # It goes idle: its last spending still in the reading's window, which reads 0 (set aside,
    # kept as a surprise). Idle for 3 s (readings of 0 at no spending), it wakes: the first
    # reading is of the time before it woke. Two zeros while spending, but seconds apart.
    state, rate, burst = settled(law)

    def idle(state, rate, burst, spent, util):
        obs = Observation("x", 40.0, "strict", spent=spent, launches=spent // 10**4,
                          util=util, rate=rate, burst=burst)
        d = law([obs], {"x": state}, 0.1, ControlParams())["x"]
        return d.state, d.rate, d.burst

    state, rate, burst = idle(state, rate, burst, SPENT // 2, 0.0)
    assert state.surprise < 0
    state, rate, burst = idle(state, rate, burst, 0, None)  # no sample this tick
    for _ in range(30):  # samples every other tick, of no use at no spending
        state, rate, burst = idle(state, rate, burst, 0, 0.0)
        state, rate, burst = idle(state, rate, burst, 0, None)
    k = state.tokens_per_pct
    state, rate, burst = tick(law, state, 0.0, rate, burst)
    assert state.tokens_per_pct == k  # not raised: the zero before it is seconds old


@pytest.mark.parametrize("law", LAWS)
def test_a_container_spending_in_lumps_reads_zero_between_and_still_makes_a_pair(law):
    # One dear launch every few ticks (a shim that waited as long as it ever waits): readings of
    # 0 over its launches, and over the quiet ticks between them. The quiet ticks are not idle
    # (it spent within the history): they keep the first zero for the next to confirm.
    state, rate, burst = settled(law)
    k = state.tokens_per_pct

    def step(state, rate, burst, spent, util):
        obs = Observation("x", 40.0, "strict", spent=spent, launches=1 if spent else 0,
                          util=util, rate=rate, burst=burst)
        d = law([obs], {"x": state}, 0.1, ControlParams())["x"]
        return d.state, d.rate, d.burst

    for _ in range(2):
        state, rate, burst = step(state, rate, burst, 5 * SPENT, None)  # the launch
        state, rate, burst = step(state, rate, burst, 0, 0.0)  # its window: 0
        state, rate, burst = step(state, rate, burst, 0, None)
        state, rate, burst = step(state, rate, burst, 0, None)
        state, rate, burst = step(state, rate, burst, 0, 0.0)  # a quiet window: 0
    assert state.tokens_per_pct > 10 * k



@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("seed", range(4))
def test_zeros_that_noise_reaches_count_once_the_estimate_is_close(law, seed):
    # Three processes at 1.3 % each, read as the simulated GPU reads them at sigma 8 (the share
    # of 39 instants busy, in whole percent): their sum reads 0 about one sample in six.
    # Dropping every zero read the container busier than it was: k at 0.69-0.72 of the truth
    # in these runs, its rate as low. Once the estimate is close, a zero that noise reaches
    # is a reading like any other. (The rest of the shortfall, 0.84-0.88 here, is in the
    # readings: they average 4.4-4.7 for a true 4, each process's steps of 2.56 % rounded to
    # whole percents, so 0.86-0.90 is all they allow.)
    import random
    from dataclasses import replace

    from vgpu_agent.simulation.imperfections import REAL

    plant, rng = replace(REAL, nvml_sigma=8.0), random.Random(seed)
    state, rate, burst = None, 2**52, 2**52
    for _ in range(300):
        util = float(sum(plant.observe(4.0 / 3, rng) for _ in range(3)))
        obs = Observation("x", 10.0, "strict", spent=SPENT, launches=100, util=util,
                          rate=rate, burst=burst)
        decision = law([obs], {"x": state} if state else {}, 0.1, ControlParams())["x"]
        state, rate, burst = decision.state, decision.rate, decision.burst
    true_k = SPENT / 0.1 / 4.0  # tokens a second for one percent
    assert 0.8 * true_k <= state.tokens_per_pct <= 1.2 * true_k
