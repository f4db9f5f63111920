"""The imperfect simulated GPU, one effect at a time: each switched on alone against the ideal."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from vgpu_agent.simulation.gpu import SimGpu, Workload
from vgpu_agent.simulation.imperfections import H200_TIME_SLICED, IDEAL, REAL, Imperfections
from vgpu_agent.simulation.region import SimRegion

UUID = "GPU-imperfect"
# 1024 x 256 tokens a launch of 2 ms: 26.2144e6 tokens/s buys 100 launches/s = 20% of the GPU
LAUNCH = Workload(kernel_s=0.002)
TWENTY_PERCENT = (26_214_400, 2 * 262_144)


def gpu_with(**effects: object) -> SimGpu:
    return SimGpu(UUID, imperfections=replace(IDEAL, **effects))  # type: ignore[arg-type]


def region(name: str = "r", rate: tuple[int, int] = (0, 0)) -> SimRegion:
    r = SimRegion(name, (UUID,), (50.0,), ("strict",))
    r.rates[0] = rate
    return r


def test_the_default_plant_is_the_imperfect_one():
    assert SimGpu(UUID).imperfections == REAL
    assert REAL.nvml_sigma > 0 and REAL.kernel_jitter > 0 and REAL.sm_count > 0


@pytest.mark.parametrize(
    ("model", "spread_at_twenty"),
    [("additive", 5.0), ("sampled", 5.0 * (0.2 * 0.8) ** 0.5 / 0.5)],
)
def test_nvml_noise_scatters_samples_around_the_true_use(model, spread_at_twenty):
    gpu = gpu_with(nvml_sigma=5.0, nvml_noise=model)
    p = gpu.shim_process("p", LAUNCH, region(rate=TWENTY_PERCENT))
    gpu.advance(40)
    values = [s.sm_util for s in gpu.process_utilization(0) if s.pid == p.pid]
    assert all(isinstance(v, int) and 0 <= v <= 100 for v in values)
    assert statistics.mean(values) == pytest.approx(20, abs=1)
    assert statistics.stdev(values) == pytest.approx(spread_at_twenty, rel=0.25)
    # ground truth is untouched by the noise
    assert gpu.shares(p, 10)[-1][1] == pytest.approx(20, abs=0.5)


def test_sampled_noise_is_unbiased_near_zero_where_additive_noise_is_clipped():
    rng = random.Random(3)
    sampled = Imperfections(nvml_sigma=8.0)
    additive = Imperfections(nvml_sigma=8.0, nvml_noise="additive")
    near_zero = [sampled.observe(3.0, rng) for _ in range(4000)]
    clipped = [additive.observe(3.0, rng) for _ in range(4000)]
    assert statistics.mean(near_zero) == pytest.approx(3.0, abs=0.3)
    assert statistics.mean(clipped) > 4.5  # negative readings cannot exist: biased upwards
    assert sampled.observe(0.0, rng) == 0 and sampled.observe(100.0, rng) == 100


def test_missed_samples_leave_gaps_not_zeros():
    gpu = SimGpu(UUID, sample_period_s=0.1, sample_history_s=100,
                 imperfections=replace(IDEAL, missed_samples=0.2))
    p = gpu.shim_process("p", LAUNCH, region())
    gpu.advance(50)
    values = [s.sm_util for s in gpu.process_utilization(0) if s.pid == p.pid]
    assert 0.7 * 500 <= len(values) <= 0.9 * 500
    assert min(values) == 100


@pytest.mark.parametrize("attribution", ["per-process", "time-sliced"])
def test_a_sample_is_read_only_its_lag_after_its_stamp_and_in_stamp_order(attribution):
    gpu = gpu_with(sample_lag_s=0.03, sample_lag_jitter_s=0.05, nvml_attribution=attribution)
    gpu.shim_process("p", LAUNCH, region())
    newest, lags = 0, []
    for _ in range(3000):  # 3 s in 1 ms steps, read after each
        gpu.advance(0.001)
        found = gpu.process_utilization(newest)
        if found:
            stamp = max(s.timestamp_us for s in found)
            assert stamp > newest  # in stamp order
            lags.append(gpu.now_ns // 1000 - stamp)
            newest = stamp
    assert len(lags) >= 15
    assert min(lags) >= 30_000  # never before its lag
    assert max(lags) <= 81_000  # nor after the lag, the jitter and a step
    assert max(lags) - min(lags) >= 10_000  # the jitter drawn


def test_without_a_lag_a_sample_is_read_at_its_stamp():
    gpu = gpu_with()
    gpu.shim_process("p", LAUNCH, region())
    gpu.advance(1 / 6 + 0.0005)
    assert [s.timestamp_us for s in gpu.process_utilization(0)] == [gpu.start_ns // 1000
                                                                  + 166_666]


def test_a_longer_nvml_window_smooths_a_stop_over_several_samples():
    gpu = SimGpu(UUID, sample_period_s=0.2, imperfections=replace(IDEAL, window_periods=3))
    p = gpu.shim_process("p", Workload(kernel_s=0.001, busy=((0.0, 1.0),)), region())
    gpu.advance(2)
    values = [s.sm_util for s in gpu.process_utilization(0) if s.pid == p.pid]
    # periods end at 0.2 .. 2.0 s; launches stop at 1.0 (the 10 ms queue drains after it):
    # the three-period average fades out over three samples
    assert values[3:8] == pytest.approx([100, 100, 67, 33, 0], abs=3)
    assert values[-1] == 0


def test_kernel_jitter_varies_sm_time_per_launch_but_not_on_average():
    def run(jitter: float) -> list[float]:
        gpu = gpu_with(kernel_jitter=jitter)
        p = gpu.shim_process("p", LAUNCH, region(rate=TWENTY_PERCENT))
        gpu.advance(20)
        return [share for _, share in gpu.shares(p, 0.1)]

    steady, jittered = run(0.0)[20:], run(0.3)[20:]
    assert statistics.pstdev(steady) < 0.5
    assert statistics.pstdev(jittered) > 2 * statistics.pstdev(steady) + 0.5
    assert statistics.mean(jittered) == pytest.approx(20, abs=1.5)


def test_contexts_taking_turns_lose_the_switch_cost():
    gpu = gpu_with(switch_s=100e-6, timeslice_s=0.002)
    a = gpu.shim_process("a", Workload(kernel_s=0.001), region("a"))
    b = gpu.shim_process("b", Workload(kernel_s=0.001), region("b"))
    gpu.advance(2)
    total = gpu.shares(a, 1)[-1][1] + gpu.shares(b, 1)[-1][1]
    assert total == pytest.approx(95, abs=0.5)  # 100 us lost per 2 ms slice
    alone = gpu_with(switch_s=100e-6)
    c = alone.shim_process("c", Workload(kernel_s=0.001), region("c"))
    alone.advance(1)
    assert alone.shares(c, 0.5)[-1][1] == pytest.approx(100, abs=0.5)  # nobody to switch to


def test_overlapping_contexts_favour_the_larger_grid():
    gpu = gpu_with(overlap=0.5)
    big = gpu.shim_process("big", Workload(kernel_s=0.001, blocks=3072), region("big"))
    small = gpu.shim_process("small", Workload(kernel_s=0.001, blocks=1024), region("small"))
    gpu.advance(2)
    big_share, small_share = gpu.shares(big, 1)[-1][1], gpu.shares(small, 1)[-1][1]
    # half the time sliced equally, half split 3:1 by grid
    assert big_share == pytest.approx(0.5 * 50 + 0.5 * 75, abs=1)
    assert small_share == pytest.approx(0.5 * 50 + 0.5 * 25, abs=1)


def test_small_grids_leave_sms_idle_and_packed_kernels_cost_more_sm_time_per_token():
    small_grid = Workload(kernel_s=0.001, blocks=33, threads_per_block=128, streams=4)
    one_stream = replace(small_grid, streams=1)
    imperfect = replace(IDEAL, sm_count=132, packing_efficiency=0.8)

    def sm_per_token(workload: Workload, rate: tuple[int, int]) -> tuple[float, float]:
        gpu = SimGpu(UUID, imperfections=imperfect)
        reg = region(rate=rate)
        p = gpu.shim_process("p", workload, reg)
        gpu.advance(4)
        return gpu.shares(p, 2)[-1][1], p.total_sm_s / reg.processes[0].tokens_spent[0]

    alone_share, _ = sm_per_token(one_stream, (0, 0))
    assert alone_share == pytest.approx(25, abs=0.5)  # 33 of 132 SMs busy
    packed_share, packed_cost = sm_per_token(small_grid, (0, 0))
    assert packed_share == pytest.approx(100, abs=1)  # four kernels side by side fill it
    slow_share, slow_cost = sm_per_token(small_grid, (33 * 128 * 100, 33 * 128))
    assert slow_share == pytest.approx(2.5, abs=0.3)  # 100 launches/s, one at a time
    # the same tokens buy 4 / 4**0.8 = 1.32 times the SM time when the kernels pack
    assert packed_cost / slow_cost == pytest.approx(4 / 4**0.8, rel=0.03)


def test_runs_repeat_exactly_for_a_seed_and_differ_between_seeds():
    def samples(seed: int) -> list[int]:
        gpu = SimGpu(UUID, seed=seed)
        gpu.shim_process("p", LAUNCH, region(rate=TWENTY_PERCENT))
        gpu.advance(3)
        return [s.sm_util for s in gpu.process_utilization(0)]

    assert samples(1) == samples(1)
    assert samples(1) != samples(2)


@pytest.mark.parametrize(
    ("field", "value"),
    [("nvml_sigma", -1.0), ("nvml_noise", "pink"), ("missed_samples", 1.0), ("window_periods", 0),
     ("kernel_jitter", 2.0), ("switch_s", 0.01), ("overlap", 1.5), ("sm_count", -1),
     ("packing_efficiency", 0.0), ("timeslice_s", 0.0), ("launch_hold_s", -1e-6),
     ("launch_hold_s", 0.5), ("sample_lag_s", -0.01), ("sample_lag_s", 1.0),
     ("sample_lag_jitter_s", -1e-3), ("sample_lag_jitter_s", 2.0)],
)
def test_bad_imperfections_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        Imperfections(**{field: value})


def test_bad_sample_periods_and_streams_are_refused():
    with pytest.raises(ValueError, match="sample period"):
        SimGpu(UUID, sample_period_s=0)
    with pytest.raises(ValueError, match="streams"):
        Workload(kernel_s=0.001, streams=0)


def test_time_sliced_attribution_gives_each_period_whole_to_one_process():
    # as measured on an H200: two processes taking turns, one sample per period, of the GPU
    gpu = gpu_with(nvml_attribution="time-sliced")
    a = gpu.shim_process("a", LAUNCH, region("a", TWENTY_PERCENT))
    b = gpu.shim_process("b", LAUNCH, region("b", TWENTY_PERCENT))
    seen = {}
    for _ in range(180):  # asked every period (1/6 s)
        gpu.advance(1 / 6)
        seen.update({(s.timestamp_us, s.pid): s for s in gpu.samples})
    samples = list(seen.values())
    stamps = [s.timestamp_us for s in samples]
    assert len(stamps) == len(set(stamps)) > 150  # never two samples for one period
    assert statistics.median(s.sm_util for s in samples) == pytest.approx(40, abs=2)
    given = [s.pid for s in samples]
    assert 0.35 < given.count(a.pid) / len(given) < 0.65  # equal work, about equal odds
    assert given.count(a.pid) + given.count(b.pid) == len(given)


def test_time_sliced_attribution_leaves_a_process_alone_its_own_use():
    gpu = gpu_with(nvml_attribution="time-sliced")
    gpu.shim_process("a", LAUNCH, region("a", TWENTY_PERCENT))
    gpu.advance(5.0)
    assert {s.sm_util for s in list(gpu.samples)[-20:]} == {20}
    # truncated to the percent, as the H200 read it, its periods of 19.2-20.4 % read below
    truncating = gpu_with(nvml_attribution="time-sliced", nvml_truncates=True)
    truncating.shim_process("a", LAUNCH, region("a", TWENTY_PERCENT))
    truncating.advance(5.0)
    read = [s.sm_util for s in list(truncating.samples)[-20:]]
    assert set(read) <= {19, 20} and 19 <= statistics.fmean(read) < 20


def test_time_sliced_periods_asked_for_together_share_out_their_use():
    # measured on the H200: asked every second beside two processes, one sample each, their
    # values the GPU's use in the periods each was given over all five (40 / 60 where each
    # period read 99); asked every period, one sample of the whole use
    gpu = SimGpu(UUID, imperfections=H200_TIME_SLICED, sample_period_s=0.2)
    tokens_per_s = round(0.2 / 200e-6) * 131_072  # 20 % each of 200 us kernels: 66 busy
    procs = [gpu.shim_process(f"p{n}", twenty_percent_of(200e-6),
                              region(f"p{n}", (tokens_per_s, 40 * 131_072))) for n in range(2)]
    gpu.advance(2.0)
    since = max(s.timestamp_us for s in gpu.process_utilization(0))
    for _ in range(10):
        gpu.advance(0.2)
        (one,) = gpu.process_utilization(since)
        assert one.sm_util == pytest.approx(66, abs=3)
        since = one.timestamp_us
    sums = []
    for _ in range(10):
        gpu.advance(1.0)
        read = gpu.process_utilization(since)
        assert 1 <= len(read) <= 2 and len({s.pid for s in read}) == len(read)
        assert {s.pid for s in read} <= {p.pid for p in procs}
        # whole periods of 66 each, over the five
        assert all(any(abs(s.sm_util - k * 66 / 5) <= 2 for k in range(1, 6)) for s in read)
        sums.append(sum(s.sm_util for s in read))
        since = max(s.timestamp_us for s in read)
    assert statistics.median(sums) == pytest.approx(66, abs=3)
    # asked again for the same time, the same answer
    assert gpu.process_utilization(since - 1_000_000) == [
        s for s in gpu.samples if s.timestamp_us > since - 1_000_000]


def test_an_unknown_attribution_is_refused_by_name():
    with pytest.raises(ValueError, match="nvml_attribution"):
        Imperfections(nvml_attribution="per-gpu")


def twenty_percent_of(kernel_s: float) -> Workload:
    """The H200 check's kernel: 1024 blocks x 128 threads (131,072 tokens a launch)."""
    return Workload(kernel_s=kernel_s, blocks=1024, threads_per_block=128)


