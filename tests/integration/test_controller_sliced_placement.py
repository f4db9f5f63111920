"""On a time-sliced GPU each period names one process, so each of a crowded GPU's processes is
named only now and then: the controller places each process on host evidence once, keeps the
placement while it is named again, and places afresh a pid the kernel gave another process."""

from __future__ import annotations

from pathlib import Path

from tests.fakes.clock import ManualClock
from tests.fakes.hostproc import FakeHostProc
from tests.fakes.shimstate import DeviceSpec, ShimWriter, make_region
from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.shm.regions import Region, format_alloc_id
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.timesliced import SHARED_PERIODS

GIB = 1 << 30
GPU = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
CONTAINERS = 12  # more than SHARED_PERIODS: each named again only after the others' periods
PERIOD_US = 166_000


class TimeSliced:
    """A driver that gives each sample period whole to one process, in turn, with the GPU's
    use as its value (an H200 without MPS), one new period per call."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.period = 0

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        self.period += 1
        return [ProcessSample(self.pids[self.period % len(self.pids)],
                              1_000_000 + self.period * PERIOD_US, 96)]


def _regions(root: Path) -> list[Region]:
    regions = []
    for seq in range(1, CONTAINERS + 1):
        ids = [f"{GPU}::{seq}"]
        alloc_id = format_alloc_id(seq, ids, 1_000 + seq)
        make_region(root, alloc_id, [DeviceSpec(GPU, 4 * GIB, 8.0, "strict")], ids, seq=seq)
        regions.append(Region.open(root / alloc_id))
    return regions


async def test_each_process_is_placed_once_and_a_reused_pid_afresh(tmp_path):
    assert CONTAINERS > SHARED_PERIODS
    regions = _regions(tmp_path / "regions")
    pids = [5_000 + n for n in range(CONTAINERS)]
    host = FakeHostProc(tmp_path / "proc")
    shims = [ShimWriter(r.path) for r in regions]
    for pid, region, shim in zip(pids, regions, shims, strict=True):
        host.container_process(pid, region.path, inner_pid=100, start=1_000)
        shim.process(0, 100, pid, 0, tokens=1_000)
    clock = ManualClock()
    controller = ThrottleController(TimeSliced(pids), lambda: regions, clock=clock,
                                    proc_root=host.path, solo_turns=False)
    evidence = controller.attributor.evidence

    spent = [0]

    async def periods(count: int) -> None:
        for _ in range(count):
            spent[0] += 1_000
            for shim in shims:  # every container spending
                shim.device_totals(0, memory=0, tokens=spent[0])
            clock.advance(PERIOD_US / 1e6)
            await controller.tick()

    try:
        await periods(3 * CONTAINERS)  # each process named three times
        assert controller.time_sliced_gpus == {GPU}
        assert evidence.reads == CONTAINERS  # each mount table read once, not at each period
        recent = controller._recent[GPU]
        assert {recent[pid][0] for pid in pids if pid in recent} <= {r.alloc_id for r in regions}
        # the process of the fourth container ends, and its pid comes back in the eighth's
        reused = pids[3]
        host.end(reused)
        host.container_process(reused, regions[7].path, inner_pid=101, start=2_000)
        await periods(CONTAINERS)
        assert controller._recent[GPU][reused][0] == regions[7].alloc_id
        assert evidence.reads == CONTAINERS + 1  # that pid alone placed afresh
        assert controller.error_counts == {}
    finally:
        for shim in shims:
            shim.close()
        for region in regions:
            region.close()
