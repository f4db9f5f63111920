"""The operator is told when NVML gives a GPU's use only to a process no container claims while
containers spend: the signature of a driver that counts MPS clients' work as its server's (not
yet measured on a real one), or of a process outside the cluster taking the GPU. Nothing is
said where the containers' own processes are sampled."""

from __future__ import annotations

from structlog.testing import capture_logs

from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.strangers import STRANGERS_ONLY_HOLD_S

SERVER_PID = 4242  # no container's


class ToServer(SimBackend):
    """The simulated driver, every period's use given to one process while `merged` is set."""

    def __init__(self, gpu: SimGpu):
        super().__init__([gpu])
        self.merged = True

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        samples = super().process_utilization(uuid, since_us)
        if not self.merged:
            return samples
        by_stamp: dict[int, int] = {}
        for s in samples:
            by_stamp[s.timestamp_us] = by_stamp.get(s.timestamp_us, 0) + s.sm_util
        return [ProcessSample(SERVER_PID, stamp, min(100, used))
                for stamp, used in sorted(by_stamp.items())]


async def _run(seconds: float, backend: ToServer, gpu: SimGpu, controller: ThrottleController,
               logs: list[dict]) -> list[float]:
    """Ticks for `seconds`; when each warning came (s since the first tick of the run)."""
    start = gpu.now_ns
    at: list[float] = []
    for _ in range(round(seconds * 10)):
        gpu.advance(0.1)
        before = len(logs)
        await controller.tick()
        if any(e["event"] == "throttle_use_only_strangers" for e in logs[before:]):
            at.append((gpu.now_ns - start) / 1e9)
    return at


def _pair() -> tuple[SimGpu, ToServer, ThrottleController]:
    gpu = SimGpu("GPU-mps")
    a = SimRegion("a", (gpu.uuid,), (60.0,), ("strict",))
    b = SimRegion("b", (gpu.uuid,), (40.0,), ("strict",))
    gpu.shim_process("a", Workload(kernel_s=0.0005), a)
    gpu.shim_process("b", Workload(kernel_s=0.0005), b)
    backend = ToServer(gpu)
    controller = ThrottleController(backend, lambda: [a, b], clock=lambda: gpu.now_ns,
                                    evidence=SimHostEvidence([gpu]))
    return gpu, backend, controller


async def test_use_given_only_to_a_stranger_is_told_once_per_episode():
    gpu, backend, controller = _pair()
    with capture_logs() as logs:
        first = await _run(25, backend, gpu, controller, logs)
        assert controller.use_only_strangers_gpus == {gpu.uuid}  # what the gauge shows
        assert all(s.open_loop for s in controller.status.values())  # steered by no reading
        backend.merged = False  # the containers' processes sampled again: the episode ends
        between = await _run(5, backend, gpu, controller, logs)
        assert controller.use_only_strangers_gpus == frozenset()
        assert not any(s.open_loop for s in controller.status.values())
        backend.merged = True
        again = await _run(15, backend, gpu, controller, logs)
    assert len(first) == 1 and STRANGERS_ONLY_HOLD_S <= first[0] <= STRANGERS_ONLY_HOLD_S + 2
    assert between == []
    assert len(again) == 1 and STRANGERS_ONLY_HOLD_S <= again[0] <= STRANGERS_ONLY_HOLD_S + 2
    said = [e for e in logs if e["event"] == "throttle_use_only_strangers"]
    assert [e["pids"] for e in said] == [[SERVER_PID], [SERVER_PID]]
    assert all(e["uuid"] == gpu.uuid and "MPS" in e["detail"] for e in said)


async def test_nothing_is_said_where_the_containers_processes_are_sampled():
    gpu, backend, controller = _pair()
    backend.merged = False
    with capture_logs() as logs:
        assert await _run(25, backend, gpu, controller, logs) == []
    assert controller.use_only_strangers_gpus == frozenset()
    assert controller.error_counts == {}


async def test_an_idle_neighbour_on_that_gpu_is_not_marked_open_loop():
    # Its series is its own: the containers that spent were steered by no reading, while one
    # that spent nothing was steered by nothing at all (a tenant's claims of spending, which
    # can keep such an episode going, mark its own series only).
    gpu = SimGpu("GPU-mps")
    a = SimRegion("a", (gpu.uuid,), (60.0,), ("strict",))
    idle = SimRegion("idle", (gpu.uuid,), (40.0,), ("strict",))
    gpu.shim_process("a", Workload(kernel_s=0.0005), a)
    gpu.shim_process("idle", Workload(kernel_s=0.0005, busy=((1000.0, float("inf")),)), idle)
    backend = ToServer(gpu)
    controller = ThrottleController(backend, lambda: [a, idle], clock=lambda: gpu.now_ns,
                                    evidence=SimHostEvidence([gpu]))
    with capture_logs() as logs:
        told = await _run(15, backend, gpu, controller, logs)
    assert len(told) == 1 and controller.use_only_strangers_gpus == {gpu.uuid}
    flags = {key[0]: s.open_loop for key, s in controller.status.items()}
    assert flags == {"a": True, "idle": False}