def busy_read(imperfections: Imperfections, kernel_s: float, processes: int) -> list[int]:
    """NVML's values for `processes` each held to 20 % of the work by its bucket."""
    gpu = SimGpu(UUID, imperfections=imperfections, sample_period_s=0.2)
    tokens_per_s = round(0.2 / kernel_s) * 131_072
    for n in range(processes):
        gpu.shim_process(f"p{n}", twenty_percent_of(kernel_s),
                         region(f"p{n}", (tokens_per_s, 40 * 131_072)))
    seen = {}
    for _ in range(50):  # asked every period
        gpu.advance(0.2)
        seen.update({(s.timestamp_us, s.pid): s.sm_util for s in gpu.samples})
    return [v for (stamp, _), v in sorted(seen.items()) if stamp > 2_000_000 + gpu.start_ns // 1000]


def test_launch_holds_count_busy_as_on_the_h200_while_processes_take_turns():
    # measured: 20 % + 20 % read 99 with 20 us kernels, 66 with 200 us ones
    assert statistics.median(busy_read(H200_TIME_SLICED, 20e-6, 2)) >= 99
    assert statistics.median(busy_read(H200_TIME_SLICED, 200e-6, 2)) == pytest.approx(66, abs=3)
    # without holds the same GPU reads the work: 40
    no_hold = replace(H200_TIME_SLICED, launch_hold_s=0.0)
    assert statistics.median(busy_read(no_hold, 20e-6, 2)) == pytest.approx(40, abs=2)


def test_a_process_alone_reads_its_own_work_whatever_its_launches_hold():
    # measured: alone, 50 / 20 / 5 % of the work read 50 / 20 / 5, exactly
    assert set(busy_read(H200_TIME_SLICED, 20e-6, 1)) <= {19, 20, 21}


def test_launch_holds_leave_per_process_samples_and_the_work_alone():
    gpu = SimGpu(UUID, imperfections=replace(H200_TIME_SLICED, nvml_attribution="per-process"),
                 sample_period_s=0.2)
    procs = [gpu.shim_process(f"p{n}", twenty_percent_of(20e-6),
                              region(f"p{n}", (10_000 * 131_072, 40 * 131_072))) for n in range(2)]
    gpu.advance(5.0)
    assert {s.sm_util for s in list(gpu.samples)[-10:]} <= {19, 20, 21}
    # the holds are counted, not spent: each still did its 20 %
    for p in procs:
        assert p.total_sm_s / 5.0 == pytest.approx(0.2, abs=0.01)
