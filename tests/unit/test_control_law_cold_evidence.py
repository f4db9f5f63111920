"""What the law makes of thin evidence: a container's first NVML sample, several containers
starting at once with no sample yet, a sample that misses a container's processes, and noise
measured at one share and used at another."""

from __future__ import annotations

import pytest

from tests.unit.test_control_fastlaw_agreement import native
from vgpu_agent.throttle.control import (
    UNLIMITED_RATE,
    ControlParams,
    LoopState,
    Observation,
    _noise_shape,
    control_step,
)
from vgpu_agent.throttle.fastlaw import control_step_gpu

TICK = 0.1
K = 20_000.0  # tokens/s that buy one percent


def _run(ticks, law=control_step, params=None, states=None):
    """Feed (observations) per tick; returns the last decisions and the states."""
    states = dict(states or {})
    decisions = {}
    for observations in ticks:
        decisions = law(observations, states, TICK, params)
        states = {key: d.state for key, d in decisions.items()}
    return decisions, states


def _cold_start_at_one_sample_a_second(first_span_s: float):
    """A container alone at 25 % while unthrottled (its first two ticks: the first is only
    counted from), then at 20 % under a rate; NVML's first sample (every second) arrives at the
    tenth tick and describes the second before it: 0.2 s at 25 %, 0.8 s at 20 %."""
    ticks = []
    rate = UNLIMITED_RATE
    for tick in range(10):
        spend_rate = 0 if tick == 0 else (25 * K if rate == UNLIMITED_RATE else rate)
        util = 21.0 if tick == 9 else None
        ticks.append([Observation("c", 40, "work-conserving", spent=int(spend_rate * TICK),
                                  launches=10, util=util, rate=rate, burst=rate,
                                  util_span_s=first_span_s if util is not None else 0.0)])
        if tick >= 1:
            rate = int(20 * K)
    return ticks


def test_the_first_sample_is_learned_from_although_its_window_began_before_the_history():
    # The window (1 s, ending half a tick ago) reaches 0.15 s before the first counted tick:
    # that part is taken as the oldest tick's spending, and the sample is used.
    decisions, _ = _run(_cold_start_at_one_sample_a_second(1.0))
    state = decisions["c"].state
    assert state.learned == 1
    assert not state.lower_bound
    assert state.tokens_per_pct == pytest.approx(K, rel=0.1)


def test_a_window_mostly_before_the_history_still_says_nothing():
    ticks = _cold_start_at_one_sample_a_second(1.0)
    decisions, _ = _run(ticks, params=ControlParams(partial_window=0.1))
    assert decisions["c"].state.learned == 0
    assert decisions["c"].state.lower_bound


@pytest.mark.parametrize("law", [control_step, control_step_gpu])
def test_work_conserving_newcomers_start_from_an_equal_share(law):
    # Three new containers ran one tick unthrottled and spent alike, no sample yet. The bound
    # (each had at most 100 %) would give each a third of its target; they are given 1/3 each.
    first = [Observation(n, lim, "work-conserving") for n, lim in (("a", 20), ("b", 30),
                                                                    ("c", 50))]
    second = [Observation(n, lim, "work-conserving", spent=300_000, launches=10)
              for n, lim in (("a", 20), ("b", 30), ("c", 50))]
    decisions, _ = _run([first, second], law=law)
    for name in ("a", "b", "c"):
        state = decisions[name].state
        assert state.lower_bound and state.learned == 0
        # 3e6 tokens/s bought about a third of the GPU
        assert state.tokens_per_pct == pytest.approx(3e6 / (100 / 3))
        assert state.k_floor == pytest.approx(3e6 / 100)  # the proven bound is kept
    assert decisions["a"].rate == pytest.approx(3e6 / (100 / 3) * decisions["a"].target, rel=1e-6)


def test_a_strict_newcomer_keeps_the_bound_that_never_lets_it_above_its_limit():
    first = [Observation("s", 30, "strict"), Observation("w", 30, "work-conserving")]
    second = [Observation("s", 30, "strict", spent=300_000, launches=10),
              Observation("w", 30, "work-conserving", spent=300_000, launches=10)]
    decisions, _ = _run([first, second])
    assert decisions["s"].state.tokens_per_pct == pytest.approx(3e6 / 100)
    assert decisions["s"].rate == pytest.approx(3e6 * 30 / 100, rel=1e-6)
    assert decisions["w"].state.tokens_per_pct == pytest.approx(3e6 / 50)


def test_a_newcomer_is_guessed_at_what_the_known_containers_left():
    # "old" is known to use 60 % (1.2e6 tokens/s at k = 20_000); the newcomer had the rest.
    old = LoopState(tokens_per_pct=K, spend_history=(1.2e6,) * 5, learned=10, target=60.0)
    first = [Observation("old", 60, "work-conserving", spent=120_000, launches=10,
                         rate=1_200_000, burst=24_000),
             Observation("new", 40, "work-conserving")]
    second = [first[0], Observation("new", 40, "work-conserving", spent=100_000, launches=10)]
    decisions, _ = _run([first, second], states={"old": old})
    assert decisions["new"].state.tokens_per_pct == pytest.approx(1e6 / 40)


