"""The ideal simulated GPU: time-sharing, the shim's token rule on a region, NVML-like samples.

The imperfect plant's effects are tested one by one in `test_simulation_imperfections.py`."""

from __future__ import annotations

import math

import pytest

from vgpu_agent.gpu.model import GpuError
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, Workload
from vgpu_agent.simulation.imperfections import IDEAL
from vgpu_agent.simulation.region import SimRegion

UUID = "GPU-sim"


def region(name="r", limit=50.0, policy="strict", rate=(0, 0)) -> SimRegion:
    r = SimRegion(name, (UUID,), (limit,), (policy,))
    r.rates[0] = rate
    return r


def test_unthrottled_processes_time_share_the_gpu_equally():
    gpu = SimGpu(UUID, imperfections=IDEAL)
    a = gpu.shim_process("a", Workload(kernel_s=0.001), region("a"))
    b = gpu.shim_process("b", Workload(kernel_s=0.004), region("b"))
    gpu.advance(2)
    assert gpu.shares(a, 1)[-1][1] == pytest.approx(50, abs=1)
    assert gpu.shares(b, 1)[-1][1] == pytest.approx(50, abs=1)


def test_occupancy_scales_sm_time_and_idle_time_is_left_idle():
    gpu = SimGpu(UUID, imperfections=IDEAL)
    half = gpu.shim_process("half", Workload(kernel_s=0.001, occupancy=0.5), region())
    gpu.advance(1)
    assert gpu.shares(half, 0.5)[-1][1] == pytest.approx(50, abs=1)


def test_busy_intervals_start_and_stop_the_launches():
    gpu = SimGpu(UUID, imperfections=IDEAL)
    p = gpu.shim_process("p", Workload(kernel_s=0.001, busy=((1.0, 2.0),)), region())
    gpu.advance(3)
    series = {round(t, 1): share for t, share in gpu.shares(p, 0.5)}
    assert series[1.0] == 0
    assert series[2.0] == pytest.approx(100, abs=1)
    assert series[3.0] == 0


def test_token_rate_limits_launches_exactly_and_waits_are_recorded():
    # 1024 x 256 = 262144 tokens a launch, 2 ms each; 26.2144e6 tokens/s buys 100 launches/s
    # = 20% of the GPU.
    reg = region(rate=(26_214_400, 2 * 262_144))
    gpu = SimGpu(UUID, imperfections=IDEAL)
    p = gpu.shim_process("p", Workload(kernel_s=0.002), reg)
    gpu.advance(3)
    assert gpu.shares(p, 2)[-1][1] == pytest.approx(20, abs=0.5)
    slot = reg.processes[0]
    assert slot.launches[0] == pytest.approx(300, abs=3)
    assert slot.tokens_spent[0] == slot.launches[0] * 262_144
    # It wanted far more, so it spent most of the time waiting for tokens.
    assert slot.wait_ns[0] > 2e9
    assert reg.usage().tokens_spent == (slot.tokens_spent[0],)


def test_processes_of_one_region_share_one_bucket():
    reg = region(rate=(26_214_400, 2 * 262_144))
    gpu = SimGpu(UUID, imperfections=IDEAL)
    procs = [gpu.shim_process(f"p{i}", Workload(kernel_s=0.002), reg) for i in range(3)]
    gpu.advance(3)
    total = sum(gpu.shares(p, 2)[-1][1] for p in procs)
    assert total == pytest.approx(20, abs=0.5)  # not three times the rate


@pytest.mark.parametrize(
    ("policy", "limit", "rate"),
    [("off", 30, (1000, 1000)), ("strict", 100, (1000, 1000)), ("strict", 30, (0, 0))],
)
def test_the_shim_does_not_throttle_where_the_abi_says_unlimited(policy, limit, rate):
    gpu = SimGpu(UUID, imperfections=IDEAL)
    p = gpu.shim_process("p", Workload(kernel_s=0.001), region(limit=limit, policy=policy,
                                                                rate=rate))
    gpu.advance(1)
    assert gpu.shares(p, 0.5)[-1][1] == pytest.approx(100, abs=1)


def test_a_paused_bucket_stops_launches_until_the_bounded_wait_expires():
    # rate 0 with a burst: paused. The shim still lets a launch through after 2 s of waiting.
    reg = region(rate=(0, 10))
    gpu = SimGpu(UUID, imperfections=IDEAL)
    p = gpu.shim_process("p", Workload(kernel_s=0.001), reg)
    gpu.advance(1.5)
    assert reg.processes[0].launches[0] == 0
    gpu.advance(1.0)
    assert reg.processes[0].launches[0] >= 1
    assert p.total_sm_s < 0.01


def test_samples_are_whole_percents_of_finished_periods_and_only_newer_ones_are_returned():
    gpu = SimGpu(UUID, sample_period_s=0.2, imperfections=IDEAL)
    a = gpu.shim_process("a", Workload(kernel_s=0.001), region("a", rate=(0, 0)))
    gpu.advance(0.19)
    assert gpu.process_utilization(0) == []  # the first period has not finished
    gpu.advance(0.81)
    samples = gpu.process_utilization(0)
    assert [s.pid for s in samples] == [a.pid] * 5
    assert all(s.sm_util == 100 and isinstance(s.sm_util, int) for s in samples)
    stamps = [s.timestamp_us for s in samples]
    assert stamps == sorted(stamps) and stamps[1] - stamps[0] == 200_000
    assert gpu.process_utilization(stamps[2]) == samples[3:]


