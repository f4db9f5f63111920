"""A container that spends while NVML lists none of its processes has no reading, not a 0.

A 0 is what NVML says of a process it lists and saw idle: the law takes two in a row, where it
expected use, for a bound on what the container's tokens buy (`throttle/control.py`). A
container whose processes NVML does not list (not placed yet, or missed for several periods)
was not measured at all; one that spends nothing reads 0 (it is idle)."""

from __future__ import annotations

from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.controller import ThrottleController


class Unlisting(SimBackend):
    """The simulated driver, leaving out the samples of some processes."""

    def __init__(self, gpu: SimGpu, hidden: set[int]):
        super().__init__([gpu])
        self.hidden = hidden

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        return [s for s in super().process_utilization(uuid, since_us)
                if s.pid not in self.hidden]


async def test_unlisted_spending_reads_nothing_and_idle_reads_zero():
    gpu = SimGpu("GPU-unlisted")
    regions = [SimRegion(name, (gpu.uuid,), (25.0,), ("strict",)) for name in "abcd"]
    gpu.shim_process("a", Workload(kernel_s=0.002), regions[0])
    hidden = gpu.shim_process("b", Workload(kernel_s=0.002), regions[1])
    # c has no process: it spends nothing; d's listed beside a's: samples per process
    gpu.shim_process("d", Workload(kernel_s=0.002), regions[3])
    backend = Unlisting(gpu, {hidden.pid})
    controller = ThrottleController(backend, lambda: regions, clock=lambda: gpu.now_ns,
                                    evidence=SimHostEvidence([gpu]))
    readings: dict[str, list[float | None]] = {"a": [], "b": [], "c": []}
    for _ in range(40):
        gpu.advance(0.1)
        await controller.tick()
        last = {name: controller._devices[f"{name}/0"].last for name in readings}
        if last["a"] is not None and last["a"][0].util is not None:  # samples came
            for name, found in last.items():
                assert found is not None
                readings[name].append(found[0].util)
    assert len(readings["a"]) > 10 and min(readings["a"]) > 5  # measured, and in use
    assert set(readings["c"]) == {0.0}  # idle: 0, not nothing
    # spent all along, never listed: never read as a 0 the law would learn from
    assert set(readings["b"]) == {None}
    assert controller._devices["b/0"].last[0].spent > 0
    assert controller.status[("b", 0)].rate > 0