def test_a_newcomer_is_never_guessed_below_half_its_equal_part_of_those_spending():
    # The known container claims the whole GPU (its k is off): the newcomer is still taken to
    # have had half its equal part, not nothing (which would leave it unthrottled).
    old = LoopState(tokens_per_pct=K, spend_history=(2e6,) * 5, learned=10, target=60.0)
    first = [Observation("old", 60, "work-conserving", spent=200_000, launches=10,
                         rate=2_000_000, burst=40_000),
             Observation("new", 40, "work-conserving")]
    second = [first[0], Observation("new", 40, "work-conserving", spent=100_000, launches=10)]
    decisions, _ = _run([first, second], states={"old": old})
    assert decisions["new"].state.tokens_per_pct == pytest.approx(1e6 / 25)


def _learned(share: float) -> LoopState:
    spend = share * K
    return LoopState(tokens_per_pct=K, spend_history=(spend,) * 30, learned=20, spread=1e-4,
                     noise=9.0, noise_pairs=20, last_pair=(spend, share), target=share)


@pytest.mark.parametrize("law", [control_step, control_step_gpu])
def test_a_zero_reading_of_a_container_spending_for_30_percent_is_a_missed_sample(law):
    state = _learned(30.0)
    obs = Observation("c", 30, "strict", spent=int(30 * K * TICK), launches=10,
                      util=0.0, rate=int(30 * K), burst=int(30 * K))
    decision = law([obs], {"c": state}, TICK)["c"]
    assert decision.state.learned == state.learned
    assert decision.state.tokens_per_pct == state.tokens_per_pct
    assert decision.rate == int(30 * K)


def test_a_zero_reading_of_a_container_expected_at_2_percent_is_evidence():
    state = _learned(2.0)
    obs = Observation("c", 2, "strict", spent=int(2 * K * TICK), launches=10,
                      util=0.0, rate=int(2 * K), burst=int(2 * K))
    decision = control_step([obs], {"c": state}, TICK)["c"]
    assert decision.state.learned == state.learned + 1
    assert decision.state.tokens_per_pct > state.tokens_per_pct


def test_noise_is_a_sampled_proportions():
    assert _noise_shape(50, 0.2) == pytest.approx(1.0)
    assert _noise_shape(10, 0.2) == pytest.approx(0.36)
    assert _noise_shape(90, 0.2) == pytest.approx(0.36)
    assert _noise_shape(100, 0.2) == 0.2 == _noise_shape(0, 0.2)
    assert _noise_shape(250, 0.2) == 0.2 == _noise_shape(-5, 0.2)


def _noise_after(share: float, law=control_step, seen: float = 4.0) -> LoopState:
    """The state after a reading `seen` points off the last one, at the same spending."""
    state = _learned(share)._replace(noise=4.0, noise_pairs=0)
    obs = Observation("c", 100.0, "work-conserving", spent=int(share * K * TICK), launches=10,
                      util=min(100.0, share + seen), rate=int(share * K), burst=int(share * K))
    return law([obs], {"c": state}, TICK)["c"].state


def test_the_same_scatter_near_full_use_means_more_noise_at_50_percent():
    # Two readings in a row 4 points apart at the same spending: at 90 % use (where a sampled
    # proportion scatters less) that says more about the noise than at 50 %.
    assert _noise_after(90.0).noise > 2 * _noise_after(50.0).noise


@pytest.mark.parametrize("law", [control_step, control_step_gpu, native])
@pytest.mark.parametrize("share", [0.5, 3.0, 97.0, 100.0])
def test_pairs_where_the_shape_is_only_its_floor_teach_no_noise(law, share):
    # Near 0 or 100 % a sampled proportion barely scatters whatever the noise at 50 %: two equal
    # readings there are no evidence of a quiet NVML, and two readings apart are no measure.
    for seen in (0.0, 2.0):
        state = _noise_after(share, law, seen)
        assert state.noise == 4.0
        assert state.noise_pairs == 0


@pytest.mark.parametrize("law", [control_step, control_step_gpu, native])
def test_a_container_cut_from_full_use_to_30_percent_is_not_a_changed_workload(law):
    # Fifteen ticks at 100 % (a reading of 100 each), then its rate is cut to 30 % and the
    # first reading there is 21, 1.2 sigma low for NVML at sigma 8. Had the pairs at 100 %
    # taught a noise near zero, 21 would be a surprise and k would jump towards 30 / 21.
    params = ControlParams(nvml_period_s=1.0)
    state = _learned(100.0)._replace(noise=0.0, noise_pairs=0, learned=3, spread=0.01)
    states = {"c": state}
    full = Observation("c", 30.0, "work-conserving", spent=int(100 * K * TICK), launches=10,
                       util=100.0, util_span_s=1.0, rate=UNLIMITED_RATE, burst=UNLIMITED_RATE)
    for _ in range(15):
        states = {"c": law([full], states, TICK, params)["c"].state}
    assert states["c"].noise_pairs == 0
    cut = full._replace(spent=int(30 * K * TICK), util=None, rate=int(30 * K),
                        burst=int(30 * K))
    for _ in range(10):
        states = {"c": law([cut], states, TICK, params)["c"].state}
    before = states["c"].tokens_per_pct
    low = cut._replace(util=21.0)
    after = law([low], states, TICK, params)["c"].state.tokens_per_pct
    assert after < before * 1.15


