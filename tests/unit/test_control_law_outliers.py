"""A reading far beyond NVML's noise: once it is an outlier (a sampled proportion of a small
share is skewed, and one reading of 26 % for a true 8 % once cut a container's rate threefold);
twice in a row the same way it is a changed workload, re-learned at once. The three laws agree."""

from __future__ import annotations

import math

import pytest

from tests.unit.test_control_fastlaw_agreement import assert_same, native
from vgpu_agent.throttle.control import ControlParams, LoopState, Observation, control_step
from vgpu_agent.throttle.fastlaw import control_step_gpu

TICK = 0.1
K = 20_000.0  # tokens/s that buy one percent
LAWS = [control_step, control_step_gpu, native]


def _settled(share: float) -> LoopState:
    """A container at `share` % whose k is well known, NVML's noise sigma 4 at 50 % (no pair
    of readings at one spending to learn more of it from)."""
    return LoopState(tokens_per_pct=K, spend_history=(share * K,) * 30, learned=40,
                     spread=0.003, noise=16.0, noise_pairs=40, target=share)


def _after(law, share: float, readings: list[float], state: LoopState | None = None
           ) -> LoopState:
    state = state or _settled(share)
    for util in readings:
        state = _read(law, state, util, ControlParams(), share=share)
    return state


@pytest.mark.parametrize("law", LAWS)
def test_one_reading_far_off_moves_k_little_and_the_next_ordinary_one_dismisses_it(law):
    state = _after(law, 8.0, [26.0])
    assert state.surprise == pytest.approx(18.0)
    assert 0.9 * K < state.tokens_per_pct < K  # it counts, no further out than the bound
    assert state.spread < 0.01  # not widened: the filter keeps what it knew
    calm = _after(law, 8.0, [8.0], state)
    assert calm.surprise == 0.0
    assert calm.tokens_per_pct == pytest.approx(state.tokens_per_pct, rel=0.02)


@pytest.mark.parametrize("law", LAWS)
def test_an_outlier_followed_by_an_ordinary_reading_the_same_way_is_relearned_from_the_latter(
        law):
    # off the same way, however little: taken as a change, but learned from the second
    # reading, not from the outlier
    state = _after(law, 8.0, [26.0, 8.6])
    assert state.surprise == 0.0
    assert state.tokens_per_pct == pytest.approx(K * 8.0 / 8.6, rel=0.05)


@pytest.mark.parametrize("law", LAWS)
def test_two_readings_far_off_the_same_way_are_a_changed_workload(law):
    # its tokens now buy three times the SM time: 24 % at the same spending, twice
    state = _after(law, 8.0, [24.0, 24.0])
    assert state.surprise == 0.0
    assert state.tokens_per_pct == pytest.approx(K / 3, rel=0.1)  # re-learned at once
    assert state.spread > 2 * _settled(8.0).spread  # and it listens to what comes next


@pytest.mark.parametrize("law", LAWS)
def test_readings_far_off_both_ways_are_outliers_both(law):
    high = _after(law, 30.0, [50.0])
    assert high.surprise > 0
    low = _after(law, 30.0, [8.0], high)
    assert low.surprise < 0  # the other way: an outlier of its own, not a confirmation
    assert low.spread < 0.01
    assert 0.85 * K < low.tokens_per_pct < 1.15 * K


@pytest.mark.parametrize("law", LAWS)
def test_an_infinite_k_is_still_restarted_by_a_reading(law):
    # nothing to protect: a model that predicts no use at all learns from the first reading
    state = _after(law, 8.0, [20.0], _settled(8.0)._replace(tokens_per_pct=math.inf))
    assert 0 < state.tokens_per_pct < math.inf
    assert state.surprise == 0.0


