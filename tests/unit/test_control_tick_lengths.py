"""The spending history keeps how long each tick lasted: the agent's tick slows while all is
calm and speeds up on a change, and a measurement that arrives right after the change describes
the slow ticks before it."""

from __future__ import annotations

import pytest

from vgpu_agent.throttle.control import (
    ControlParams,
    LoopState,
    Observation,
    control_step,
    span_weights,
    tick_lengths,
    window_lengths,
)
from vgpu_agent.throttle.fastlaw import control_step_gpu

K = 1e5  # tokens/s per percent


def test_equal_ticks_are_weighted_as_before():
    """Ticks of one length: the window (one NVML period ending half a tick ago) covers the same
    fractions of the same ticks as the equal-tick rule did."""
    weights = span_weights(1 / 6, (0.1,) * 6)
    assert weights == pytest.approx((0.0, 0.0, 0.0, 0.1, 0.6, 0.3))
    assert sum(weights) == pytest.approx(1.0)


def test_a_window_after_slow_ticks_lies_on_the_time_they_covered():
    # four ticks of 0.4 s, then the first fast one: a 1 s window ending 0.05 s ago
    weights = span_weights(1.0, (0.4, 0.4, 0.4, 0.4, 0.1))
    assert weights == pytest.approx((0.0, 0.15, 0.4, 0.4, 0.05))
    # ticks taken as 0.1 s each would leave most of that window before the history
    assert sum(span_weights(1.0, (0.1,) * 5)) == pytest.approx(0.45)


def test_lengths_follow_the_history_and_fill_in_what_a_state_lacks():
    assert tick_lengths(LoopState(), 0.1, 26) == (0.1,)  # no history yet: this tick's
    kept = LoopState(spend_history=(1.0, 2.0, 3.0), tick_lengths=(0.4,))
    assert tick_lengths(kept, 0.1, 26) == (0.1, 0.1, 0.4, 0.1)  # the unknown as this tick
    full = LoopState(spend_history=(1.0,) * 4, tick_lengths=(0.4,) * 4)
    assert tick_lengths(full, 1.0, 4) == (0.4, 0.4, 0.4, 1.0)  # as long as the history
    assert window_lengths((0.4, 0.1), 0.1, 4) == (0.1, 0.1, 0.4, 0.1)


@pytest.mark.parametrize("law", [control_step, control_step_gpu])
def test_a_once_a_second_sample_after_slow_ticks_is_learned_from(law):
    """Settled at 0.4 s ticks, then a change brings the tick back to 0.1 s: the next 1 s
    sample lies on the slow ticks, which the history now places, and moves k; placed on
    ticks taken as 0.1 s each it would reach past the history and be thrown away."""
    history = (2e6,) * 5
    base = dict(tokens_per_pct=K, spend_history=history, learned=10, spread=1e-3,
                noise=4.0, target=30.0, last_pair=(2e6, 20.0))
    observation = Observation("a", 30.0, "strict", spent=200_000, util=30.0,
                              rate=3_000_000, burst=30_000, util_span_s=1.0)
    params = ControlParams()
    timed = law([observation], {"a": LoopState(**base, tick_lengths=(0.4,) * 5)}, 0.1, params)
    untimed = law([observation], {"a": LoopState(**base)}, 0.1, params)
    assert timed["a"].state.learned == 11 and timed["a"].state.tokens_per_pct < K
    assert untimed["a"].state.learned == 10 and untimed["a"].state.tokens_per_pct == K
    assert timed["a"].state.tick_lengths == (0.4,) * 5 + (0.1,)