@pytest.mark.parametrize("field", ["partial_window", "noise_tail", "floor_trust"])
def test_bad_new_params_are_refused(field):
    with pytest.raises(ValueError, match=field):
        ControlParams(**{field: -1.0})
    if field == "partial_window":
        with pytest.raises(ValueError, match=field):
            ControlParams(partial_window=1.0)


@pytest.mark.parametrize("law", [control_step, control_step_gpu])
def test_a_strict_containers_cold_margin_stops_at_the_proven_bound(law):
    # One uncertain measurement in (spread 0.5^2): the margin alone would cut the rate by a
    # third, below what the cold-start bound (it ran alone, unthrottled: 100 %) proves safe.
    floor = K  # the bound is exact here: it had the whole GPU
    state = LoopState(tokens_per_pct=1.05 * K, spend_history=(30 * K,) * 30, learned=1,
                      spread=0.25, k_floor=floor, target=30.0, last_pair=(30 * K, 29.0))
    obs = Observation("s", 30, "strict", spent=int(30 * K * TICK), launches=10,
                      rate=int(30 * K), burst=int(30 * K))
    decision = law([obs], {"s": state}, TICK)["s"]
    assert decision.rate == round(floor * 30)
    # without the bound the margin applies as before
    no_floor = law([obs], {"s": state._replace(k_floor=0.0)}, TICK)["s"]
    assert no_floor.rate < 0.8 * floor * 30


@pytest.mark.parametrize("law", [control_step, control_step_gpu, native])
def test_a_changed_workload_is_not_taken_for_noise(law):
    # At the same spending the reading jumps from 50 to 20: the application changed phase.
    # Counted as noise in full it would make the filter distrust the samples that re-learn k;
    # it counts at most as much as a difference at the surprise threshold.
    params = ControlParams()
    state = _learned(50.0)._replace(noise=4.0, noise_pairs=0)
    obs = Observation("c", 100.0, "work-conserving", spent=int(50 * K * TICK), launches=10,
                      util=20.0, rate=int(50 * K), burst=int(50 * K))
    after = law([obs], {"c": state}, TICK, params)["c"].state
    assert after.noise_pairs == 1
    weight = 0.5  # the first pair's
    assert after.noise == pytest.approx((1 - weight) * 4.0
                                        + weight * params.surprise_sigmas**2 * 4.0)
    # a difference within the noise is taken in full
    within = law([obs._replace(util=52.0)], {"c": state}, TICK, params)["c"].state
    assert within.noise == pytest.approx((1 - weight) * 4.0 + weight * 2.0**2 / 2)


@pytest.mark.parametrize("law", [control_step, control_step_gpu, native])
def test_a_cold_start_bound_a_little_high_binds_only_until_the_estimate_knows_better(law):
    # The unthrottled tick counted 4 % more than the container spent over it (a shim counts
    # in steps, and launches as it admits them, ahead of the GPU): its bound on k is 4 % high.
    # Readings every other tick at the strict 50 % container's true use, within the noise of
    # the bound's rate: kept for good, the bound held it at 52 %; once the estimate knows k
    # better than the bound does, k follows the readings.
    params = ControlParams()
    first = [Observation("s", 50.0, "strict")]
    ticks = [first, [Observation("s", 50.0, "strict", spent=int(1.04 * 100 * K * TICK),
                                 launches=10)]]
    decisions, states = _run(ticks, law=law)
    assert states["s"].k_floor == pytest.approx(1.04 * K)
    floors = []
    for tick in range(80):
        rate = decisions["s"].rate
        util = rate / K if tick % 2 else None  # its true use at the rate in force
        obs = Observation("s", 50.0, "strict", spent=int(rate * TICK), launches=10, util=util,
                          rate=rate, burst=decisions["s"].burst,
                          util_span_s=2 * TICK if util is not None else 0.0)
        decisions = law([obs], states, TICK, params)
        states = {key: d.state for key, d in decisions.items()}
        floors.append((states["s"].spread, states["s"].k_floor))
    assert states["s"].tokens_per_pct == pytest.approx(K, rel=0.01)
    assert decisions["s"].rate / K == pytest.approx(50, abs=0.6)
    # held while the estimate was less sure than the bound, dropped once it was surer
    assert floors[0][1] > 0
    assert all(floor == 0.0 for spread, floor in floors if spread <= params.floor_trust**2)