@pytest.mark.parametrize("law", LAWS)
def test_without_confirmation_a_reading_far_off_is_relearned_at_once(law):
    # the tuning for readings that are estimates, not samples (a time-sliced GPU's split)
    params = ControlParams(confirm_surprises=False)
    state = _settled(8.0)
    obs = [Observation("c", 50.0, "work-conserving", spent=int(8.0 * K * TICK), launches=10,
                       util=24.0, rate=int(8.0 * K), burst=int(8.0 * K))]
    decided = law(obs, {"c": state}, TICK, params)
    assert_same(decided, control_step(obs, {"c": state}, TICK, params))
    assert decided["c"].state.surprise == 0.0
    assert decided["c"].state.tokens_per_pct == pytest.approx(K / 3, rel=0.1)


def test_confirm_surprises_must_be_a_bool():
    with pytest.raises(ValueError, match="confirm_surprises"):
        ControlParams(confirm_surprises="yes")  # type: ignore[arg-type]


def _read(law, state: LoopState, util: float, params: ControlParams, span_s: float = 0.0,
          share: float = 8.0) -> LoopState:
    obs = [Observation("c", 50.0, "work-conserving", spent=int(share * K * TICK), launches=10,
                       util=util, rate=int(share * K), burst=int(share * K),
                       util_span_s=span_s)]
    decisions = law(obs, {"c": state}, TICK, params)
    assert_same(decisions, control_step(obs, {"c": state}, TICK, params))
    return decisions["c"].state


def _relearned(law, params: ControlParams, span_s: float) -> tuple[LoopState, float]:
    """The state re-learned at the second of two readings of 24 % (for a settled 8 %), and how
    far (0: not at all, 1: all the way) the reading after it (30 %) moves the predicted use
    towards itself."""
    state = _settled(8.0)
    for util in (24.0, 24.0):
        state = _read(law, state, util, params, span_s)
    assert state.surprise == 0.0 and state.tokens_per_pct == pytest.approx(K / 3, rel=0.05)
    before = 8.0 * K / state.tokens_per_pct
    after = 8.0 * K / _read(law, state, 30.0, params, span_s).tokens_per_pct
    return state, (after - before) / (30.0 - before)


@pytest.mark.parametrize("law", LAWS)
def test_a_reading_that_relearns_counts_as_part_of_one_where_samples_come_often(law):
    # picked for being far off, its noise likely is too: its estimate is left three times as
    # uncertain as one reading makes it, so the next reading moves k further
    state, moved = _relearned(law, ControlParams(), 1 / 6)
    full, moved_full = _relearned(law, ControlParams(relearn_weight=1.0), 1 / 6)
    assert state.spread == pytest.approx(3 * full.spread, rel=0.01)
    assert moved > 1.7 * moved_full > 0.4


@pytest.mark.parametrize("law", LAWS)
def test_a_reading_that_relearns_counts_as_one_where_samples_come_once_a_second(law):
    # there the readings after it are too few to average out what a third would make them
    # weigh; but it counts as one reading exactly: what was known of the old workload (the
    # prior the update would also keep) says nothing of the new one
    state, moved = _relearned(law, ControlParams(), 1.0)
    full, moved_full = _relearned(law, ControlParams(relearn_weight=1.0), 1.0)
    assert state.spread == full.spread and moved == moved_full
    third, _ = _relearned(law, ControlParams(relearn_span_s=2.0), 1.0)
    assert third.spread == pytest.approx(3 * state.spread, rel=1e-9)


@pytest.mark.parametrize("law", LAWS)
def test_a_split_estimate_that_relearns_counts_in_full(law):
    # a time-sliced GPU's split shares are estimates, re-learned at once, not picked samples
    spreads = []
    for weight in (1 / 3, 1.0):
        params = ControlParams(confirm_surprises=False, relearn_weight=weight)
        state = _read(law, _settled(8.0), 24.0, params, 1 / 6)
        assert state.tokens_per_pct == pytest.approx(K / 3, rel=0.05)
        spreads.append(state.spread)
    assert spreads[0] == spreads[1]


@pytest.mark.parametrize(("field", "value"), [("relearn_weight", 0.0), ("relearn_weight", 1.5),
                                              ("relearn_span_s", -0.1)])
def test_relearn_tuning_out_of_range_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        ControlParams(**{field: value})
