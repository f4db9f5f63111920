"""The settling bound: what an estimator using every NVML sample as well as it can reaches."""

from __future__ import annotations

import math
import random
import statistics
import sys
from dataclasses import replace

import pytest

from vgpu_agent.simulation.bound import (
    BoundSpec,
    Learner,
    median_bound,
    reading_sd,
    settling_bound,
    steady_error_bound,
)
from vgpu_agent.simulation.imperfections import IDEAL, REAL

TEN = [Learner(9.875, 1 + i % 3) for i in range(10)]  # the bench's scenario 5


def noisy(sigma: float, attribution: str = "per-process"):
    return replace(REAL, nvml_sigma=sigma, nvml_attribution=attribution)


@pytest.mark.parametrize("percent", [5.0, 10.0, 30.0, 50.0, 90.0])
@pytest.mark.parametrize("sigma", [3.0, 8.0])
def test_the_spread_drawn_is_the_plants_own(percent, sigma):
    """The bound draws samples from a normal distribution; the plant counts the driver's
    instants. Their spreads agree (within the error of 4,000 draws of the plant)."""
    imp = noisy(sigma)
    rng = random.Random(7)
    readings = [imp.observe(percent, rng) for _ in range(4000)]
    expected = math.sqrt(reading_sd(percent, imp) ** 2 + 1 / 12)  # and the rounding
    assert statistics.pstdev(readings) == pytest.approx(expected, rel=0.08)
    assert statistics.mean(readings) == pytest.approx(percent, abs=0.4)


def test_the_spread_of_a_sampled_proportion_and_of_additive_noise():
    assert reading_sd(50.0, noisy(8.0)) == pytest.approx(8.0, rel=0.02)
    assert reading_sd(0.0, noisy(8.0)) == reading_sd(100.0, noisy(8.0)) == 0.0
    assert reading_sd(10.0, replace(noisy(8.0), nvml_noise="additive")) == 8.0
    assert reading_sd(10.0, IDEAL) == 0.0


def test_exact_samples_settle_ten_containers_as_soon_as_the_first_sample_acts():
    # first sample at 1/6 s, acting from the third tick; its window is whole at 0.7 s
    times = settling_bound(TEN, BoundSpec(IDEAL), runs=20)
    assert times == [pytest.approx(0.7)] * 20


def test_a_container_alone_is_known_from_its_unthrottled_tick_whatever_the_noise():
    for sigma, period in ((3.0, 1 / 6), (8.0, 1.0)):
        spec = BoundSpec(noisy(sigma), period, full=True)
        assert median_bound([Learner(30.0)], spec) == pytest.approx(0.6)
    # without a full GPU to tell it, the same container waits for its samples
    lonely = BoundSpec(noisy(8.0), 1.0, full=False)
    assert median_bound([Learner(30.0)], lonely) > 3.0


def test_containers_whose_workload_went_on_are_not_relearned():
    spec = BoundSpec(noisy(8.0), 1.0)
    assert median_bound([Learner(30.0, known=True), Learner(70.0, known=True)],
                        spec) == pytest.approx(0.5)
    # one new container beside a known one: the full GPU tells it
    assert median_bound([Learner(30.0, known=True), Learner(70.0)], spec) == pytest.approx(0.6)


def test_more_noise_and_rarer_samples_take_longer():
    figures = [median_bound(TEN, BoundSpec(noisy(s), p), runs=100)
               for s, p in ((3.0, 1 / 6), (8.0, 1 / 6), (3.0, 1.0), (8.0, 1.0))]
    s3_fast, s8_fast, s3_slow, s8_slow = figures
    assert s3_fast < s8_fast < s8_slow
    assert s3_fast < s3_slow < s8_slow
    # the bench's goals: 2 and 4 s at 6 Hz, 4 and 6 s at 1 Hz; the last is out of reach
    assert s3_fast < 2.0
    assert s8_slow > 6.0 * 2


def test_a_full_gpu_helps_a_few_containers_more_than_many():
    three = [Learner(20.0), Learner(30.0), Learner(50.0)]
    with_sum = median_bound(three, BoundSpec(noisy(8.0), 1.0, full=True), runs=100)
    without = median_bound(three, BoundSpec(noisy(8.0), 1.0, full=False), runs=100)
    assert with_sum < without