def test_not_supported_is_reported_like_nvml_does():
    gpu = SimGpu(UUID, per_process_samples=False)
    backend = SimBackend([gpu])
    with pytest.raises(GpuError) as err:
        backend.process_utilization(UUID, 0)
    assert err.value.code == 3
    with pytest.raises(GpuError, match="no simulated GPU"):
        backend.process_utilization("GPU-other", 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kernel_s": 0}, "kernel duration"),
        ({"kernel_s": 0.001, "blocks": 0}, "blocks"),
        ({"kernel_s": 0.001, "occupancy": 1.5}, "occupancy"),
    ],
)
def test_bad_workloads_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**kwargs)


def test_bad_regions_and_steps_are_refused():
    with pytest.raises(ValueError, match="core limit"):
        SimRegion("r", (UUID,), (0.0,), ("strict",))
    with pytest.raises(ValueError, match="policy"):
        SimRegion("r", (UUID,), (30.0,), ("fair",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one core limit"):
        SimRegion("r", (UUID, UUID), (30.0,), ("strict",))
    with pytest.raises(ValueError, match="step"):
        SimGpu(UUID, step_s=0.5, imperfections=IDEAL)
    with pytest.raises(ValueError, match="rate and burst"):
        region().set_rate(0, -1, 10)


def test_workload_busy_intervals_and_cost():
    w = Workload(kernel_s=0.001, blocks=10, threads_per_block=32, busy=((1, 2), (5, math.inf)))
    assert w.cost == 320
    assert [w.busy_at(t) for t in (0.5, 1.5, 3, 7)] == [False, True, False, True]


def test_a_tenant_gaming_turns_runs_lighter_kernels_only_while_it_finds_itself_alone():
    # 100 launches a second at 2 ms each (20 % of the GPU), 0.5 ms ones (5 %) while alone:
    # the same tokens buy a quarter of the SM time while its neighbour is away
    reg = region(rate=(26_214_400, 2 * 262_144))
    gpu = SimGpu(UUID, imperfections=IDEAL)
    gamer = gpu.shim_process("gamer", Workload(kernel_s=0.002, alone_kernel_s=0.0005), reg)
    gpu.shim_process("other", Workload(kernel_s=0.001, busy=((0.0, 2.0), (4.0, 6.0))),
                     region("other", rate=(13_107_200, 262_144)))
    gpu.advance(6)
    series = {round(t, 1): share for t, share in gpu.shares(gamer, 1)}
    assert series[2.0] == pytest.approx(20, abs=1)  # beside the other: its real kernels
    assert series[4.0] == pytest.approx(5, abs=1)  # alone: light ones
    assert series[6.0] == pytest.approx(20, abs=1)
    assert reg.processes[0].launches[0] == pytest.approx(600, abs=6)  # its tokens all along


def test_a_tenant_varying_its_game_runs_other_kernels_each_time_it_finds_itself_alone():
    # 0.5 ms kernels the first time alone, 4 ms the second, 0.5 ms the third and so on (2 ms
    # beside the other): a quarter, twice, a quarter of the SM time its tokens buy beside it.
    # The first time is its first milliseconds, before the other's first kernel.
    reg = region(rate=(26_214_400, 2 * 262_144))
    gpu = SimGpu(UUID, imperfections=IDEAL)
    gamer = gpu.shim_process(
        "gamer", Workload(kernel_s=0.002, alone_kernels_s=(0.0005, 0.004)), reg)
    gpu.shim_process("other", Workload(kernel_s=0.001, busy=((0.0, 2.0), (4.0, 6.0),
                                                               (8.0, 10.0))),
                     region("other", rate=(13_107_200, 262_144)))
    gpu.advance(12)
    series = {round(t, 1): share for t, share in gpu.shares(gamer, 1)}
    assert series[2.0] == pytest.approx(20, abs=1)
    assert series[4.0] == pytest.approx(40, abs=1)  # the second time alone: heavy
    assert series[6.0] == pytest.approx(20, abs=1)
    assert series[8.0] == pytest.approx(5, abs=1)  # the third: light
    assert series[12.0] == pytest.approx(40, abs=1)  # the fourth: heavy again


def test_a_gaming_workload_with_bad_values_is_refused():
    with pytest.raises(ValueError, match="kernel duration alone must be > 0 s or None, got 0"):
        Workload(kernel_s=0.002, alone_kernel_s=0)
    with pytest.raises(ValueError, match="alone_after_s must be >= 0 s, got -1"):
        Workload(kernel_s=0.002, alone_kernel_s=0.001, alone_after_s=-1)
    with pytest.raises(ValueError, match=r"must all be > 0 s, got \(0.001, 0.0\)"):
        Workload(kernel_s=0.002, alone_kernels_s=(0.001, 0.0))
