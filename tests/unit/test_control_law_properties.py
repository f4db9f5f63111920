"""Properties of the control law over random ticks: whatever NVML and the containers report,
the law stays within its limits and its estimate stays sane."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.throttle.control import (
    FULL_SHARE,
    UNLIMITED_RATE,
    Claim,
    LoopState,
    Observation,
    allocate,
    control_step,
)
from vgpu_agent.throttle.fastlaw import _allocate as fast_allocate

TICK = 0.1

container = st.fixed_dictionaries({
    "limit": st.floats(1.0, 100.0),
    "policy": st.sampled_from(["strict", "work-conserving", "off"]),
    "priority": st.integers(0, 3),
    "spend": st.integers(0, 10**9),  # tokens a tick while busy
    "busy": st.floats(0.0, 1.0),  # fraction of ticks it spends
})
ticks = st.lists(
    st.tuples(
        st.lists(st.one_of(st.none(), st.floats(0.0, 100.0)), min_size=6, max_size=6),
        st.lists(st.floats(0.0, 0.2), min_size=6, max_size=6),
    ),
    min_size=5, max_size=20,
)


@settings(max_examples=40, deadline=None)
@given(st.lists(container, min_size=1, max_size=6), ticks, st.floats(0.05, 1.0))
def test_random_ticks_keep_rates_targets_and_estimates_sane(containers, steps, span):
    states: dict[str, LoopState] = {}
    rates = {f"c{i}": (UNLIMITED_RATE, UNLIMITED_RATE) for i in range(len(containers))}
    for n, (utils, waits) in enumerate(steps):
        observations = []
        for i, c in enumerate(containers):
            key = f"c{i}"
            busy = (n * 7 + i) % 10 < c["busy"] * 10
            rate, burst = rates[key]
            spent = c["spend"] if busy else 0
            if rate < UNLIMITED_RATE:
                spent = min(spent, round(rate * TICK))  # the bucket holds it back
            observations.append(Observation(
                key, c["limit"], c["policy"], c["priority"], spent=spent,
                launches=1 if spent else 0, waited_s=waits[i], util=utils[i], rate=rate,
                burst=burst, util_span_s=span,
            ))
        decisions = control_step(observations, states, TICK)
        states = {key: d.state for key, d in decisions.items()}
        for obs in observations:
            d = decisions[obs.key]
            rates[obs.key] = (d.rate, d.burst)
            assert 1 <= d.rate <= UNLIMITED_RATE and 1 <= d.burst <= UNLIMITED_RATE
            k = d.state.tokens_per_pct
            assert k >= 0 and math.isfinite(k) and math.isfinite(d.state.spread)
            assert d.state.noise >= 0
            if obs.policy == "off":
                assert (d.rate, d.burst) == (UNLIMITED_RATE, UNLIMITED_RATE)
            elif obs.policy == "strict":
                assert d.target <= obs.limit + 1e-6  # never promised more than its limit
            if obs.policy != "off" and k > 0 and d.rate < UNLIMITED_RATE:
                # the rate buys the target (less while a strict one is still learning), or is
                # the one in force, kept because the change would be too small to write (its
                # bucket kept too, or deepened for launches that outgrew it)
                bought = d.rate / k  # a rate is whole tokens: rounding may add half a token
                assert (bought <= d.target + 0.5 / k + 1e-9 or d.rate == 1  # the floor
                        or (d.rate == obs.rate and obs.burst <= d.burst <= max(obs.burst,
                                                                                d.rate)))
        limited = [decisions[o.key].target for o in observations if o.policy != "off"]
        assert sum(limited) <= FULL_SHARE * len(limited)


def test_a_loan_never_takes_a_target_past_the_capacity_it_was_cut_from():
    """2.67 % and a loan of the rest add up to a hair over 100 in floats: clamped."""
    alone = [Claim("a", 2.6694732712918654, "work-conserving", 0, True, 100.0)]
    shares = allocate(alone, FULL_SHARE)
    assert shares.target["a"] == FULL_SHARE
    assert fast_allocate(alone, FULL_SHARE)["a"] == FULL_SHARE