def test_a_time_sliced_gpu_tells_the_split_only_over_many_periods():
    pair = [Learner(40.0), Learner(60.0)]
    per_process = median_bound(pair, BoundSpec(noisy(3.0), 1 / 6), runs=100)
    sliced = median_bound(pair, BoundSpec(noisy(3.0, "time-sliced"), 1 / 6), runs=100)
    assert per_process < 1.0
    assert sliced > 10.0
    assert median_bound(TEN, BoundSpec(noisy(3.0, "time-sliced"), 1 / 6), runs=50) == math.inf
    # a single process gets samples of its own on such a GPU too
    assert median_bound([Learner(30.0)], BoundSpec(noisy(8.0, "time-sliced"), 1.0)) \
        == pytest.approx(0.6)


def test_the_same_seed_gives_the_same_figures_and_another_seed_others():
    spec = BoundSpec(noisy(8.0), 1 / 6)
    assert settling_bound(TEN, spec, runs=30, seed=3) == settling_bound(TEN, spec, runs=30,
                                                                         seed=3)
    assert settling_bound(TEN, spec, runs=30, seed=3) != settling_bound(TEN, spec, runs=30,
                                                                         seed=4)


@pytest.mark.parametrize("make, named", [
    (lambda: Learner(0.0), "Learner.share"),
    (lambda: Learner(101.0), "Learner.share"),
    (lambda: Learner(10.0, processes=0), "Learner.processes"),
    (lambda: BoundSpec(IDEAL, sample_period_s=0.0), "BoundSpec.sample_period_s"),
    (lambda: BoundSpec(IDEAL, hold_s=-1.0), "BoundSpec.hold_s"),
    (lambda: BoundSpec(IDEAL, window_s=0.05), "BoundSpec.window_s"),
    (lambda: settling_bound([Learner(10.0)], BoundSpec(IDEAL), runs=0), "runs"),
    (lambda: settling_bound([], BoundSpec(IDEAL)), "at least one container"),
    (lambda: steady_error_bound([([Learner(10.0)], BoundSpec(IDEAL))], runs=0), "runs"),
    (lambda: steady_error_bound([]), "at least one segment"),
])
def test_bad_input_is_refused_by_name(make, named):
    with pytest.raises(ValueError, match=named):
        make()


