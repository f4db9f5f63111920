"""The controller reading per-process utilization through the real NVML backend (pynvml) from
the fake libnvidia-ml.so.1, which serves the samples the simulated GPU produces."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from tests.fakes.fakenvml import FakeNvml
from vgpu_agent.gpu.nvml import NvmlBackend
from vgpu_agent.simulation.gpu import SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.controller import ThrottleController


@pytest.fixture
def backend(fake_nvml: FakeNvml, tmp_path: Path):
    nvml = NvmlBackend(str(fake_nvml.library_path), sysfs_root=tmp_path / "sys")
    nvml.start()
    yield nvml
    nvml.shutdown()
    for _ in range(100):  # leave no NVML init behind for the next test
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            break


async def test_shares_held_with_samples_read_through_nvml(fake_nvml: FakeNvml, backend):
    uuid = fake_nvml.uuids[0]
    gpu = SimGpu(uuid)
    regions = [
        SimRegion("a", (uuid,), (35.0,), ("strict",)),
        SimRegion("b", (uuid,), (65.0,), ("strict",)),
    ]
    procs = [gpu.shim_process(r.alloc_id, Workload(kernel_s=0.002), r) for r in regions]
    controller = ThrottleController(backend, lambda: regions, clock=lambda: gpu.now_ns,
                                    evidence=SimHostEvidence([gpu]))
    for _ in range(50):
        gpu.advance(0.1)
        fake_nvml.set_process_samples(
            uuid, [(s.pid, s.timestamp_us, s.sm_util) for s in gpu.samples]
        )
        await controller.tick()
    assert gpu.shares(procs[0], 2)[-1][1] == pytest.approx(35, abs=2)
    assert gpu.shares(procs[1], 2)[-1][1] == pytest.approx(65, abs=2)
    # the last sample alone, noisy by a few points
    assert controller.status[("a", 0)].measured_util == pytest.approx(35, abs=9)
    assert not controller.open_loop_gpus
    assert controller.error_counts == {}


async def test_open_loop_when_the_driver_cannot_report(fake_nvml: FakeNvml, backend):
    uuid = fake_nvml.uuids[1]
    fake_nvml.update_gpu(uuid, process_utilization_supported=False)
    gpu = SimGpu(uuid)
    region = SimRegion("solo", (uuid,), (40.0,), ("strict",))
    proc = gpu.shim_process("solo", Workload(kernel_s=0.002), region)
    controller = ThrottleController(backend, lambda: [region], clock=lambda: gpu.now_ns)
    for _ in range(20):
        gpu.advance(0.1)
        await controller.tick()
    assert controller.open_loop_gpus == {uuid}
    assert controller.error_counts == {}
    assert 0 < gpu.shares(proc, 1)[-1][1] <= 41
