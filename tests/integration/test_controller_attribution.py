"""A GPU that has shown per-process samples is not read as time-sliced for a container at 0 %.

Two processes that both used the GPU in one period prove per-process samples (a time-sliced
driver gives each period to one process). Before, ten periods without such a proof turned the
reading back to time-sliced: a container whose tokens came to buy next to nothing read 0 %
beside a busy neighbour, the GPU's use was split by tokens, most of it charged to the container
at 0 %, and its strict-60 neighbour's rate nearly doubled (99 % of the GPU for tenths of a
second, simulated)."""

from __future__ import annotations

import pytest

from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.timesliced import PER_PROCESS_HOLD_S


class Idling(SimBackend):
    """The simulated driver, listing some processes at 0 % from `after_us` on."""

    def __init__(self, gpu: SimGpu, idle: set[int], after_us: int):
        super().__init__([gpu])
        self.idle, self.after_us = idle, after_us

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        return [ProcessSample(s.pid, s.timestamp_us, 0)
                if s.pid in self.idle and s.timestamp_us >= self.after_us else s
                for s in super().process_utilization(uuid, since_us)]


async def test_a_container_read_at_zero_does_not_turn_the_gpu_time_sliced():
    gpu = SimGpu("GPU-proven")
    a = SimRegion("a", (gpu.uuid,), (60.0,), ("strict",))
    b = SimRegion("b", (gpu.uuid,), (40.0,), ("strict",))
    gpu.shim_process("a", Workload(kernel_s=0.0002), a)
    quiet = gpu.shim_process("b", Workload(kernel_s=0.0002), b)
    after_us = gpu.now_ns // 1000 + 5_000_000
    controller = ThrottleController(Idling(gpu, {quiet.pid}, after_us), lambda: [a, b],
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    for tick in range(200):  # 20 s: 15 s, 90 periods, with b listed at 0 while it spends
        gpu.advance(0.1)
        await controller.tick()
        if tick >= 10:
            assert gpu.uuid not in controller.time_sliced_gpus, tick
    assert controller.error_counts == {}
    assert controller._devices["b/0"].last[0].util in (None, 0.0)  # listed at 0 (or no sample)
    assert PER_PROCESS_HOLD_S > 20  # the run lies within the hold


class Jittered(SimBackend):
    """The simulated driver with each process's sample stamped a little apart within its
    period (`offset_us` per process, by pid order), as a driver that stamps every process's
    sample as it takes it might."""

    def __init__(self, gpu: SimGpu, offset_us: int):
        super().__init__([gpu])
        self.offset_us = offset_us

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        found = super().process_utilization(uuid, since_us)
        order = {pid: n for n, pid in enumerate(sorted({s.pid for s in found}))}
        return [ProcessSample(s.pid, s.timestamp_us + order[s.pid] * self.offset_us, s.sm_util)
                for s in found]


async def _pair_shares(offset_us: int) -> tuple[ThrottleController, str, list[float]]:
    gpu = SimGpu("GPU-jitter")
    regions = [SimRegion(name, (gpu.uuid,), (limit,), ("strict",))
               for name, limit in (("a", 60.0), ("b", 40.0))]
    procs = [gpu.shim_process(r.alloc_id, Workload(kernel_s=0.0002), r) for r in regions]
    backend = Jittered(gpu, offset_us) if offset_us else SimBackend([gpu])
    controller = ThrottleController(backend, lambda: regions, clock=lambda: gpu.now_ns,
                                    evidence=SimHostEvidence([gpu]))
    for _ in range(150):  # 15 s
        gpu.advance(0.1)
        await controller.tick()
    return controller, gpu.uuid, [gpu.shares(p, 5)[-1][1] for p in procs]


async def test_per_process_samples_stamped_apart_within_a_period_are_one_period():
    """Two processes' samples of one period, stamped 3 ms apart: still per-process samples of
    one period (the GPU not read as time-sliced, its period 1/6 s, not 3 ms), and the pair is
    steered as with one stamp."""
    controller, uuid, shares = await _pair_shares(offset_us=3_000)
    assert uuid not in controller.time_sliced_gpus
    assert controller.nvml_sample_periods[uuid] == pytest.approx(1 / 6, rel=0.05)
    assert controller.error_counts == {}
    _, _, exact = await _pair_shares(offset_us=0)
    assert shares == pytest.approx(exact, abs=1.0)
    assert shares == pytest.approx([60.0, 40.0], abs=3.0)
