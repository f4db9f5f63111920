"""A scrape's two halves: what is taken on the loop (every source called there) and what a
worker thread works out from it alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.fakes.shimstate import DeviceSpec, FileRegion, ShimWriter, make_region
from vgpu_agent.gpu.sim import build_inventory
from vgpu_agent.metrics.collectors import gather_snapshot, take_snapshot
from vgpu_agent.metrics.poller import RegionCache
from vgpu_agent.metrics.sources import MetricsSources

GIB = 1 << 30
GPUS = build_inventory("2xA100-80GB")
G0, G1 = (g.uuid for g in GPUS)


@dataclass
class Status:
    measured_util: float | None
    rate: int
    open_loop: bool = False
    paused: bool = False


class Guarded:
    """Sources that count their calls and refuse any once the loop's half is over."""

    def __init__(self) -> None:
        self.closed = False
        self.calls = 0
        self.throttle = {("a", 0): Status(30.0, 1000), ("b", 1): Status(None, 5, True)}

    def _call(self, value: object) -> object:
        if self.closed:
            raise AssertionError("a source was called outside the loop's half")
        self.calls += 1
        return value

    def sources(self, handles: list[FileRegion]) -> MetricsSources:
        identities = {"a": ("ns", "pa", "c"), "b": ("ns", "pb", "c")}
        return MetricsSources(
            node="n",
            gpus=lambda: self._call(GPUS),  # type: ignore[arg-type,return-value]
            slices_per_gpu=4,
            regions=lambda: handles,
            identity=lambda alloc_id: self._call(identities.get(alloc_id)),  # type: ignore
            throttle_status=lambda: self._call(self.throttle),  # type: ignore
            policy_source=lambda alloc_id: self._call("pod"),  # type: ignore
            claims=lambda: self._call({}),  # type: ignore
        )


async def test_the_threads_half_needs_no_source_and_agrees_with_one_go(tmp_path: Path) -> None:
    handles = []
    for alloc_id, devices, seq in (("a", [G0], 1), ("b", [G0, G1], 2)):
        directory = make_region(tmp_path, alloc_id, [DeviceSpec(u, GIB, 25) for u in devices],
                                [f"{u}::{seq}" for u in devices], seq)
        shim = ShimWriter(directory)
        shim.process(0, 5, 505, len(devices) - 1, memory=GIB, launches=40, wait_ns=7)
        shim.close()
        handles.append(FileRegion(directory))
    cache = RegionCache(lambda: handles)
    await cache.refresh()
    guarded = Guarded()
    sources = guarded.sources(handles)
    pending = gather_snapshot(sources, {}, cache.samples, now_ns=1)
    assert guarded.calls > 0
    guarded.closed = True
    # the controller moves on after the loop's half: the copy taken there is what counts
    guarded.throttle[("a", 0)] = Status(99.0, 1)
    snap = pending.complete()
    guarded.closed = False
    guarded.throttle[("a", 0)] = Status(30.0, 1000)
    assert snap == take_snapshot(sources, {}, cache.samples, now_ns=1)
    by_device = {(c.alloc_id, c.dev): c for c in snap.containers}
    assert sorted(by_device) == [("a", 0), ("b", 0), ("b", 1)]
    assert by_device[("a", 0)].rate == 1000 and by_device[("a", 0)].utilization == 30.0
    assert by_device[("b", 1)].launches == 40 and by_device[("b", 1)].open_loop is True
    assert by_device[("b", 0)].launches == 0  # the process used the region's other GPU
    assert {c.policy_source for c in snap.containers} == {"pod"}
    assert snap.slices_allocated == {G0: 2, G1: 1}


async def test_ids_that_are_not_slices_are_skipped_every_time(tmp_path: Path) -> None:
    # a DRA region's IDs are claim devices, not `<uuid>::<n>`: no slice, also when cached
    directory = make_region(tmp_path, "d", [DeviceSpec(G0, GIB, 25)], ["claim-uid-gpu-0"])
    handles = [FileRegion(directory)]
    cache = RegionCache(lambda: handles)
    await cache.refresh()
    sources = MetricsSources(node="n", gpus=lambda: GPUS, slices_per_gpu=4,
                             regions=lambda: handles)
    for _ in range(2):
        assert take_snapshot(sources, {}, cache.samples).slices_allocated == {}