def _bench_throttle():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_throttle.py"
    spec = importlib.util.spec_from_file_location("bench_throttle_for_bound", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_bench_bounds_each_change_with_what_it_had_to_learn():
    bench = _bench_throttle()
    by_name = {sc.name.split()[0]: sc for sc in bench.scenarios(30.0)}
    s8_1hz = next(p for p in bench.PLANTS if p.name == "s8/1Hz").spec
    # alone, then a reclaim whose owner is the only new workload on a full GPU: both known
    # from the first tick
    assert bench.settling_bound(by_name["2"], s8_1hz, 0.1) == pytest.approx(0.6)
    assert bench.settling_bound(by_name["3"], s8_1hz, 0.1) == pytest.approx(0.6)
    # ten new containers at one sample a second: far beyond the goal of 6 s
    assert bench.settling_bound(by_name["5"], s8_1hz, 0.1) > 12.0
    # both phases change at once: the second change has two workloads to learn
    assert bench.settling_bound(by_name["6"], s8_1hz, 0.1) > 1.0


def test_without_a_full_gpus_sum_the_bench_bounds_settling_later_where_the_sum_tells_most():
    bench = _bench_throttle()
    by_name = {sc.name.split()[0]: sc for sc in bench.scenarios(30.0)}
    plants = {p.name: p.spec for p in bench.PLANTS}
    # a pair on a full GPU: the sum makes one share known from the other, about thrice as soon
    for plant in ("s8/6Hz", "s8/1Hz"):
        with_sum = bench.settling_bound(by_name["4"], plants[plant], 0.1)
        without = bench.settling_bound(by_name["4"], plants[plant], 0.1, use_sum=False)
        assert without > 2.5 * with_sum
    # the settling goals of those cells (4 s, 6 s) lie between the two
    assert bench.settling_bound(by_name["4"], plants["s8/6Hz"], 0.1) < 4.0 < \
        bench.settling_bound(by_name["4"], plants["s8/6Hz"], 0.1, use_sum=False)
    # a container alone on the GPU is known from its first tick either way
    assert bench.settling_bound(by_name["2"], plants["s8/1Hz"], 0.1, use_sum=False) == \
        pytest.approx(0.6)


def test_where_no_turn_fits_the_bench_bounds_time_sliced_cells_by_the_periods():
    bench = _bench_throttle()
    by_name = {sc.name.split()[0]: sc for sc in bench.scenarios(30.0)}
    plants = {p.name: p.spec for p in bench.PLANTS}
    # turns fit samples every 1/6 s: a figure measured alone tells more, nothing is bounded
    assert bench.periods_bound(by_name["6"], plants["s8/6Hz"], 0.1, runs=5) is None
    # one sample a second: the pair whose costs swap fourfold learns them from about one
    # period a second, no better than the peer model's 9.87 (far above half of it)
    assert bench.periods_bound(by_name["6"], plants["s8/1Hz"], 0.1, runs=30) > 7.0
    # a container alone is known from its first tick, periods or not
    assert bench.periods_bound(by_name["2"], plants["s8/1Hz"], 0.1, runs=5) == 0.0


PAIR = [Learner(40.0), Learner(60.0)]  # the bench's scenario 6 after its change


def test_exact_samples_leave_no_steady_error():
    assert steady_error_bound([(PAIR, BoundSpec(IDEAL, 1.0, horizon_s=15.0))]) == 0.0


def test_the_steady_error_is_that_of_the_mean_of_the_samples_so_far():
    # additive noise of sigma 8, one sample a second, no sum: from 5 s to 15 s after the
    # change, each container's error is the mean of n samples' (n = 4 to 14 in force), whose
    # mean absolute value is sigma * sqrt(2 / pi / n); rounding adds 1/12 point^2 a sample
    spec = BoundSpec(replace(noisy(8.0), nvml_noise="additive", missed_samples=0.0), 1.0,
                     full=False, horizon_s=15.0)
    # windows end at 5.5 ... 15.0 s; a sample acts from the tick after its period ends, so a
    # window ending at `end` is steered by floor(end - 0.5) samples throughout
    expected = statistics.mean(
        math.sqrt(2 / math.pi * (64 + 1 / 12) / math.floor(end - 0.5 + 1e-9))
        for end in [5.5 + 0.5 * w for w in range(20)])
    assert steady_error_bound([(PAIR, spec)], runs=400) == pytest.approx(expected, rel=0.1)


def test_a_full_gpus_sum_lowers_the_steady_error_and_known_containers_count_as_exact():
    noisy_spec = BoundSpec(noisy(8.0), 1.0, horizon_s=15.0)
    with_sum = steady_error_bound([(PAIR, noisy_spec)])
    without = steady_error_bound([(PAIR, replace(noisy_spec, full=False))])
    assert 0.5 < with_sum < 0.8 * without
    # one of the two known: only the other is learned, and its error counts once in two
    one_new = steady_error_bound([([Learner(40.0, known=True), Learner(60.0)],
                                   replace(noisy_spec, full=False))])
    assert one_new < 0.7 * without


def test_a_window_before_the_first_sample_counts_as_wholly_wrong():
    # steady state from 0.5 s: the first windows come before any sample acts
    spec = BoundSpec(IDEAL, 1.0, horizon_s=3.0)
    early = steady_error_bound([(PAIR, spec)], from_s=0.0)
    assert early == pytest.approx(100.0 * 2 / 6)  # windows ending 0.5, 1.0 of six
    assert steady_error_bound([(PAIR, spec)], from_s=1.5) == 0.0


def test_the_bench_prints_the_steady_bounds_of_its_cells():
    bench = _bench_throttle()
    by_name = {sc.name.split()[0]: sc for sc in bench.scenarios(30.0)}
    s8_1hz = next(p for p in bench.PLANTS if p.name == "s8/1Hz").spec
    with_sum, alone = bench.steady_bounds(by_name["6"], s8_1hz, 0.1)
    assert 0.5 < with_sum < alone < 3.0


def test_the_bench_measures_the_laws_settling_with_exact_readings_on_the_same_plant():
    import asyncio
    from argparse import Namespace
    from dataclasses import replace

    from vgpu_agent.simulation.runner import evaluate, run_controlled

    bench = _bench_throttle()
    ten = next(sc for sc in bench.scenarios(15.0) if sc.name.startswith("5"))
    plant = replace(next(p for p in bench.PLANTS if p.name == "s8/1Hz").spec, seed=0)
    args = Namespace(paced=True, tick=0.1, nvml_poll_periods=1)
    exact = bench.exact_settling(ten, plant, range(1), args)
    # the same run with the plant's noise: ten containers at sigma 8 do not settle in 15 s
    noisy = evaluate(asyncio.run(run_controlled(bench.attainable(ten, plant), plant=plant,
                                                paced=True)))
    assert noisy.worst_settling_s > 10.0
    # noise off, the plant's rounding, queues and lumpy spending kept: seconds, not never
    assert 1.0 < exact < 5.0
