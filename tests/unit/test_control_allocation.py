"""How the control law divides a GPU: guarantees, priorities, lending, strict caps, bad input."""

from __future__ import annotations

import pytest

from vgpu_agent.throttle.control import (
    UNLIMITED_RATE,
    Claim,
    ControlParams,
    LoopState,
    Observation,
    allocate,
    control_step,
)

INF = float("inf")


def claim(key, limit, policy="work-conserving", priority=0, hungry=True, demand=INF):
    return Claim(key, limit, policy, priority, hungry, demand)


def test_all_busy_get_their_limits():
    shares = allocate([claim("a", 20), claim("b", 30), claim("c", 50)])
    assert shares.target == pytest.approx({"a": 20, "b": 30, "c": 50})


def test_oversubscribed_higher_priority_is_met_first():
    shares = allocate([
        claim("low1", 60, priority=0),
        claim("high", 70, priority=5),
        claim("low2", 20, priority=0),
    ])
    assert shares.target["high"] == pytest.approx(70)
    # The 30 points left are split in proportion to the limits of the lower level.
    assert shares.target["low1"] == pytest.approx(22.5)
    assert shares.target["low2"] == pytest.approx(7.5)


def test_idle_capacity_is_lent_to_busy_work_conserving_containers_by_limit():
    shares = allocate([
        claim("a", 20),
        claim("b", 40),
        claim("idle", 40, hungry=False, demand=4),
    ])
    # 100 - 20 - 40 - 4 = 36 spare, lent 1:2.
    assert shares.target["a"] == pytest.approx(32)
    assert shares.target["b"] == pytest.approx(64)
    # The idle owner keeps a rate for its whole guarantee, so it can take it back at once.
    assert shares.target["idle"] == pytest.approx(40)
    assert shares.guarantee["idle"] == pytest.approx(40)


def test_strict_is_never_lent_more_than_its_limit():
    shares = allocate([
        claim("strict", 30, policy="strict"),
        claim("idle", 70, hungry=False, demand=3),
    ])
    assert shares.target["strict"] == pytest.approx(30)


def test_work_conserving_alone_gets_the_whole_gpu_but_strict_alone_does_not():
    assert allocate([claim("wc", 30)]).target["wc"] == pytest.approx(100)
    assert allocate([claim("s", 30, policy="strict")]).target["s"] == pytest.approx(30)


def test_borrower_that_uses_less_than_offered_is_capped_at_its_demand():
    shares = allocate([claim("a", 30, hungry=False, demand=55), claim("b", 70, hungry=False,
                                                                      demand=3)])
    assert shares.target["a"] == pytest.approx(55)


def test_off_containers_are_left_out_and_capacity_is_what_they_leave():
    shares = allocate([claim("off", 50, policy="off"), claim("a", 50)], capacity=60)
    assert "off" not in shares.target
    assert shares.target["a"] == pytest.approx(60)


def test_waking_owner_takes_its_loan_back_in_the_same_allocation():
    before = allocate([claim("borrower", 30), claim("owner", 70, hungry=False, demand=3)])
    after = allocate([claim("borrower", 30), claim("owner", 70)])
    assert before.target["borrower"] == pytest.approx(97)
    assert after.target == pytest.approx({"borrower": 30, "owner": 70})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"limit": 0}, "core limit"),
        ({"limit": 150}, "core limit"),
        ({"policy": "fair"}, "core policy"),
        ({"spent": -1}, "negative"),
        ({"waited_s": -0.5}, "negative"),
    ],
)
def test_bad_observations_are_refused_with_the_bad_value(kwargs, message):
    base = {"key": "x", "limit": 30.0, "policy": "strict"}
    with pytest.raises(ValueError, match=message):
        Observation(**{**base, **kwargs})


def test_bad_tick_and_duplicate_keys_are_refused():
    obs = Observation("x", 30, "strict")
    with pytest.raises(ValueError, match="tick length"):
        control_step([obs], {}, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        control_step([obs, obs], {}, 0.1)


@pytest.mark.parametrize("field", ["nvml_period_s", "noise_memory", "history_s", "burst_s"])
def test_bad_params_are_refused(field):
    with pytest.raises(ValueError, match=field):
        ControlParams(**{field: 0})


def test_off_gets_an_unlimited_rate_and_unknown_container_runs_one_tick_free():
    out = control_step(
        [Observation("off", 50, "off"), Observation("new", 30, "strict")], {}, 0.1
    )
    assert out["off"].rate == UNLIMITED_RATE
    assert out["new"].rate == UNLIMITED_RATE


def test_cold_start_bound_never_exceeds_the_limit():
    # Unthrottled for a tick it spent 1e6 tokens/s; whatever its share was (<= 100%), a rate of
    # spend * limit / 100 cannot buy more than the limit.
    first = control_step([Observation("c", 30, "strict", spent=100_000, launches=10)], {}, 0.1)
    state = first["c"].state
    assert state.lower_bound
    assert first["c"].rate == pytest.approx(1e6 * 30 / 100, rel=1e-6)


def test_a_rate_already_in_force_is_kept_until_learned():
    # After an agent restart the region still holds the previous agent's rate.
    out = control_step(
        [Observation("c", 30, "strict", spent=0, rate=123_456, burst=7_890)], {}, 0.1
    )
    assert (out["c"].rate, out["c"].burst) == (123_456, 7_890)


def test_learns_tokens_per_percent_from_a_held_rate():
    states: dict[str, LoopState] = {}
    rate = 400_000  # tokens/s; at k = 20_000 tokens/s per percent that buys 20%
    decision = None
    for tick in range(8):
        util = 20.0 if tick >= 2 else None
        obs = Observation("c", 30, "strict", spent=rate // 10, launches=4, waited_s=0.05,
                          util=util, rate=rate, burst=rate // 50)
        decision = control_step([obs], states, 0.1)["c"]
        states = {"c": decision.state}
    assert decision is not None
    assert decision.state.tokens_per_pct == pytest.approx(20_000, rel=0.01)
    assert decision.rate == pytest.approx(20_000 * 30, rel=0.01)
    # The burst covers at least two of its launches (100_000 tokens each here).
    assert decision.burst >= 2 * 10_000
