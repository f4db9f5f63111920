"""Whatever a container makes the law learn, the rates and bursts it decides stay in bounds."""

from __future__ import annotations

import pytest

from vgpu_agent.shm import layout
from vgpu_agent.throttle.control import (
    UNLIMITED_RATE,
    ControlParams,
    LoopState,
    Observation,
    control_step,
)


def run(spent: int, util: float, launches: int = 1, ticks: int = 12,
        state: LoopState | None = None) -> list[tuple[int, int]]:
    states = {"x": state} if state is not None else {}
    out = []
    rate = burst = UNLIMITED_RATE
    for _ in range(ticks):
        obs = Observation("x", 30.0, "strict", spent=spent, launches=launches, util=util,
                          rate=rate, burst=burst)
        decision = control_step([obs], states, 0.1, ControlParams())["x"]
        states = {"x": decision.state}
        rate, burst = decision.rate, decision.burst
        out.append((rate, burst))
    return out


@pytest.mark.parametrize("spent,util", [
    (layout.PLAUSIBLE_COUNTER, 1.0),  # the largest spending a slot may report, at 1% use
    (layout.PLAUSIBLE_COUNTER, 3.0),
    (10**15, 4.0),
    (1, 100.0),
    (0, 0.0),
])
def test_rates_and_bursts_stay_within_documented_bounds(spent, util):
    for rate, burst in run(spent, util, launches=1):
        assert ControlParams().min_rate <= rate <= UNLIMITED_RATE
        assert 1 <= burst <= UNLIMITED_RATE


def test_a_model_that_is_not_finite_is_forgotten_not_applied():
    broken = LoopState(tokens_per_pct=float("inf"), learned=5)
    for rate, burst in run(0, 10.0, launches=0, ticks=1, state=broken):
        assert (rate, burst) == (UNLIMITED_RATE, UNLIMITED_RATE)  # no model: one free tick
    nan = LoopState(tokens_per_pct=float("nan"), learned=5)
    assert run(0, 10.0, launches=0, ticks=1, state=nan)[0][0] <= UNLIMITED_RATE
